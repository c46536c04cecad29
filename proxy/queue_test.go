package proxy

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvroute/kvroute/routing"
)

// testQueue is a started queue whose room is free places the test hands
// out one at a time; grants are taken as they come.
type testQueue struct {
	q      fairQueue
	places atomic.Int64
}

func newTestQueue(t *testing.T, max, perTenant int) *testQueue {
	tq := &testQueue{}
	tq.q.init(max, perTenant, func(*routing.Request) bool { return tq.places.Load() > 0 }, func(uint64) bool { return false }, func(string, float64) {})
	tq.q.start()
	t.Cleanup(func() {
		// Every waiter left is granted, so that no goroutine outlives
		// the test.
		tq.places.Store(1 << 30)
		for deadline := time.Now().Add(5 * time.Second); tq.q.busy() && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
		time.Sleep(10 * time.Millisecond)
		tq.q.close()
	})
	return tq
}

// waitFor enters a request of tenant id and class c, and returns its
// waiter and a channel that gets it when granted.
func (tq *testQueue) waitFor(t *testing.T, id uint64, c class) (*waiter, <-chan *waiter) {
	return tq.waitForReq(t, id, c, &routing.Request{})
}

// waitForReq is waitFor of request r.
func (tq *testQueue) waitForReq(t *testing.T, id uint64, c class, r *routing.Request) (*waiter, <-chan *waiter) {
	w := &waiter{req: r, who: id, class: c, cost: 500, ready: make(chan struct{}, 1)}
	if shed := tq.q.enter(w, id, "", 1, false); shed != "" {
		t.Fatalf("shed: %s", shed)
	}
	got := make(chan *waiter, 1)
	go func() {
		<-w.ready
		tq.places.Add(-1) // the grantee takes its place
		tq.q.handedOff()
		got <- w
	}()
	return w, got
}

// evicted waits for the waiter of g to be pushed out of the queue, and
// gives back the place its waitFor took.
func (tq *testQueue) evicted(t *testing.T, g <-chan *waiter, why string) {
	t.Helper()
	select {
	case w := <-g:
		if w.state != waitEvicted {
			t.Fatalf("%s: the waiter is %v, want evicted", why, w.state)
		}
		tq.places.Add(1)
	case <-time.After(time.Second):
		t.Fatalf("%s: nobody was evicted", why)
	}
}

// grantedNext hands out one place and waits for g's waiter to get it.
func (tq *testQueue) grantedNext(t *testing.T, g <-chan *waiter, why string) {
	t.Helper()
	tq.places.Add(1)
	select {
	case <-g:
	case <-time.After(time.Second):
		t.Fatalf("%s did not go first", why)
	}
}

// A tenant with a backlog cannot hold back another: the newcomer's start
// tag is the virtual time, ahead of the backlog.
func TestFairQueueNewTenantGoesFirst(t *testing.T) {
	tq := newTestQueue(t, 1024, 1024)
	var noisy []<-chan *waiter
	for range 100 {
		_, g := tq.waitFor(t, 1, classDefault)
		noisy = append(noisy, g)
	}
	// Ten places for the backlog, then a quiet request, then one place.
	for i := range 10 {
		tq.places.Add(1)
		select {
		case <-noisy[i]:
		case <-time.After(time.Second):
			t.Fatalf("noisy request %d was never granted", i)
		}
	}
	q, quiet := tq.waitFor(t, 2, classDefault)
	tq.places.Add(1)
	select {
	case <-quiet:
	case <-noisy[10]:
		t.Fatalf("the backlog went before the quiet tenant (start %v)", q.start)
	case <-time.After(time.Second):
		t.Fatal("nothing was granted")
	}
}

