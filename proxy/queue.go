package proxy

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

// The queue: requests a saturated fleet cannot start wait in kvroute, not
// in the engines' FIFO queues, and start in an order of kvroute's: by
// class first (priority, then default, then flex), then fairly between
// tenants by the work each request puts on the fleet — start-time fair
// queueing (Goyal, Vin and Cheng, SIGCOMM 1996): a request's start tag is
// the later of the queue's virtual time and its tenant's previous finish
// tag, its finish tag the start plus its cost ÷ the tenant's weight, and
// the smallest start goes first. A tenant that stops waiting keeps no
// credit (its next start is at least the virtual time), and a tenant alone
// gets the whole fleet: the order is work-conserving.
//
// While the fleet has room (routing.Room) and nobody waits, a request
// never touches the queue. A request that finds others waiting queues
// behind them, so that arrivals do not overtake the queue each time a
// place frees; one dispatcher (run) grants places one at a time, to the
// first waiter in order the fleet has room for, and waits for the grantee
// to take its endpoint before it looks again.

// class is a request's priority class.
type class uint8

const (
	classDefault class = iota // the zero value
	classFlex
	classPriority
	numClasses
)

// classNames are the classes' labels, in OpenAI's service_tier words.
var classNames = [numClasses]string{"default", "flex", "priority"}

func (c class) String() string { return classNames[c] }

// rank orders the classes: flex 0, default 1, priority 2.
func (c class) rank() int { return [numClasses]int{1, 0, 2}[c] }

// classOf maps a service_tier value (OpenAI's: "priority" above "default"
// and "auto" above "flex"; "scale" is "default") to a class; ok is false
// for a value OpenAI does not define.
func classOf(v []byte) (c class, ok bool) {
	switch string(v) {
	case "", "auto", "default", "scale":
		return classDefault, true
	case "priority":
		return classPriority, true
	case "flex":
		return classFlex, true
	}
	return classDefault, false
}

// waiter is one request's place in the queue; it lives in the request's
// state and is reused.
type waiter struct {
	req    *routing.Request
	tenant *tenantQ
	who    uint64 // its tenant, also under --queue-fifo (one tenantQ)
	class  class
	cost   float64 // the request's work: uncached prompt tokens plus the output it may ask for
	start  float64 // start tag
	seq    uint64  // arrival order, among equal tags
	since  time.Time
	// notBefore: a request back from a grant that found no endpoint
	// (out of connections, or raced) is not granted again before it, so
	// that it cannot spin.
	notBefore time.Time
	state     waitState
	ready     chan struct{} // a token when granted or evicted
	// atMax: the last pass found its tenant at its max_concurrency.
	atMax bool
	// resume: it continues a stream cut for another request, as its
	// flow's next (enter); owed: when a stream was cut to free a place for
	// it (preempt.go).
	resume bool
	owed   time.Time
	// passed counts the grants a later waiter of its flow took in its
	// turn (warmer); coldAt is when a grant first found it cold with no
	// warmer waiter here (coldDefer).
	passed int
	coldAt time.Time
}

type waitState uint8

const (
	waitOut     waitState = iota // not in the queue
	waitQueued                   // in the queue
	waitGranted                  // granted a place: it picks now
	waitEvicted                  // pushed out by a request of a higher class
)

// tenantQ is a tenant's queue state.
type tenantQ struct {
	id      uint64
	label   string  // its metric label
	weight  float64 // its share (1 unless a budget says otherwise)
	finish  float64 // the finish tag of its last queued request
	waiting int
	byClass [numClasses]int // waiting, by class
}

