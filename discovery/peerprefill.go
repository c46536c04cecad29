package discovery

import (
	"sync"
	"sync/atomic"
	"time"
)

// peerPrefill is the prefill the gossiping router replicas started on an
// endpoint: each of their placements' new prompt tokens, counted until the
// time this router expects the engine to have computed them. A router's
// own requests are counted from the pick to their first byte (Lease); a
// peer's pick is known only from its gossip, and its first byte not at
// all, so it is counted until a deadline instead.
type peerPrefill struct {
	total atomic.Int64
	next  atomic.Int64 // the earliest deadline, unix ns; 0: nothing counted
	mu    sync.Mutex
	items []peerPending
}

type peerPending struct {
	tokens int64
	until  int64 // unix ns
}

// maxPeerPending bounds the placements counted per endpoint; beyond, the
// oldest is dropped.
const maxPeerPending = 1024

// AddPeerPrefill counts tokens of prompt that a router replica's
// placement on e left to compute, until until.
func (e *Endpoint) AddPeerPrefill(tokens int64, until time.Time) {
	e.peerPrefill.add(tokens, until)
}

// PeerPrefill returns the prompt tokens the replicas' placements on e are
// expected to be still computing (AddPeerPrefill). One atomic load while
// none is counted.
func (e *Endpoint) PeerPrefill() int64 { return e.peerPrefill.load() }

// AddUnheardPrefill counts tokens of prompt that the router replicas are
// expected to have sent e and not yet told of, until until: the prefill a
// router's own dispatch stands for at the others (Prefix.Pick). It is
// apart from PeerPrefill, which the endpoint's cost learning reads as
// load met (Acquire): these are a guess, and the request's own.
func (e *Endpoint) AddUnheardPrefill(tokens int64, until time.Time) {
	e.unheard.add(tokens, until)
}

// UnheardPrefill returns the tokens AddUnheardPrefill counts now.
func (e *Endpoint) UnheardPrefill() int64 { return e.unheard.load() }

// add counts tokens until until.
func (p *peerPrefill) add(tokens int64, until time.Time) {
	if tokens <= 0 {
		return
	}
	u := until.UnixNano()
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.items) >= maxPeerPending {
		// The oldest goes; the next deadline may be early, which costs
		// one needless expiry.
		p.total.Add(-p.items[0].tokens)
		p.items = p.items[1:]
	}
	p.items = append(p.items, peerPending{tokens: tokens, until: u})
	p.total.Add(tokens)
	if n := p.next.Load(); n == 0 || u < n {
		p.next.Store(u)
	}
}

// load returns the tokens counted now, dropping those due.
func (p *peerPrefill) load() int64 {
	if n := p.next.Load(); n != 0 {
		if now := time.Now().UnixNano(); now >= n {
			p.mu.Lock()
			p.expireLocked(now)
			p.mu.Unlock()
		}
	}
	return p.total.Load()
}

// expireLocked drops the placements due by now and sets the next deadline.
// p.mu is held.
func (p *peerPrefill) expireLocked(now int64) {
	next := int64(0)
	kept := p.items[:0]
	for _, it := range p.items {
		if it.until <= now {
			p.total.Add(-it.tokens)
			continue
		}
		kept = append(kept, it)
		if next == 0 || it.until < next {
			next = it.until
		}
	}
	clear(p.items[len(kept):])
	p.items = kept
	p.next.Store(next)
}