// A backlogged flow's first waiter whose cached prompt has no room gives
// its turn to a later waiter of its flow that starts warm, or has nothing
// cached, at most maxPassed times; a flow's only waiter, and other flows'
// waiters, are never passed over that way.
func TestFairQueueGrantsWarmFirst(t *testing.T) {
	tq := newTestQueue(t, 1024, 1024)
	// The request's model says where its prompt is: "full" cached where
	// there is no room, "warm" cached where there is, "" nowhere.
	tq.warmByModel(t)
	req := func(model string) *routing.Request { return &routing.Request{Model: model} }
	take := func(g <-chan *waiter, why string) *waiter { t.Helper(); return tq.take(t, g, why) }
	// Another tenant's only waiter, whose cache is full, goes first.
	_, alone := tq.waitForReq(t, 2, classDefault, req("full"))
	head, first := tq.waitForReq(t, 1, classDefault, req("full"))
	var later []<-chan *waiter
	for i := range maxPassed + 1 {
		model := "warm"
		if i == 0 {
			model = "" // nothing cached: it may take the place too
		}
		_, g := tq.waitForReq(t, 1, classDefault, req(model))
		later = append(later, g)
	}
	take(alone, "the other tenant's only waiter")
	for i := range maxPassed {
		select {
		case <-first:
			t.Fatalf("the head whose cache is full took grant %d, want a later waiter of its flow", i)
		default:
		}
		if w := take(later[i], "a later warm waiter"); w.req.Alone {
			t.Error("a backlog's waiter was granted as alone")
		}
	}
	take(first, "the head after maxPassed turns")
	if head.passed != maxPassed {
		t.Errorf("the head was passed over %d times, want %d", head.passed, maxPassed)
	}
	take(later[maxPassed], "the last waiter")
}

// With router replicas, a backlog's head whose cache has no room and no
// warmer waiter behind it defers its grant for coldDefer: a warm waiter
// that comes meanwhile (here; a peer's, on a peer) takes the place, and the
// head takes the next one, however long it deferred. A router alone grants
// it at once (TestFairQueueGrantsWarmFirst's last waiters).
func TestFairQueueColdHeadDefersWithPeers(t *testing.T) {
	tq := newTestQueue(t, 1024, 1024)
	tq.warmByModel(t)
	tq.q.mu.Lock()
	tq.q.peers = func() int { return 1 }
	tq.q.mu.Unlock()
	for range 6 {
		tq.q.runs.started(flowOf(1, classDefault), 1, classDefault) // the flood: not alone
	}
	head, first := tq.waitForReq(t, 1, classDefault, &routing.Request{Model: "full"})
	tq.places.Add(1)
	given := time.Now()
	select {
	case <-first:
		t.Fatalf("the cold head was granted %v after the place was free, without deferring", time.Since(given))
	case <-time.After(coldDefer / 2):
	}
	_, warm := tq.waitForReq(t, 1, classDefault, &routing.Request{Model: "warm"})
	select {
	case <-warm:
	case <-time.After(time.Second):
		t.Fatal("the warm waiter that came while the head deferred was not granted")
	}
	tq.take(t, first, "the head, on the next place")
	if head.passed != 1 || head.coldAt.IsZero() {
		t.Errorf("head passed %d times, cold since %v; want once, and a time", head.passed, head.coldAt)
	}
}

// A flow's only waiter goes where it starts now (Alone) only while its
// flow runs less than its share of the router's requests running: a
// flood's, a single waiter in the queue of one of several router replicas,
// may wait at its warm engine's short queue like the rest of the backlog.
func TestFairQueueLoneWaiterOfABacklog(t *testing.T) {
	tq := newTestQueue(t, 1024, 1024)
	granted := func(id uint64) *waiter {
		t.Helper()
		_, g := tq.waitFor(t, id, classDefault)
		return tq.take(t, g, "the only waiter")
	}
	if w := granted(1); !w.req.Alone {
		t.Error("with nothing running, a flow's only waiter was not alone")
	}
	for range 6 {
		tq.q.runs.started(flowOf(1, classDefault), 1, classDefault) // the flood
	}
	if w := granted(1); w.req.Alone {
		t.Error("the only flow running: its only waiter was granted as alone")
	}
	tq.q.runs.started(flowOf(2, classDefault), 1, classDefault)
	if w := granted(2); !w.req.Alone {
		t.Error("a quiet tenant's only waiter beside the flood was not alone")
	}
	if w := granted(1); w.req.Alone {
		t.Error("the flood's only waiter beside a quiet tenant was granted as alone")
	}
}

// warmByModel makes the request's model say where its prompt is cached:
// "full" where there is no room, "warm" where there is, "" nowhere.
func (tq *testQueue) warmByModel(t *testing.T) {
	tq.q.warm = func(r *routing.Request) (bool, bool) {
		if !r.StartNow {
			t.Error("warm was asked of a request not marked StartNow")
		}
		return r.Model != "", r.Model == "warm"
	}
}

// take hands out one place and returns g's waiter once granted.
func (tq *testQueue) take(t *testing.T, g <-chan *waiter, why string) *waiter {
	t.Helper()
	tq.places.Add(1)
	select {
	case w := <-g:
		return w
	case <-time.After(time.Second):
		t.Fatalf("%s was not granted", why)
	}
	return nil
}

