package discovery

import (
	"sync"
	"sync/atomic"
)

// Set is an immutable snapshot of the endpoints kvroute may route new
// requests to. A Set and its slices are never modified after Publish; the
// *Endpoint values in it are shared with earlier and later Sets.
type Set struct {
	// Version increases with every published Set.
	Version uint64
	// Endpoints lists every endpoint of the snapshot, in publication order.
	Endpoints []*Endpoint
}

// Len returns the number of endpoints in s; a nil Set has none.
func (s *Set) Len() int {
	if s == nil {
		return 0
	}
	return len(s.Endpoints)
}

// Pool publishes Sets. Readers call Load once per request; writers call
// Publish. An address (URL and role) present in the previous Set keeps its
// *Endpoint, so its counters survive. Pool is safe for concurrent use.
type Pool struct {
	cur atomic.Pointer[Set]
	mu  sync.Mutex // serialises Publish
}

// Load returns the current Set, or an empty Set before the first Publish.
func (p *Pool) Load() *Set {
	if s := p.cur.Load(); s != nil {
		return s
	}
	return &Set{}
}

// Publish makes eps the current Set and returns it. Endpoints whose URL and
// role match one in the current Set are replaced by that existing *Endpoint.
// Duplicates (same URL and role) are dropped.
func (p *Pool) Publish(eps []*Endpoint) *Set {
	p.mu.Lock()
	defer p.mu.Unlock()
	old := p.cur.Load()
	type key struct {
		url  string
		role Role
	}
	prev := make(map[key]*Endpoint, old.Len())
	if old != nil {
		for _, e := range old.Endpoints {
			prev[key{e.URL, e.Role}] = e
		}
	}
	seen := make(map[key]bool, len(eps))
	next := &Set{Endpoints: make([]*Endpoint, 0, len(eps))}
	if old != nil {
		next.Version = old.Version + 1
	}
	for _, e := range eps {
		k := key{e.URL, e.Role}
		if seen[k] {
			continue
		}
		seen[k] = true
		if o, ok := prev[k]; ok {
			e = o
		}
		next.Endpoints = append(next.Endpoints, e)
	}
	p.cur.Store(next)
	return next
}
