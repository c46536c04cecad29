package proxy

import (
	"slices"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

// saturated reports, once the policy found no endpoint usable for r,
// whether that is because routable endpoints are saturated — at r's
// in-flight cap (not yet tried), out of connections (busy), or shedding
// load (answering 429) — so that
// the request may wait for one, rather than because all failed it.
func saturated(set *discovery.Set, r *routing.Request, busy []*discovery.Endpoint) bool {
	for _, e := range set.Serving {
		if e.Routable() && e.Serves(r.Model) && (!slices.Contains(r.Tried, e) || slices.Contains(busy, e) || e.Shedding()) {
			return true
		}
	}
	return false
}

// wait holds a request while every routable endpoint is saturated: it
// takes a place in the queue on the first call (ErrOverloaded when the
// queue is full or disabled), then sleeps one poll; ErrOverloaded once the
// queue timeout has passed, ErrClientGone when the client left meanwhile.
func (s *Server) wait(ctx *fasthttp.RequestCtx, queued *time.Time) error {
	now := time.Now()
	if queued.IsZero() {
		if s.opt.QueueTimeout <= 0 || !s.queue.enter() {
			s.opt.Metrics.Overloaded()
			return ErrOverloaded
		}
		*queued = now
		s.opt.Metrics.Queued(1)
	}
	if now.Sub(*queued) >= s.opt.QueueTimeout {
		s.opt.Metrics.Overloaded()
		return ErrOverloaded
	}
	time.Sleep(queuePoll)
	if peerClosed(ctx.Conn()) {
		return ErrClientGone
	}
	return nil
}

// waitQueue bounds the requests waiting in kvroute for a saturated fleet.
type waitQueue struct {
	max int64
	n   atomic.Int64
}

func (q *waitQueue) init(max int) { q.max = int64(max) }

// enter takes a place, or reports false when the queue is full.
func (q *waitQueue) enter() bool {
	if q.n.Add(1) > q.max {
		q.n.Add(-1)
		return false
	}
	return true
}

func (q *waitQueue) leave() { q.n.Add(-1) }

// queuePoll is how often a waiting request looks for an endpoint with room.
const queuePoll = 25 * time.Millisecond