// Tenants with backlogs share the places by cost: each gets half.
func TestFairQueueSharesByCost(t *testing.T) {
	tq := newTestQueue(t, 1024, 1024)
	var mu sync.Mutex
	got := map[uint64]int{}
	var all []<-chan *waiter
	for range 40 {
		for _, id := range []uint64{1, 2} {
			w, g := tq.waitFor(t, id, classDefault)
			_ = w
			all = append(all, g)
		}
	}
	for range 20 {
		tq.places.Add(1)
		time.Sleep(2 * time.Millisecond)
	}
	deadline := time.After(time.Second)
	for n := 0; n < 20; {
		for _, g := range all {
			select {
			case w := <-g:
				mu.Lock()
				got[w.tenant.id]++
				mu.Unlock()
				n++
			case <-deadline:
				t.Fatalf("granted %v of 20", got)
			default:
			}
		}
	}
	if got[1] != 10 || got[2] != 10 {
		t.Fatalf("grants %v, want 10 each", got)
	}
}

// A higher class goes first, and a full queue makes room for it by
// evicting a lower class's last waiter.
func TestFairQueueClasses(t *testing.T) {
	tq := newTestQueue(t, 3, 3)
	var flex []<-chan *waiter
	for range 3 {
		_, g := tq.waitFor(t, 1, classFlex)
		flex = append(flex, g)
	}
	w := &waiter{req: &routing.Request{}, class: classFlex, cost: 1, ready: make(chan struct{}, 1)}
	if shed := tq.q.enter(w, 2, "", 1, false); shed != shedFull {
		t.Fatalf("a flex request entered a queue full of flex: %q", shed)
	}
	_, prio := tq.waitFor(t, 2, classDefault)
	tq.evicted(t, flex[2], "a default request in a queue full of flex")
	tq.grantedNext(t, prio, "the default request")
}

// A tenant at its bound makes room for its own higher class by evicting
// its last lower-class waiter; another lower-class request is refused.
func TestFairQueueTenantBoundShedsFlexFirst(t *testing.T) {
	tq := newTestQueue(t, 100, 2)
	var flex []<-chan *waiter
	for range 2 {
		_, g := tq.waitFor(t, 1, classFlex)
		flex = append(flex, g)
	}
	w := &waiter{req: &routing.Request{}, class: classFlex, cost: 1, ready: make(chan struct{}, 1)}
	if shed := tq.q.enter(w, 1, "", 1, false); shed != shedTenant {
		t.Fatalf("a flex request over its tenant's bound: %q", shed)
	}
	if _, g := tq.waitFor(t, 2, classFlex); g == nil {
		t.Fatal("another tenant could not queue")
	}
	_, def := tq.waitFor(t, 1, classDefault)
	tq.evicted(t, flex[1], "the tenant's default request at its bound")
	tq.grantedNext(t, def, "the default request")
}

// A shed's Retry-After is the time the queue, at its recent pace, takes
// to grant what is ahead: a tenant at its bound, its own backlog at its
// share of the grants; otherwise every waiter.
func TestShedRetryAfterFollowsThePace(t *testing.T) {
	tq := newTestQueue(t, 1024, 20)
	q := &tq.q
	if got := q.retryAfter(1, shedFull); got != 1 {
		t.Fatalf("an idle queue's Retry-After is %d, want 1", got)
	}
	// Ten grants a second for a minute: the average is at ten a second.
	now := time.Now()
	q.mu.Lock()
	for i := 600; i > 0; i-- {
		q.pace.granted(now.Add(-time.Duration(i) * 100 * time.Millisecond))
	}
	q.mu.Unlock()
	// The rate read is about ten a second: a boundary's ceiling may be
	// one more.
	near := func(what string, got, want int) {
		if got < want || got > want+1 {
			t.Errorf("%s: Retry-After %d, want %d", what, got, want)
		}
	}
	for range 20 {
		tq.waitFor(t, 1, classDefault)
	}
	near("20 waiting alone at 10 a second", q.retryAfter(1, shedTenant), 2)
	for range 20 {
		tq.waitFor(t, 2, classDefault)
	}
	near("20 waiting at half of 10 a second", q.retryAfter(1, shedTenant), 4)
	near("a full queue of 40 at 10 a second", q.retryAfter(3, shedFull), 4)
	q.mu.Lock()
	q.pace = pace{rate: 0.01, at: now}
	q.mu.Unlock()
	if got := q.retryAfter(1, shedTenant); got != maxRetryAfter {
		t.Errorf("a queue that barely moves: Retry-After %d, want the bound %d", got, maxRetryAfter)
	}
}
