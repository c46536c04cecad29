package proxy

import (
	"math"
	"time"
)

// The queue's pace: how many requests a second it grants, averaged over
// paceTau, so that a request shed from it is told when it could queue
// again (Retry-After) instead of "1": a flood's clients that honour it (the
// OpenAI SDKs retry after it, up to a minute) come back when there is
// room rather than every second into a full queue.

// paceTau is the time constant of the grant rate's average.
const paceTau = 5 * time.Second

// maxRetryAfter bounds a shed's Retry-After, in seconds: the OpenAI SDKs
// honour up to a minute.
const maxRetryAfter = 60

// pace is the queue's grant rate; guarded by the queue's mu.
type pace struct {
	rate float64 // grants a second, as of at
	at   time.Time
}

// granted counts a grant at now.
func (p *pace) granted(now time.Time) {
	p.rate = p.now(now) + 1/paceTau.Seconds()
	p.at = now
}

// now is the rate decayed to now.
func (p *pace) now(now time.Time) float64 {
	if p.at.IsZero() {
		return 0
	}
	return p.rate * math.Exp(-now.Sub(p.at).Seconds()/paceTau.Seconds())
}

// overloadedError is a shed from the queue: ErrOverloaded, with the
// seconds after which the request could queue again.
type overloadedError struct{ retry int }

func (e *overloadedError) Error() string { return ErrOverloaded.Error() }
func (e *overloadedError) Unwrap() error { return ErrOverloaded }

// retryAfter is when a request of tenant id shed for reason could queue
// again, in whole seconds (1 to maxRetryAfter): the time the queue, at its
// recent pace, takes to grant the requests ahead — its tenant's own, at
// its tenant's share of the waiting tenants' weights, when it was shed at
// its tenant's bound; every waiting one otherwise. 1 while the queue has
// granted nothing lately or holds nothing.
func (q *fairQueue) retryAfter(id uint64, reason string) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	rate := q.pace.now(time.Now())
	ahead := float64(len(q.waiting))
	if t := q.tenants[id]; reason == shedTenant && t != nil {
		sumW := 0.0
		for _, o := range q.tenants {
			if o.waiting > 0 {
				sumW += o.weight
			}
		}
		ahead = float64(t.waiting)
		if sumW > 0 {
			rate *= t.weight / sumW
		}
	}
	if rate <= 0 || ahead <= 0 {
		return 1
	}
	return int(min(max(1, math.Ceil(ahead/rate)), maxRetryAfter))
}
