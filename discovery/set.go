package discovery

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Set is an immutable snapshot of the endpoints kvroute may route new
// requests to. A Set and its slices are never modified after Publish; the
// *Endpoint values in it are shared with earlier and later Sets. Membership
// says "discovered"; whether an endpoint may take a request right now is
// (*Endpoint).Routable, which health checking flips without a new Set.
type Set struct {
	// Version increases with every published Set.
	Version uint64
	// Endpoints lists every endpoint of the snapshot: the mixed ones, then
	// the decode ones, then the prefill ones, each group in publication
	// order.
	Endpoints []*Endpoint
	// Mixed, Decode and Prefill are the groups of Endpoints by role. They
	// share Endpoints' backing array (no copy); a group without endpoints
	// is nil.
	Mixed, Decode, Prefill []*Endpoint
	// Serving is Mixed then Decode (one slice of Endpoints): the endpoints
	// that answer a client's request, a decode endpoint after a prefill
	// endpoint computed the prompt or alone. nil when there are none.
	Serving []*Endpoint
}

// Len returns the number of endpoints in s; a nil Set has none.
func (s *Set) Len() int {
	if s == nil {
		return 0
	}
	return len(s.Endpoints)
}

// Role returns the endpoints of s with role r (nil when none, or s is nil).
func (s *Set) Role(r Role) []*Endpoint {
	if s == nil {
		return nil
	}
	switch r {
	case RolePrefill:
		return s.Prefill
	case RoleDecode:
		return s.Decode
	default:
		return s.Mixed
	}
}

// Pool publishes Sets. Readers call Load once per request; writers call
// Publish. An address (URL and role) present in the previous Set keeps its
// *Endpoint, so its counters survive. An endpoint that leaves the Set starts
// draining: it takes no new requests but its in-flight ones finish; a Fleet
// drops it once idle (or after its drain limit) and fires its OnRemove hook.
// If the address comes back while still draining, the same *Endpoint
// returns. Pool's zero value is ready to use and it is safe for concurrent
// use.
type Pool struct {
	cur atomic.Pointer[Set]

	// mu serialises Publish and guards draining and changed; a Fleet also
	// guards its sources' lists with it, so that merging them and
	// publishing the result is one step.
	mu       sync.Mutex
	draining []drainingEndpoint
	changed  chan struct{}
}

// drainingEndpoint is an endpoint that left the Set at since.
type drainingEndpoint struct {
	e     *Endpoint
	since time.Time
}

// poolKey identifies an address within a Pool.
type poolKey struct {
	url  string
	role Role
}

// Load returns the current Set, or an empty Set before the first Publish.
func (p *Pool) Load() *Set {
	if s := p.cur.Load(); s != nil {
		return s
	}
	return &Set{}
}

// Publish makes eps the current Set and returns it. Endpoints whose URL and
// role match one in the current Set (or one still draining) are replaced by
// that existing *Endpoint. Duplicates (same URL and role) are dropped; the
// Set groups endpoints by role, keeping their order within a role.
// Endpoints of the previous Set missing from eps start draining.
func (p *Pool) Publish(eps []*Endpoint) *Set {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.publishLocked(eps)
}

// publishLocked is Publish with p.mu held.
func (p *Pool) publishLocked(eps []*Endpoint) *Set {
	now := time.Now()
	old := p.cur.Load()
	prev := make(map[poolKey]*Endpoint, old.Len()+len(p.draining))
	if old != nil {
		for _, e := range old.Endpoints {
			prev[poolKey{e.URL, e.Role}] = e
		}
	}
	for _, d := range p.draining {
		prev[poolKey{d.e.URL, d.e.Role}] = d.e
	}
	seen := make(map[poolKey]bool, len(eps))
	kept := make([]*Endpoint, 0, len(eps))
	for _, e := range eps {
		k := poolKey{e.URL, e.Role}
		if seen[k] {
			continue
		}
		seen[k] = true
		if o, ok := prev[k]; ok {
			e = o
		}
		kept = append(kept, e)
	}
	next := &Set{Endpoints: make([]*Endpoint, 0, len(kept))}
	if old != nil {
		next.Version = old.Version + 1
	}
	at := 0
	for _, g := range [...]struct {
		role  Role
		group *[]*Endpoint
	}{{RoleMixed, &next.Mixed}, {RoleDecode, &next.Decode}, {RolePrefill, &next.Prefill}} {
		for _, e := range kept {
			if e.Role == g.role {
				next.Endpoints = append(next.Endpoints, e)
			}
		}
		if n := len(next.Endpoints) - at; n > 0 {
			*g.group = next.Endpoints[at : at+n : at+n]
		}
		at = len(next.Endpoints)
	}
	if n := len(next.Mixed) + len(next.Decode); n > 0 {
		next.Serving = next.Endpoints[:n:n]
	}

	// Revive the draining endpoints that came back; drain the departed.
	p.draining = slices.DeleteFunc(p.draining, func(d drainingEndpoint) bool {
		if seen[poolKey{d.e.URL, d.e.Role}] {
			d.e.flags.And(^flagDraining)
			return true
		}
		return false
	})
	if old != nil {
		for _, e := range old.Endpoints {
			if !seen[poolKey{e.URL, e.Role}] {
				e.flags.Or(flagDraining)
				p.draining = append(p.draining, drainingEndpoint{e: e, since: now})
			}
		}
	}
	p.cur.Store(next)
	if p.changed != nil {
		close(p.changed)
		p.changed = nil
	}
	return next
}

// Changed returns a channel that is closed by the next Publish. Callers
// wait on it, then Load the new Set.
func (p *Pool) Changed() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.changed == nil {
		p.changed = make(chan struct{})
	}
	return p.changed
}

// Draining returns the endpoints that left the Set and still have requests
// in flight (or were not yet reaped), oldest first. The slice is a copy.
func (p *Pool) Draining() []*Endpoint {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]*Endpoint, len(p.draining))
	for i, d := range p.draining {
		out[i] = d.e
	}
	return out
}

// drainingList returns a copy of the draining list with start times.
func (p *Pool) drainingList() []drainingEndpoint {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.draining)
}

// reap removes and returns the draining endpoints that have been draining
// for at least grace with nothing in flight, or for longer than limit
// (limit <= 0: no limit). grace covers a request that loaded the Set just
// before the endpoint left and has not yet counted itself in flight.
func (p *Pool) reap(now time.Time, grace, limit time.Duration) []*Endpoint {
	p.mu.Lock()
	defer p.mu.Unlock()
	var gone []*Endpoint
	p.draining = slices.DeleteFunc(p.draining, func(d drainingEndpoint) bool {
		age := now.Sub(d.since)
		if age >= grace && d.e.InFlight() <= 0 || limit > 0 && age >= limit {
			gone = append(gone, d.e)
			return true
		}
		return false
	})
	return gone
}

// roleIndex maps a role to its group index in a Set.
func roleIndex(r Role) int {
	switch r {
	case RolePrefill:
		return 1
	case RoleDecode:
		return 2
	default:
		return 0
	}
}
