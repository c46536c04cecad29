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
// ejected or draining), serves r's model (as far as its model list is
// known), is not saturated (r.MaxInFlight; full: it answered 429 at the
// load it still has, Endpoint.Full; with r.StartNow, with its batch and
// the short queue a router keeps there full, Endpoint.QueueRoom; with
// r.Alone too, without room, Endpoint.HasRoom) nor
// shedding load (it answered 429 to
// everything lately: Endpoint.Shedding), and r was not already sent
// there. Every policy must pick only usable endpoints.
func Usable(r *Request, e *discovery.Endpoint) bool {
	return e.Routable() && !r.tried(e) && (r.MaxInFlight <= 0 || e.InFlight() < r.MaxInFlight) && e.Serves(r.Model) &&
		!e.Shedding() && (!r.StartNow && !e.Full() || r.StartNow && (r.Alone && e.HasRoom() || !r.Alone && e.QueueRoom()))
}

// Room reports whether an endpoint of set that r may be sent to would
// start it now (Endpoint.HasRoom): while none would, a router keeps r in
// its own queue (the fleet is saturated).
func Room(r *Request, set *discovery.Set) bool {
	for _, e := range r.group(set) {
		if Usable(r, e) && e.HasRoom() {
			return true
		}
	}
	return false
}

// Places returns the free places and the places in all of the batches of
// the endpoints that may serve r (routable, serving its model, not
// shedding load): what the fleet runs at once less the requests it has
// (Endpoint.Free: requests waiting in an engine's queue take a place too),
// and what it runs at once. total is 0 when an endpoint's room is
// unknown: the fleet then has no bound the router knows of.
func Places(r *Request, set *discovery.Set) (free, total int64) {
	for _, e := range r.group(set) {
		if !e.Routable() || !e.Serves(r.Model) || e.Shedding() {
			continue
		}
		f, l := e.Free()
		if l == 0 {
			return 0, 0
		}
		free, total = free+f, total+l
	}
	return free, total
}

// usableAt returns the endpoint of eps usable for r, other than skip,
// chosen by pick from their number m (pick(m) in [0, m)); nil if none.
// Unusable endpoints' turns thus spread evenly over the usable ones,
// rather than all falling to the next one in order (which, with half a
// fleet ejected, gave one healthy pod three times its share).
func usableAt(r *Request, eps []*discovery.Endpoint, skip *discovery.Endpoint, pick func(m int) int) *discovery.Endpoint {
	m := 0
	for _, e := range eps {
		if e != skip && Usable(r, e) {
			m++
		}
	}
	if m == 0 {
		return nil
	}
	k := pick(m)
	for _, e := range eps {
		if e != skip && Usable(r, e) {
			if k == 0 {
				return e
			}
			k--
		}
	}
	return nil // the set changed under us: an endpoint became unusable
}

// whole is the decision of a policy that knows nothing of caches: the
// whole prompt is left to compute on e.
func whole(r *Request, e *discovery.Endpoint, reason string) Decision {
	if e == nil {
		return Decision{Reason: reason}
	}
	return Decision{Endpoint: e, Reason: reason, Prefill: r.PromptTokens, PromptTokens: r.PromptTokens}
}

// The basic policies pick among the request's group of the Set (the
// endpoints that answer clients, or the prefill pool), report the whole
// prompt as prefill (they know nothing of caches), and are safe for
// concurrent use.

// RoundRobin cycles through the Set's endpoints, as a ClusterIP Service
// (iptables/IPVS round-robin) spreads connections. Safe for concurrent use.
type RoundRobin struct {
	next atomic.Uint64
}

// NewRoundRobin returns a round-robin policy.
func NewRoundRobin() *RoundRobin { return &RoundRobin{} }

// Pick returns the next usable endpoint in rotation.
func (p *RoundRobin) Pick(r *Request, set *discovery.Set) Decision {
	e := usableAt(r, r.group(set), nil, func(m int) int { return int(p.next.Add(1) % uint64(m)) })
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
	return whole(r, usableAt(r, r.group(set), nil, p.intn), ReasonRandom)
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
	a := usableAt(r, r.group(set), nil, p.intn)
	if a != nil {
		// The second sample: uniform over the other usable endpoints.
		if b := usableAt(r, r.group(set), a, p.intn); b != nil && b.InFlight() < a.InFlight() {
			a = b
		}
	}
	return whole(r, a, ReasonLeastRequest)
}
