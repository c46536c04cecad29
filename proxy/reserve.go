package proxy

import (
	"math"
	"sync"
	"time"

	"github.com/kvroute/kvroute/routing"
)

// The reserve: while flows share a saturated fleet, a flow running its
// share of the fleet's places or more (its weight's part of them among the
// active flows) is not granted the fleet's last free places
// (--tenant-reserve) while another active flow runs less than its share:
// those places wait for that flow's next request. A flow at its share is
// held back only while it runs the most of its class or its use averaged
// over a few seconds (usageTau) is at its share too: a quiet tenant's
// burst above its share for a moment, beside a flood that runs more, is
// not held back, and a second flood is, once its average has risen. A
// flow is one tenant's requests of one class, and classes go first: a
// flow also leaves the last places to any active flow of a higher class,
// whatever their shares (a tenant's flex batch to its own interactive
// traffic too). A fully work-conserving queue gave a quiet tenant's
// request, first in order, the next place a flood sequence freed, and it
// waited for one to end
// (issue #38: the quiet tenants' TTFT p90 5–13× their own alone on the
// simulators). Two places (the default) keep a flow's wait short while
// it brings up to about half of the fleet's requests (a Poisson flow then
// rarely brings two in the time a place takes to free). A place held back
// costs the flood that place's output while others are active: 6% of a
// fleet of 16 sequences (at 64 and 256 places the measured cost is larger:
// the reserve counts a request queued at its warm engine against the free
// places of the others; tenants-38f, 38g). A flow alone,
// or flows all at their share, hold nothing back, and neither does a fleet
// whose batch limits are unknown.

// activeFor is how long a flow counts as active after its last request
// ended: a quiet tenant's requests come a second or two apart.
const activeFor = 3 * time.Second

// usageTau is the time constant of a flow's average use of the fleet's
// places: a flood's average passes a third of the fleet within about two
// seconds of its start, and a quiet tenant's burst of a second moves its
// own by a third of the burst.
const usageTau = 3 * time.Second

// flowOf is the flow of tenant's requests of class c.
func flowOf(tenant uint64, c class) uint64 { return tenant ^ uint64(c)*0x9e3779b97f4a7c15 }

// tenantRun is a flow's requests running through this router (admitted
// and not ended), their average over time (usage, as of at), its tenant's
// weight, and when its last one ended.
type tenantRun struct {
	running int
	usage   float64
	at      time.Time
	weight  float64
	class   class
	ended   time.Time
}

// catchUp moves r's usage to now: toward what it ran since r.at.
func (r *tenantRun) catchUp(now time.Time) {
	if !r.at.IsZero() {
		decay := math.Exp(-float64(now.Sub(r.at)) / float64(usageTau))
		r.usage = float64(r.running) + (r.usage-float64(r.running))*decay
	}
	r.at = now
}

// tenantRuns are the flows' runs, guarded by mu (taken after the queue's
// mu, never before).
type tenantRuns struct {
	mu sync.Mutex
	m  map[uint64]*tenantRun
}

// started counts a request of flow id (its tenant's weight, its class c)
// admitted to the fleet.
func (t *tenantRuns) started(id uint64, weight float64, c class) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m == nil {
		t.m = make(map[uint64]*tenantRun)
	}
	now := time.Now()
	r := t.m[id]
	if r == nil {
		if len(t.m) >= maxTenants {
			t.sweep(now)
		}
		r = &tenantRun{}
		t.m[id] = r
	}
	r.catchUp(now)
	r.running++
	r.weight, r.class = weight, c
}

// restarted counts again a request of flow id whose stream was cut
// (preempt.go) and ended for it then.
func (t *tenantRuns) restarted(id uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if r := t.m[id]; r != nil {
		r.catchUp(time.Now())
		r.running++
	}
}

// ended counts the end of a request of flow id that started.
func (t *tenantRuns) ended(id uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if r := t.m[id]; r != nil {
		r.ended = time.Now()
		r.catchUp(r.ended)
		r.running--
	}
}

// sweep forgets the flows no longer active; t.mu is held.
func (t *tenantRuns) sweep(now time.Time) {
	for id, r := range t.m {
		if r.running <= 0 && now.Sub(r.ended) > activeFor {
			delete(t.m, id)
		}
	}
}

// shareView is one grant pass's view of the active flows: running or
// waiting, or ended within activeFor.
type shareView struct {
	built   bool
	sumW    float64
	running int // the flows' requests running through this router
	runs    map[uint64]tenantRun
	// The fleet's places for the last request looked at (routing.Places),
	// and its model.
	placed      bool
	model       string
	free, total int64
}

// build takes the view; q.mu is held.
func (v *shareView) build(q *fairQueue) {
	v.built = true
	v.runs = make(map[uint64]tenantRun, len(q.tenants)+4)
	now := time.Now()
	q.runs.mu.Lock()
	q.runs.sweep(now)
	for id, r := range q.runs.m {
		c := *r
		c.catchUp(now)
		v.runs[id] = c
	}
	q.runs.mu.Unlock()
	for _, w := range q.waiting {
		f := flowOf(w.who, w.class)
		if r := v.runs[f]; r.weight == 0 {
			r.weight, r.class = w.tenant.weight, w.class
			v.runs[f] = r
		}
	}
	for _, r := range v.runs {
		v.sumW += r.weight
		v.running += r.running
	}
}

// holdBack reports whether r, a request of flow me and class c, must leave
// the fleet's last free places to a flow of a higher class or below its
// share; q.mu is held.
func (q *fairQueue) holdBack(v *shareView, r *routing.Request, me uint64, c class) bool {
	if q.reserve <= 0 || q.places == nil || r.Prefill || len(r.Tried) > 0 {
		return false
	}
	if !v.placed || r.Model != v.model {
		v.placed, v.model = true, r.Model
		v.free, v.total = q.places(r)
	}
	if v.total == 0 || v.free > int64(q.reserve) {
		return false
	}
	if !v.built {
		v.build(q)
	}
	share := func(r tenantRun) float64 { return float64(v.total) * r.weight / v.sumW }
	mine := v.runs[me]
	// A flow not seen yet runs nothing; steady: its average is at its
	// share too; other: a flow of its class runs less than its share.
	atShare := mine.weight > 0 && float64(mine.running) >= share(mine)
	steady := mine.usage >= share(mine)
	runsMost, other := true, false
	for id, o := range v.runs {
		switch {
		case o.class.rank() > c.rank():
			return true
		case id == me || o.class != c:
		case float64(o.running)/o.weight > float64(mine.running)/mine.weight:
			runsMost = false
		case float64(o.running) < share(o):
			other = true
		}
	}
	return atShare && (runsMost || steady) && other
}

// reserved reports whether a new request r of flow me, which the fleet has
// room for and nobody waits before, must queue to leave the fleet's last
// free places to a flow below its share. Below them it costs one count of
// the fleet's places.
func (q *fairQueue) reserved(r *routing.Request, me uint64, c class) bool {
	if q.reserve <= 0 || q.places == nil {
		return false
	}
	var v shareView
	v.placed, v.model = true, r.Model
	if v.free, v.total = q.places(r); v.total == 0 || v.free > int64(q.reserve) {
		return false
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.holdBack(&v, r, me, c)
}

// placesOf is the queue's view of the fleet's places for r.
func (s *Server) placesOf(r *routing.Request) (free, total int64) {
	return routing.Places(r, s.opt.Pool.Load())
}