// fairQueue is the queue; its fields are guarded by mu.
type fairQueue struct {
	mu      sync.Mutex
	waiting []*waiter    // in dispatch order (before)
	n       atomic.Int64 // len(waiting), read without mu
	// atMax counts the waiters whose tenant ran its max_concurrency when
	// last looked at: they wait for their own tenant, not for the fleet.
	atMax   atomic.Int64
	tenants map[uint64]*tenantQ
	vtime   float64
	seq     uint64
	// max bounds the waiters, perTenant each tenant's.
	max, perTenant int
	// room reports whether the fleet would start r now; capped whether
	// tenant runs its max_concurrency; gauge counts the waiters.
	room   func(r *routing.Request) bool
	capped func(tenant uint64) bool
	// warm, when set, reports whether r's prompt is cached on the fleet
	// and whether one endpoint holding it has room (warmer).
	warm func(r *routing.Request) (placed, room bool)
	// peers, when set, counts the other router replicas (coldDefer).
	peers func() int
	gauge func(tenant string, d float64)
	// reserve is the fleet's free places a flow at its share leaves to
	// flows below theirs and of higher classes (reserve.go; 0: none);
	// places counts the fleet's free and total places for a request; runs
	// are the flows' requests running.
	reserve int
	places  func(r *routing.Request) (free, total int64)
	runs    tenantRuns
	// cut, when set, cuts a stream of one of flows for r (preempt.go).
	cut func(r *routing.Request, flows []uint64) bool
	// pace is the rate of grants (pace.go).
	pace pace
	// kick wakes the dispatcher; handed tells it the grantee has taken
	// its endpoint (or given up).
	kick, handed chan struct{}
	stop         chan struct{}
	closing      sync.Once
	stopped      sync.WaitGroup
}

func (q *fairQueue) init(max, perTenant int, room func(*routing.Request) bool, capped func(uint64) bool, gauge func(string, float64)) {
	q.max, q.perTenant, q.room, q.capped, q.gauge = max, perTenant, room, capped, gauge
	q.tenants = make(map[uint64]*tenantQ)
	q.kick, q.handed, q.stop = make(chan struct{}, 1), make(chan struct{}, 1), make(chan struct{})
}

// before orders waiters: higher class, then smaller start tag, then
// earlier arrival.
func before(a, b *waiter) bool {
	if a.class != b.class {
		return a.class.rank() > b.class.rank()
	}
	if a.start != b.start {
		return a.start < b.start
	}
	return a.seq < b.seq
}

// busy reports whether requests wait for the fleet: a new one then queues
// behind them. Those that wait only for their own tenant's places do not
// hold others up. Two atomic loads.
func (q *fairQueue) busy() bool { return q.n.Load() > q.atMax.Load() }

// freed tells the dispatcher that a request ended (its endpoint, and its
// tenant, may have room now), when anyone waits.
func (q *fairQueue) freed() {
	if q.n.Load() > 0 {
		q.wake()
	}
}

// Reasons a request is shed from the queue (429), the shed metric's label.
const (
	shedFull    = "queue_full"  // the queue was full of requests of its class or higher
	shedTenant  = "tenant_full" // its tenant had its bound of requests waiting
	shedTimeout = "timeout"     // it waited the queue timeout
	shedEvicted = "evicted"     // a request of a higher class took its place
)

// enter puts w, a request of tenant id (labelled label, its share
// weight), in the queue: a new request is charged its cost (its tags), one
// going back after a grant that found no endpoint keeps its tags. It
// reports why it could not ("" when it did): the queue is full of
// requests of w's class or higher, or w's tenant has its bound waiting. A
// full queue makes room for a higher class by evicting its last waiter.
func (q *fairQueue) enter(w *waiter, id uint64, label string, weight float64, again bool) (shed string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	t := q.tenants[id]
	if t == nil {
		t = &tenantQ{id: id, label: label}
		q.tenants[id] = t
	}
	t.weight = weight
	if !again && !w.resume && t.waiting >= q.perTenant {
		// The tenant's own lower class makes room, else it waits no more.
		last := q.last(func(x *waiter) bool { return x.tenant == t && !x.resume })
		if last == nil || last.class.rank() >= w.class.rank() {
			return shedTenant
		}
		q.remove(last, waitEvicted)
	}
	if len(q.waiting) >= q.max && !w.resume {
		last := q.last(func(x *waiter) bool { return !x.resume })
		if q.max <= 0 || last == nil || last.class.rank() >= w.class.rank() {
			return shedFull
		}
		q.remove(last, waitEvicted)
	}
	q.tenants[id] = t // again: an eviction that emptied the queue forgot it
	w.tenant = t
	w.notBefore = time.Time{}
	if again {
		w.notBefore = time.Now().Add(queuePoll)
	}
	switch {
	case w.resume && !again:
		// A cut stream goes first of its flow, its order kept (w.seq),
		// charged nothing more.
		w.passed, w.coldAt, w.owed = 0, time.Time{}, time.Time{}
		w.start = max(q.vtime, t.finish)
		for _, x := range q.waiting {
			if x.tenant == t && x.class == w.class {
				w.start = min(w.start, max(q.vtime, x.start))
			}
		}
	case !again:
		w.passed, w.coldAt, w.owed = 0, time.Time{}, time.Time{}
		w.start = max(q.vtime, t.finish)
		t.finish = w.start + w.cost/t.weight
		w.seq = q.seq
		q.seq++
	}
	i, _ := slices.BinarySearchFunc(q.waiting, w, func(x, y *waiter) int {
		if before(x, y) {
			return -1
		}
		return 1
	})
	q.waiting = slices.Insert(q.waiting, i, w)
	q.n.Store(int64(len(q.waiting)))
	t.waiting++
	t.byClass[w.class]++
	w.state = waitQueued
	q.gauge(t.label, 1)
	q.wake()
	return ""
}

