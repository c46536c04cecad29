package routing

import (
	"sync/atomic"

	"github.com/kvroute/kvroute/discovery"
)

// Reasons of the basic policies.
const (
	ReasonRoundRobin   = "round-robin"
	ReasonRandom       = "random"
	ReasonLeastRequest = "least-request"
)

// Usable reports whether r may be sent to e: e is routable (not down,
// ejected or draining), not saturated (r.MaxInFlight), and r was not
// already sent there. Every policy must pick only usable endpoints.
func Usable(r *Request, e *discovery.Endpoint) bool {
	return e.Routable() && !r.tried(e) && (r.MaxInFlight <= 0 || e.InFlight() < r.MaxInFlight)
}

// firstUsable returns the first endpoint of eps usable for r, scanning
// from index start and wrapping around, and its index; nil and -1 if none.
func firstUsable(r *Request, eps []*discovery.Endpoint, start int) (*discovery.Endpoint, int) {
	n := len(eps)
	for k := 0; k < n; k++ {
		i := (start + k) % n
		if e := eps[i]; Usable(r, e) {
			return e, i
		}
	}
	return nil, -1
}

// whole is the decision of a policy that knows nothing of caches: the
// whole prompt is left to compute on e.
func whole(r *Request, e *discovery.Endpoint, reason string) Decision {
	if e == nil {
		return Decision{Reason: reason}
	}
	return Decision{Endpoint: e, Reason: reason, Prefill: r.PromptTokens, PromptTokens: r.PromptTokens}
}

// The basic policies pick among the Set's mixed endpoints (whole
// requests), report the whole prompt as prefill (they know nothing of
// caches), and are safe for concurrent use.

// RoundRobin cycles through the Set's endpoints, as a ClusterIP Service
// (iptables/IPVS round-robin) spreads connections. Safe for concurrent use.
type RoundRobin struct {
	next atomic.Uint64
}

// NewRoundRobin returns a round-robin policy.
func NewRoundRobin() *RoundRobin { return &RoundRobin{} }

// Pick returns the next usable endpoint in rotation.
func (p *RoundRobin) Pick(r *Request, set *discovery.Set) Decision {
	var e *discovery.Endpoint
	if n := len(set.Mixed); n > 0 {
		e, _ = firstUsable(r, set.Mixed, int(p.next.Add(1)%uint64(n)))
	}
	return whole(r, e, ReasonRoundRobin)
}

// Random picks a usable endpoint uniformly at random. Safe for concurrent use.
type Random struct {
	intn func(int) int
}

// NewRandom returns a random policy; intn (nil means math/rand/v2.IntN)
// is its source of randomness and must be safe for concurrent use.
func NewRandom(intn func(int) int) *Random { return &Random{intn: intnOrDefault(intn)} }

// Pick returns a random usable endpoint.
func (p *Random) Pick(r *Request, set *discovery.Set) Decision {
	var e *discovery.Endpoint
	if n := len(set.Mixed); n > 0 {
		e, _ = firstUsable(r, set.Mixed, p.intn(n))
	}
	return whole(r, e, ReasonRandom)
}

// LeastRequest samples two distinct usable endpoints at random and picks the
// one with fewer requests in flight from this router (power of two choices:
// near-least-loaded without a scan, and no herd onto one endpoint when many
// requests arrive at once). Safe for concurrent use.
type LeastRequest struct {
	intn func(int) int
}

// NewLeastRequest returns a least-request policy; intn as for NewRandom.
func NewLeastRequest(intn func(int) int) *LeastRequest {
	return &LeastRequest{intn: intnOrDefault(intn)}
}

// Pick returns the less loaded of two random usable endpoints.
func (p *LeastRequest) Pick(r *Request, set *discovery.Set) Decision {
	n := len(set.Mixed)
	if n == 0 {
		return Decision{Reason: ReasonLeastRequest}
	}
	a, i := firstUsable(r, set.Mixed, p.intn(n))
	if a != nil && n > 1 {
		// The second sample: uniform over the others, the first usable
		// one from there that is not a.
		j := (i + 1 + p.intn(n-1)) % n
		for k := 0; k < n-1; k++ {
			if b := set.Mixed[(j+k)%n]; b != a && Usable(r, b) {
				if b.InFlight() < a.InFlight() {
					a = b
				}
				break
			}
		}
	}
	return whole(r, a, ReasonLeastRequest)
}
