package routing

import (
	"slices"
	"sync"
	"sync/atomic"
)

// warmth learns, per endpoint, how many distinct prefix keys its engine
// keeps warm: the capacity that matters to routing, in prompts rather than
// tokens. A local engine says nothing of it — a stock Ollama server keeps
// one cached prompt per sequence slot and reuses the slot whatever its
// context length, llama.cpp's server keeps one per slot plus what its host
// prompt cache holds — and the index, sized in blocks, cannot tell one long
// prompt from many short ones.
//
// Every dispatch of a keyed request puts its key at the head of the
// endpoint's stack of recent keys (see): the key's distance is how many
// other keys went there since it last did. Every answer whose cache use is
// known — the engine's cached tokens, or, where the engine reports none,
// its time to first token (Prefix.LearnTTFT) — is an outcome at that
// distance (outcome): the engine served the key's blocks from cache or
// computed them. An engine that keeps k keys serves distances below k
// warm and computes the others, so the learned count is the least distance
// that missed more often than it hit, over decayed counts; until a
// distance has missed so, the engine is taken to keep everything (0:
// unknown), and nothing changes. Once learned, the count holds while the
// evidence fades (routing by it sends few keys that far) until a distance
// at or beyond it is seen warm, or one below it cold. Distances are tracked up to maxWarmKeys:
// an engine that keeps more is, for routing, one that keeps them all.
//
// What it changes (Prefix.decide): a key beyond the endpoint's learned
// count is cold there whatever the index remembers, and homes are sized so
// that no endpoint homes more keys than it keeps while the fleet can keep
// them all (homes.assign). Safe for concurrent use.
type warmth struct {
	mu      sync.Mutex
	eps     map[uint64]*keyStack
	version atomic.Uint64 // moves whenever a learned count changes
	learned atomic.Int64  // endpoints with a learned count
}

type keyStack struct {
	keys []uint64 // most recently dispatched first; at most maxWarmKeys
	// Decayed outcomes by distance: answers served warm, and all.
	warm, all [maxWarmKeys]float64
	kept      int // learned keys kept warm; 0: unknown (all)
}

const (
	// maxWarmKeys is the deepest distance tracked.
	maxWarmKeys = 32
	// warmDecay weighs an endpoint's earlier outcomes at each new one: a
	// window of about 50 answers, so that a restarted or reconfigured
	// engine is relearned within a minute of traffic.
	warmDecay = 0.98
	// minWarmEvidence is the decayed count of outcomes at a distance
	// before it may bound the learned count.
	minWarmEvidence = 2.0
)

func newWarmth() *warmth { return &warmth{eps: make(map[uint64]*keyStack)} }

// see records a dispatch of key to endpoint id and returns the key's
// distance there before it: the keys dispatched there since it last was,
// or -1 when it was not among the last maxWarmKeys.
func (w *warmth) see(id, key uint64) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.eps[id]
	if s == nil {
		s = &keyStack{keys: make([]uint64, 0, maxWarmKeys)}
		w.eps[id] = s
	}
	d := slices.Index(s.keys, key)
	switch {
	case d >= 0:
		copy(s.keys[1:d+1], s.keys[:d])
	case len(s.keys) < maxWarmKeys:
		s.keys = append(s.keys, 0)
		copy(s.keys[1:], s.keys)
	default:
		copy(s.keys[1:], s.keys[:len(s.keys)-1])
	}
	s.keys[0] = key
	return d
}

// outcome records that a request dispatched to id at distance dist (see)
// found its key warm or not, and relearns id's count.
func (w *warmth) outcome(id uint64, dist int, warm bool) {
	if dist < 0 || dist >= maxWarmKeys {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.eps[id]
	if s == nil {
		return
	}
	for i := range s.all {
		s.warm[i] *= warmDecay
		s.all[i] *= warmDecay
	}
	s.all[dist]++
	if warm {
		s.warm[dist]++
	}
	kept := s.kept
	for i := range s.all {
		if s.all[i] < minWarmEvidence {
			continue
		}
		if s.warm[i] < s.all[i]/2 {
			kept = max(i, 1) // an engine keeps at least the prompt it just ran
			break
		}
		if i >= kept {
			kept = 0 // warm beyond the count: it keeps more
		}
	}
	if kept != s.kept {
		w.learned.Add(int64(min(kept, 1) - min(s.kept, 1)))
		s.kept = kept
		w.version.Add(1)
	}
}

// kept returns the keys endpoint id is learned to keep warm; 0 when
// unknown (as many as the index says).
func (w *warmth) kept(id uint64) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	if s := w.eps[id]; s != nil {
		return s.kept
	}
	return 0
}

// holds reports whether endpoint id may still hold key: its count is
// unknown, or key is among its last kept keys.
func (w *warmth) holds(id, key uint64) bool {
	if w.learned.Load() == 0 {
		return true // the common case: nothing to look up
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.eps[id]
	if s == nil || s.kept == 0 {
		return true
	}
	d := slices.Index(s.keys, key)
	return d >= 0 && d < s.kept
}

// forget drops endpoint id (it left, or its engine restarted).
func (w *warmth) forget(id uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if s := w.eps[id]; s != nil {
		delete(w.eps, id)
		if s.kept != 0 {
			w.learned.Add(-1)
			w.version.Add(1)
		}
	}
}