// last returns the last waiter in order that is, for which there is one
// (a tenant at its bound has one); q.mu is held.
func (q *fairQueue) last(is func(*waiter) bool) *waiter {
	for i := len(q.waiting) - 1; i >= 0; i-- {
		if is(q.waiting[i]) {
			return q.waiting[i]
		}
	}
	return nil
}

// remove takes w out of the queue into state st; q.mu is held.
func (q *fairQueue) remove(w *waiter, st waitState) {
	if i := slices.Index(q.waiting, w); i >= 0 {
		q.waiting = slices.Delete(q.waiting, i, i+1)
		q.n.Store(int64(len(q.waiting)))
	}
	w.tenant.waiting--
	w.tenant.byClass[w.class]--
	w.state = st
	if w.atMax {
		w.atMax = false
		q.atMax.Add(-1)
	}
	q.gauge(w.tenant.label, -1)
	if st != waitOut {
		w.ready <- struct{}{}
	}
	if len(q.waiting) == 0 {
		// Idle: a tenant whose tags are behind the virtual time has
		// nothing to remember.
		for id, t := range q.tenants {
			if t.finish <= q.vtime || len(q.tenants) > maxTenants {
				delete(q.tenants, id)
			}
		}
	}
}

// maxTenants bounds the tenants an idle queue remembers.
const maxTenants = 4096

// leave takes w out of the queue (the client left, or its wait timed out)
// and reports its state: waitGranted when a grant came first, which the
// caller then holds (it must take it or hand it on: handedOff).
func (q *fairQueue) leave(w *waiter) waitState {
	q.mu.Lock()
	defer q.mu.Unlock()
	st := w.state
	if st == waitQueued {
		q.remove(w, waitOut)
	}
	return st
}

func (q *fairQueue) wake() {
	select {
	case q.kick <- struct{}{}:
	default:
	}
}

// handedOff tells the dispatcher that the grantee has taken its endpoint
// or gone back: it may grant the next place.
func (q *fairQueue) handedOff() {
	select {
	case q.handed <- struct{}{}:
	default:
	}
}

// grant gives a place to the first waiter in order that the fleet has
// room for, or to a later one of its flow (warmer), and reports whether
// there was one.
func (q *fairQueue) grant() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	var p grantPass
	if w := q.owedFirst(&p); w != nil { // the place a cut freed for it
		q.vtime = max(q.vtime, w.start)
		w.req.Alone = true // it starts where the place freed, not in a warm engine's queue
		q.remove(w, waitGranted)
		q.pace.granted(time.Now())
		return true
	}
	for i, w := range q.waiting {
		if !q.eligible(&p, w) {
			continue
		}
		// A backlogged flow's request may wait at a warm engine's short
		// queue (its backlog gains the cache hits); a quiet flow's only
		// one (its tenant's only one of its class, beside flows that run
		// more: a tenant's interactive request beside its own flex
		// backlog) goes where it starts now.
		alone := w.tenant.byClass[w.class] == 1 && q.quiet(&p, w)
		turn := w // the place is its turn: the virtual time is its start
		if !alone {
			o, wait := q.warmer(&p, i, w)
			if wait {
				continue
			}
			if o != nil {
				w.passed++
				w = o
			}
		}
		q.vtime = max(q.vtime, turn.start)
		w.req.Alone = alone
		q.remove(w, waitGranted)
		q.pace.granted(time.Now())
		return true
	}
	q.preemptFor(&p)
	return false
}

