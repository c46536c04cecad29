package proxy

import (
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

// Through the proxy, on an engine that runs four requests at once: while a
// quiet tenant is active (its last request ended just now), a noisy
// tenant's backlog is not given the engine's last free place, and the
// quiet tenant's next request starts in it at once, before any noisy
// request has ended. Without the reserve, the backlog fills the engine and
// the quiet request starts only after a noisy one ends; with the quiet
// tenant gone (not active), the backlog takes every place.
func TestReserveKeepsAPlaceForTheQuietTenant(t *testing.T) {
	for _, tc := range []struct {
		name    string
		reserve int
		warm    bool // the quiet tenant sent a request just before the flood
		running int  // noisy requests that start at once, and before the quiet one
	}{
		{name: "reserve", reserve: 1, warm: true, running: 3},
		{name: "no reserve", reserve: 0, warm: true, running: 4},
		{name: "quiet tenant not active", reserve: 1, running: 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const hold = time.Second
			e := newShortQueueEngine(t, 4, hold)
			opt := Options{Limits: Limits{QueueTimeout: guard, MaxQueue: 100}, Tenants: TenantOptions{Reserve: tc.reserve}}
			h := startProxy(t, routing.NewLeastRequest(nil), opt, e.url)
			h.pool.Load().Endpoints[0].SetCosts(&discovery.Costs{BatchLimit: 4}) // learned: four at once
			if tc.warm {
				postAs(t, h.url, "quiet", "")
			}
			// The flood's requests one at a time, each at the engine or in
			// the queue before the next.
			const flood = 6
			var wg sync.WaitGroup
			warm := len(e.order())
			for i := range flood {
				wg.Add(1)
				go func() { defer wg.Done(); postAs(t, h.url, "noisy", "") }()
				for deadline := time.Now().Add(guard); len(e.order())-warm+h.srv.QueueStatus().Waiting <= i; time.Sleep(time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatalf("noisy request %d reached neither the engine nor the queue", i)
					}
				}
			}
			if n := len(e.order()) - warm; n != tc.running {
				t.Fatalf("%d noisy requests started, want %d", n, tc.running)
			}
			wg.Add(1)
			go func() { defer wg.Done(); postAs(t, h.url, "quiet", "") }()
			wg.Wait()
			// The first noisy requests hold their places for a second:
			// with the reserve the quiet request starts in the free place
			// at once, without it after a noisy request ended.
			order := e.order()[warm:]
			at := slices.Index(order, "Bearer quiet default")
			if tc.reserve > 0 && tc.warm && at != tc.running || at < tc.running {
				t.Fatalf("the quiet request started after %d noisy ones, want %d: %q", at, tc.running, order)
			}
		})
	}
}

// The reserve's rule, on the queue: of a fleet of four places with one
// free, a flex request is held back while a default flow is active even
// above its share, and a default request of a tenant at its share is held
// back only while another default flow is below its share.
func TestReserveHoldsBackByClassAndShare(t *testing.T) {
	tq := newTestQueue(t, 64, 64)
	tq.q.reserve = 1
	tq.q.places = func(*routing.Request) (int64, int64) { return tq.places.Load(), 4 }
	const team, other = 1, 2
	tq.q.runs.started(flowOf(team, classFlex), 1, classFlex)
	for range 2 {
		tq.q.runs.started(flowOf(team, classDefault), 1, classDefault)
	}
	_, flex := tq.waitFor(t, team, classFlex)
	tq.places.Add(1)
	heldBack(t, flex, "a flex request took the last place while a default flow was active")
	// A default request of another tenant, with its own flow below its
	// share (none running), is not held back.
	_, def := tq.waitFor(t, other, classDefault)
	granted(t, def, "a default request below its share was held back")
	tq.q.runs.started(flowOf(other, classDefault), 1, classDefault)
	// The team's default flow (two running, a share of 4×1/3) waits for
	// the other tenant's (one running) while it is below its share...
	_, team2 := tq.waitFor(t, team, classDefault)
	tq.places.Add(1)
	heldBack(t, team2, "a flow at its share took the last place from a flow below its share")
	// ...and takes it once that tenant has its share.
	tq.q.runs.started(flowOf(other, classDefault), 1, classDefault)
	tq.q.wake()
	granted(t, team2, "no flow was below its share, yet the place was held back")
}

// heldBack fails with why if g's waiter is granted within a tenth of a
// second.
func heldBack(t *testing.T, g <-chan *waiter, why string) {
	t.Helper()
	select {
	case <-g:
		t.Fatal(why)
	case <-time.After(100 * time.Millisecond):
	}
}

// granted fails with why unless g's waiter is granted within a second.
func granted(t *testing.T, g <-chan *waiter, why string) {
	t.Helper()
	select {
	case <-g:
	case <-time.After(time.Second):
		t.Fatal(why)
	}
}

// A quiet tenant's burst above its share, beside a flood that runs more,
// is not held back; the flood is. Of eight places with one free: the flood
// runs 5 (and has for a while), the bursting tenant 3 (1 on average), a
// third tenant none (active: its request ended just now).
func TestReserveLetsABurstThrough(t *testing.T) {
	tq := newTestQueue(t, 64, 64)
	tq.q.reserve = 1
	tq.q.places = func(*routing.Request) (int64, int64) { return tq.places.Load(), 8 }
	const flood, burst, quiet = 1, 2, 3
	runs := map[uint64]int{flood: 5, burst: 3, quiet: 1}
	for id, n := range runs {
		for range n {
			tq.q.runs.started(flowOf(id, classDefault), 1, classDefault)
		}
	}
	tq.q.runs.ended(flowOf(quiet, classDefault))
	tq.q.runs.mu.Lock()
	now := time.Now()
	for id, avg := range map[uint64]float64{flood: 5, burst: 1} {
		r := tq.q.runs.m[flowOf(id, classDefault)]
		r.usage, r.at = avg, now
	}
	tq.q.runs.mu.Unlock()
	_, f := tq.waitFor(t, flood, classDefault)
	_, b := tq.waitFor(t, burst, classDefault)
	tq.places.Add(1)
	select {
	case <-b:
	case <-f:
		t.Fatal("the flood took the last place")
	case <-time.After(time.Second):
		t.Fatal("the burst was held back beside a flood that runs more")
	}
}
