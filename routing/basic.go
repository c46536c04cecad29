package routing

import (
	"math/rand/v2"
	"sync/atomic"

	"github.com/kvroute/kvroute/discovery"
)

// Reasons of the basic policies.
const (
	ReasonRoundRobin   = "round-robin"
	ReasonRandom       = "random"
	ReasonLeastRequest = "least-request"
)

// usable reports whether r may be sent to e: e is routable (not down,
// ejected or draining) and r was not already sent there.
func usable(r *Request, e *discovery.Endpoint) bool {
	return e.Routable() && !r.tried(e)
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
	n := len(set.Mixed)
	if n == 0 {
		return Decision{Reason: ReasonRoundRobin}
	}
	start := int(p.next.Add(1) % uint64(n))
	for i := 0; i < n; i++ {
		e := set.Mixed[(start+i)%n]
		if usable(r, e) {
			return Decision{Endpoint: e, Reason: ReasonRoundRobin, Prefill: r.PromptTokens, PromptTokens: r.PromptTokens}
		}
	}
	return Decision{Reason: ReasonRoundRobin}
}

// Random picks a usable endpoint uniformly at random. Safe for concurrent use.
type Random struct {
	intn func(int) int
}

// NewRandom returns a random policy; intn (nil means math/rand/v2.IntN)
// is its source of randomness and must be safe for concurrent use.
func NewRandom(intn func(int) int) *Random {
	if intn == nil {
		intn = rand.IntN
	}
	return &Random{intn: intn}
}

// Pick returns a random usable endpoint.
func (p *Random) Pick(r *Request, set *discovery.Set) Decision {
	n := len(set.Mixed)
	if n == 0 {
		return Decision{Reason: ReasonRandom}
	}
	start := p.intn(n)
	for i := 0; i < n; i++ {
		e := set.Mixed[(start+i)%n]
		if usable(r, e) {
			return Decision{Endpoint: e, Reason: ReasonRandom, Prefill: r.PromptTokens, PromptTokens: r.PromptTokens}
		}
	}
	return Decision{Reason: ReasonRandom}
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
	if intn == nil {
		intn = rand.IntN
	}
	return &LeastRequest{intn: intn}
}

// Pick returns the less loaded of two random usable endpoints.
func (p *LeastRequest) Pick(r *Request, set *discovery.Set) Decision {
	n := len(set.Mixed)
	if n == 0 {
		return Decision{Reason: ReasonLeastRequest}
	}
	var a, b *discovery.Endpoint
	i := p.intn(n)
	for k := 0; k < n && a == nil; k++ {
		if e := set.Mixed[(i+k)%n]; usable(r, e) {
			a, i = e, (i+k)%n
		}
	}
	if a == nil {
		return Decision{Reason: ReasonLeastRequest}
	}
	if n > 1 {
		j := (i + 1 + p.intn(n-1)) % n // uniform over the others
		for k := 0; k < n-1 && b == nil; k++ {
			if e := set.Mixed[(j+k)%n]; e != a && usable(r, e) {
				b = e
			}
		}
	}
	if b != nil && b.InFlight.Load() < a.InFlight.Load() {
		a = b
	}
	return Decision{Endpoint: a, Reason: ReasonLeastRequest, Prefill: r.PromptTokens, PromptTokens: r.PromptTokens}
}