// quiet reports whether w's flow runs less than its share of this
// router's requests running (its weight's part among the active flows):
// a flow at its share is the backlog, even with one waiter here — with
// router replicas each queue holds a fraction of a flood, often a single
// request, and sending it where it starts now computed its prompt cold
// beside the warm engine's short queue (llm-d simulator, shared-prefix
// past capacity, eight replicas: issue #37). q.mu is held.
func (q *fairQueue) quiet(p *grantPass, w *waiter) bool {
	v := &p.shares
	if !v.built {
		v.build(q)
	}
	mine := v.runs[flowOf(w.who, w.class)]
	return v.running == 0 || float64(mine.running)*v.sumW < float64(v.running)*mine.weight
}

// grantPass is what one pass of grant learned of the fleet.
type grantPass struct {
	none   []string      // models found without room
	held   []tenantModel // tenants held back from the reserve, per model
	shares shareView
	now    time.Time
}

// clock returns the pass's time, read once.
func (p *grantPass) clock() time.Time {
	if p.now.IsZero() {
		p.now = time.Now()
	}
	return p.now
}

type tenantModel struct {
	who   uint64
	model string
}

// eligible reports whether w may be granted a place now: it is not held
// back from a grant it came back from, its tenant does not run its
// max_concurrency, the fleet has room for it, and the reserve does not
// keep that room for another flow; q.mu is held.
func (q *fairQueue) eligible(p *grantPass, w *waiter) bool {
	if !w.notBefore.IsZero() && p.clock().Before(w.notBefore) {
		return false
	}
	if capped := q.capped(w.who); capped != w.atMax {
		w.atMax = capped
		if capped {
			q.atMax.Add(1)
		} else {
			q.atMax.Add(-1)
		}
	}
	if w.atMax {
		return false
	}
	plain := len(w.req.Tried) == 0 && !w.req.Prefill
	if plain && slices.Contains(p.none, w.req.Model) {
		return false
	}
	if plain && slices.Contains(p.held, tenantModel{w.who, w.req.Model}) {
		return false
	}
	if !q.room(w.req) {
		if plain {
			p.none = append(p.none, w.req.Model)
		}
		return false
	}
	if q.holdBack(&p.shares, w.req, flowOf(w.who, w.class), w.class) {
		p.held = append(p.held, tenantModel{w.who, w.req.Model})
		return false
	}
	return true
}

// Warmer grants: a flow's first waiter whose cached prompt has no room
// now (the batches and short queues of the endpoints holding it are full)
// gives its turn to the first of the next warmLookAhead waiters of its
// flow that would start warm, or that has nothing cached to lose, at most
// maxPassed times; then it goes where there is room. Under a backlog every
// freed place went to the first waiter: when its cache was elsewhere it
// recomputed its prompt on the freed endpoint and copied it there,
// crowding that endpoint's cache (llm-d simulator, shared-prefix past
// capacity: 81–84% of prompt tokens cached with one router, 72–75% with
// eight replicas, each granting from its own queue; 85–86% and 77–79%
// with warm grants).
const (
	warmLookAhead = 16
	maxPassed     = 8
)

// coldDefer is how long, with router replicas, a cold head with no warmer
// waiter of its flow here waits before it takes a place. Each replica
// queues a fraction of a backlog: the replica whose request ended is woken
// first, and its own few waiters are often cold there, while a peer's
// queue holds a request whose prompt that endpoint caches. Peers learn of
// the freed place within their load exchange (a few ms) and take it; when
// none does, the head takes it after coldDefer (llm-d simulator,
// shared-prefix past capacity, eight replicas: issue #37).
const coldDefer = 2 * queuePoll

// warmer returns the waiter of head's flow after it (head is
// q.waiting[i]) that should take head's place, or nil; wait when none
// should and head, cold, defers (coldDefer). q.mu is held.
func (q *fairQueue) warmer(p *grantPass, i int, head *waiter) (o *waiter, wait bool) {
	if q.warm == nil || head.passed >= maxPassed || q.warmRoom(head) {
		return nil, false
	}
	looked := 0
	for _, o := range q.waiting[i+1:] {
		if looked == warmLookAhead {
			break
		}
		if o.tenant != head.tenant || o.class != head.class {
			continue
		}
		looked++
		if q.eligible(p, o) && q.warmRoom(o) {
			return o, false
		}
	}
	if q.peers == nil || q.peers() == 0 {
		return nil, false
	}
	if head.coldAt.IsZero() {
		head.coldAt = p.clock()
	}
	return nil, p.clock().Sub(head.coldAt) < coldDefer
}

