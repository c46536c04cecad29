package proxy

import (
	"slices"
	"time"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

// Preemption. On a saturated fleet, a request of a flow running less than
// its share of this router's requests (a quiet tenant beside a flood), or
// of a higher class than a running flow, waits for a place that a flood's
// sequence holds until it ends: on engines of a few sequences that wait is
// many times the request's own TTFT (issue #38: 5–13× with a
// work-conserving queue). The reserve (reserve.go) keeps places free for
// it instead, and so leaves them idle (output 0.88–0.90× the fleet's
// capacity on four engines of four sequences).
//
// So the queue takes a place back: when the first such waiter finds no
// room, it cuts the stream that started last (the least work lost) of the
// flow furthest above its share, or of the lowest class below the
// waiter's, on an engine that stops a cut request (discovery's
// TakesBack). The cut stream continues as a mid-stream failover does
// (migrate.go: the same text, the same stream to its client), but first
// waits in the queue as its flow's next request — ahead of its flow's
// other waiters, behind the flows below their share — so the freed place
// goes to the waiter it was cut for. A stream is cut at most
// --max-migrations times; one cut at a time is under way per waiter that
// needs one. The reserve applies as it does without preemption: with one
// place (--tenant-reserve 1), a quiet request usually starts in a free
// place, on an engine running one sequence fewer, and a cut serves the
// bursts beyond it (kvsim, issue #38: settled p90 1.14–1.44× at 0.93×
// output, against 1.4–2.5× at 0.90× with two places and no cuts).

// owedFor is how long a waiter a stream was cut for is owed the next
// place: longer, and the cut freed none (the stream ended another way, or
// the place went elsewhere), and it may have another cut.
const owedFor = 250 * time.Millisecond

// preemptFor cuts a stream for the first waiter entitled to one that is
// not owed a place already; that waiter is then owed the next place it
// has room for (grant). grant calls it after finding no waiter to grant;
// q.mu is held.
func (q *fairQueue) preemptFor(p *grantPass) {
	if q.cut == nil {
		return
	}
	for _, w := range q.waiting {
		if !w.owed.IsZero() && p.clock().Sub(w.owed) < owedFor {
			continue // a cut under way frees its place
		}
		w.owed = time.Time{}
		if flows := q.victims(p, w); len(flows) > 0 {
			if q.cut(w.req, flows) {
				w.owed = p.clock()
			}
			return
		}
	}
}

// owedFirst returns the first waiter owed a place by a cut that is
// eligible for one now, or nil; q.mu is held.
func (q *fairQueue) owedFirst(p *grantPass) *waiter {
	for _, w := range q.waiting {
		if !w.owed.IsZero() && q.eligible(p, w) {
			return w
		}
	}
	return nil
}

// victims returns the flows whose streams may be cut for w, best first,
// or none when w is not entitled to a cut: it waits for the fleet's room
// (not for its tenant's budget or a retry's pause), and its flow runs less
// than its share; the flows are those of a lower class, then those of its
// class running above their share and at least two more than its flow
// (weighted), the furthest above first. q.mu is held.
func (q *fairQueue) victims(p *grantPass, w *waiter) []uint64 {
	if w.atMax || w.resume || w.req.Prefill || len(w.req.Tried) > 0 || !q.quiet(p, w) ||
		!w.notBefore.IsZero() && p.clock().Before(w.notBefore) {
		return nil
	}
	if !slices.Contains(p.none, w.req.Model) && q.room(w.req) {
		return nil
	}
	v := &p.shares
	me := flowOf(w.who, w.class)
	mine := v.runs[me]
	type victim struct {
		id   uint64
		rank int
		load float64
	}
	var vs []victim
	for id, o := range v.runs {
		if id == me || o.running <= 0 || o.weight <= 0 {
			continue
		}
		load := float64(o.running) / o.weight
		lower := o.class.rank() < w.class.rank()
		above := o.class == w.class && load >= (float64(mine.running)+2)/mine.weight &&
			float64(o.running)*v.sumW > float64(v.running)*o.weight
		if lower || above {
			vs = append(vs, victim{id, o.class.rank(), load})
		}
	}
	slices.SortFunc(vs, func(a, b victim) int {
		if a.rank != b.rank {
			return a.rank - b.rank
		}
		switch {
		case a.load > b.load:
			return -1
		case a.load < b.load:
			return 1
		}
		return 0
	})
	ids := make([]uint64, len(vs))
	for i, x := range vs {
		ids[i] = x.id
	}
	return ids
}

// cutFor cuts streams of flows (the first of them that has one there)
// on one engine, so that it has room for r: an engine that serves r's
// model, whose batch limit is known (the fleet is full, not at a slow
// start's guess) and that stops a cut request; one holding r's prompt if
// one can (r then starts warm in its place), else the one with the fewest
// of the router's requests in its own queue. Those requests start there
// before r when a place frees, so as many streams are cut as the engine
// queues, and one more: the ones that started last (the least work
// lost; those waiting in the engine lose none). It reports whether it cut.
func (s *Server) cutFor(r *routing.Request, flows []uint64) bool {
	var holding []*discovery.Endpoint
	if s.opt.Holding != nil {
		holding = s.opt.Holding(r, s.opt.Pool.Load())
	}
	type cand struct {
		a    *attempt
		rank int
		at   time.Time
	}
	byEP := map[*discovery.Endpoint][]cand{}
	s.attempts.m.Range(func(_, v any) bool {
		a := v.(*attempt)
		a.mu.Lock()
		offered, flow, ok := a.offered, a.flow, a.movable && !a.ended && !a.aborted && !a.gone
		a.mu.Unlock()
		if i := slices.Index(flows, flow); ok && !offered.IsZero() && i >= 0 {
			byEP[a.ep] = append(byEP[a.ep], cand{a, i, offered})
		}
		return true
	})
	var best *discovery.Endpoint
	var bestNeed int64
	for e, cs := range byEP {
		free, limit := e.Free()
		need := 1 - free // the engine's queue, and one
		if limit == 0 || e.BatchLimit() == 0 || int64(len(cs)) < need || !e.Serves(r.Model) || !e.TakesBack() {
			continue
		}
		warm, bestWarm := slices.Contains(holding, e), slices.Contains(holding, best)
		if best == nil || warm && !bestWarm || warm == bestWarm && need < bestNeed {
			best, bestNeed = e, need
		}
	}
	if best == nil {
		return false
	}
	cs := byEP[best]
	slices.SortFunc(cs, func(x, y cand) int {
		if x.rank != y.rank {
			return x.rank - y.rank
		}
		return y.at.Compare(x.at)
	})
	cut := int64(0)
	for _, c := range cs {
		if cut == bestNeed {
			break
		}
		if c.a.preempt() {
			cut++
		}
	}
	if cut == 0 {
		return false
	}
	best.Cut()
	return true
}

// cuttable reports whether st's answer, if it streams and may be
// continued, is a place the queue may take back: preemption is on, and it
// has migrations left (a continuation only of a cut one).
func (s *Server) cuttable(st *reqState) bool {
	return s.opt.Tenants.Preempt && !s.opt.Tenants.FIFO && st.legs < s.opt.MaxMigrations && (!st.migrating || st.resumed)
}

// offer makes st's streamed answer on attempt a, which may be continued,
// a place the queue may take back, when it is cuttable. The engine's part
// (TakesBack) is read when a cut is chosen.
func (s *Server) offer(st *reqState, a *attempt) {
	if !s.cuttable(st) {
		return
	}
	var seq uint64
	if !st.wait.since.IsZero() {
		seq = st.wait.seq
	}
	if st.resumed {
		seq = st.resumeSeq
	}
	a.offer(flowOf(st.tenant, st.class), seq, st.offered)
}