// warmRoom reports whether w, granted a place as part of a backlog, would
// start warm (an endpoint holding its prompt has room) or has no prompt
// cached anywhere to lose. It reads a copy of the request: the waiter's
// own goroutine owns it.
func (q *fairQueue) warmRoom(w *waiter) bool {
	r := *w.req
	r.StartNow, r.Alone = true, false
	placed, room := q.warm(&r)
	return !placed || room
}

// The dispatcher's pace: it looks at the queue at least every queuePoll
// (the fleet's room changes with scrapes and backoffs too, not only when
// a request ends), and waits for a grantee at most handoffWait.
const (
	queuePoll   = 25 * time.Millisecond
	handoffWait = 50 * time.Millisecond
)

// run is the dispatcher, until close.
func (q *fairQueue) run() {
	defer q.stopped.Done()
	tick := time.NewTicker(queuePoll)
	defer tick.Stop()
	wait := time.NewTimer(handoffWait)
	for {
		select {
		case <-q.stop:
			return
		case <-q.kick:
		case <-tick.C:
		}
		for q.grant() {
			wait.Reset(handoffWait)
			select {
			case <-q.stop:
				return
			case <-q.handed:
			case <-wait.C:
			}
		}
	}
}

func (q *fairQueue) start() {
	q.stopped.Add(1)
	go q.run()
}

func (q *fairQueue) close() {
	q.closing.Do(func() { close(q.stop) })
	q.stopped.Wait()
}

// saturated reports, once the policy found no endpoint usable for r,
// whether that is because routable endpoints are saturated — without
// room, full (backpressure), at r's in-flight cap (not yet tried), out
// of connections (busy), or shedding load (answering 429) — so that the
// request may wait for one, rather than because all failed it.
func saturated(set *discovery.Set, r *routing.Request, busy []*discovery.Endpoint) bool {
	for _, e := range set.Serving {
		if e.Routable() && e.Serves(r.Model) && (!slices.Contains(r.Tried, e) || slices.Contains(busy, e) || e.Shedding()) {
			return true
		}
	}
	return false
}

// queueWait holds st's request in the queue until it is granted a place:
// nil then (the caller hands the grant on once it has its endpoint or goes
// back: handOff), ErrOverloaded when it cannot queue (the queue timeout is
// 0, the queue or its tenant's bound is full), is evicted by a higher
// class or waits the queue timeout, ErrClientGone when the client leaves
// meanwhile. again: the request was granted before and goes back (it
// keeps its place in the order, and its wait started then).
func (s *Server) queueWait(ctx *fasthttp.RequestCtx, st *reqState, again bool) error {
	w := &st.wait
	if s.opt.QueueTimeout <= 0 {
		return s.shed(st, shedFull)
	}
	id := s.queueTenant(st)
	if !again {
		w.since = time.Now()
		w.req, w.class, w.who = &st.req, st.class, st.tenant
		w.cost = float64(max(st.req.PromptTokens-s.cachedTokens(&st.req), 1) + st.outputEstimate())
		if s.opt.Tenants.FIFO {
			w.class, w.cost = classDefault, 1 // arrival order
		}
		w.resume = st.resumed
		if st.resumed {
			w.seq, w.cost = st.resumeSeq, 0 // charged when it first came
		}
	}
	if shed := s.queue.enter(w, id, s.tenantLabel(id), s.weightOf(id), again); shed != "" {
		return s.shed(st, shed)
	}
	t := time.NewTimer(queuePoll)
	defer t.Stop()
	for {
		select {
		case <-w.ready:
			if w.state == waitEvicted {
				return s.shed(st, shedEvicted)
			}
			st.granted = true
			return nil
		case <-t.C:
		}
		gone := peerClosed(ctx.Conn())
		if !gone && (w.resume || time.Since(w.since) < s.opt.QueueTimeout) {
			t.Reset(queuePoll)
			continue
		}
		switch s.queue.leave(w) {
		case waitGranted:
			<-w.ready
			if !gone {
				st.granted = true
				return nil // granted as it timed out: it goes
			}
			s.queue.handedOff()
		case waitEvicted:
			<-w.ready
			return s.shed(st, shedEvicted)
		}
		if gone {
			return ErrClientGone
		}
		return s.shed(st, shedTimeout)
	}
}

// handOff tells the dispatcher that st, granted a place, has taken its
// endpoint or goes back to the queue.
func (s *Server) handOff(st *reqState) {
	if st.granted {
		st.granted = false
		s.queue.handedOff()
	}
}

// shed answers st's request 429 for reason (the queue's), counted, with
// the Retry-After the queue's pace gives.
func (s *Server) shed(st *reqState, reason string) error {
	s.opt.Metrics.Overloaded()
	s.opt.Metrics.TenantShed(s.tenantLabel(st.tenant), st.class.String(), reason)
	return &overloadedError{retry: s.queue.retryAfter(s.queueTenant(st), reason)}
}

// queueTenant is st's tenant in the queue: under --queue-fifo every
// request is the one tenant 0.
func (s *Server) queueTenant(st *reqState) uint64 {
	if s.opt.Tenants.FIFO {
		return 0
	}
	return st.tenant
}

// cachedTokens is how many of r's prompt tokens the fleet holds (0 when
// the policy does not say).
func (s *Server) cachedTokens(r *routing.Request) int {
	if s.opt.Cached == nil {
		return 0
	}
	return s.opt.Cached(r)
}

// outputEstimate is the output st's request may ask for, as its cost in
// the queue and its budget: its max_tokens, or 256 when it sets none, at
// most 4,096 (a request's output is usually far below its cap); none for
// embeddings.
func (st *reqState) outputEstimate() int {
	switch {
	case st.req.Kind == routing.KindEmbeddings:
		return 0
	case st.req.MaxTokens <= 0:
		return 256
	}
	return min(st.req.MaxTokens, 4096)
}

// QueueStatus is the queue's state for /debug/queue.
type QueueStatus struct {
	// Waiting counts the requests waiting, ByClass by class.
	Waiting int            `json:"waiting"`
	ByClass map[string]int `json:"by_class"`
	// OldestSeconds is the longest wait so far (0: none waiting).
	OldestSeconds float64 `json:"oldest_wait_seconds"`
	// VirtualTime is the fair queue's virtual time (uncached prompt plus output
	// tokens granted).
	VirtualTime float64 `json:"virtual_time"`
	// Tenants are the tenants the queue remembers: waiting, or still
	// charged beyond the virtual time.
	Tenants []TenantStatus `json:"tenants"`
	Max     int            `json:"max_queue"`
	// MaxPerTenant bounds one tenant's waiting requests; FIFO: the queue
	// is in arrival order (--queue-fifo).
	MaxPerTenant int  `json:"max_queue_per_tenant"`
	FIFO         bool `json:"fifo,omitempty"`
	// Reserve is the saturated fleet's last free places a flow at its
	// share leaves to flows below theirs (--tenant-reserve; reserve.go).
	Reserve int `json:"reserve"`
	// Budgets are the tenants with a budget's limits in use (budgets.go).
	Budgets []BudgetStatus `json:"budgets,omitempty"`
}

// TenantStatus is one tenant's part of the queue.
type TenantStatus struct {
	// Tenant is its metric label (a hash; "other" past the labelled ones).
	Tenant  string  `json:"tenant"`
	Waiting int     `json:"waiting"`
	Weight  float64 `json:"weight"`
	// Ahead is how far its finish tag is past the virtual time: the
	// work it is charged for beyond its share so far.
	Ahead float64 `json:"ahead"`
}

// QueueStatus returns the queue's state.
func (s *Server) QueueStatus() QueueStatus {
	budgets := s.budgetStatus()
	q := &s.queue
	q.mu.Lock()
	defer q.mu.Unlock()
	st := QueueStatus{Waiting: len(q.waiting), ByClass: map[string]int{}, VirtualTime: q.vtime,
		Max: q.max, MaxPerTenant: q.perTenant, FIFO: s.opt.Tenants.FIFO, Reserve: q.reserve, Budgets: budgets}
	now := time.Now()
	for _, w := range q.waiting {
		st.ByClass[w.class.String()]++
		st.OldestSeconds = max(st.OldestSeconds, now.Sub(w.since).Seconds())
	}
	for _, t := range q.tenants {
		st.Tenants = append(st.Tenants, TenantStatus{Tenant: t.label, Waiting: t.waiting, Weight: t.weight, Ahead: max(0, t.finish-q.vtime)})
	}
	slices.SortFunc(st.Tenants, func(a, b TenantStatus) int { return b.Waiting - a.Waiting })
	return st
}
