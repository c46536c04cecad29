package routing

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvroute/kvroute/prefix"
)

// warmth learns, per endpoint, how many distinct prefix keys its engine
// keeps warm: the capacity that matters to routing, in prompts rather than
// tokens. A local engine says nothing of it — a stock Ollama server keeps
// one cached prompt per sequence slot and reuses the slot whatever its
// context length, llama.cpp's server keeps one per slot plus what its host
// prompt cache holds — and the index, sized in blocks, cannot tell one long
// prompt from many short ones.
//
// Every dispatch of a keyed request, this router's or a gossiping
// replica's, puts its key at the head of the endpoint's stack of recent keys
// (see): the key's distance is how many other keys went there since it last
// did. Every answer whose cache use is
// known — the engine's cached tokens, or, where the engine reports none,
// its time to first token (Prefix.LearnTTFT) — is an outcome at that
// distance (outcome): the engine served the key's blocks from cache or
// computed them. An engine that keeps k keys serves distances below k
// warm and computes the others, so the learned count is the one the
// answers at every distance, over decayed counts, contradict least
// (keyStack.fit); until minWarmEvidence misses were seen, or when keeping
// everything explains them as well, the engine is taken to keep
// everything (0: unknown), and nothing changes. Once learned, the count
// holds while the evidence fades (routing by it sends few keys that far)
// until a distance at or beyond it is seen mostly warm, or new misses
// move it. Distances are tracked up to maxWarmKeys:
// an engine that keeps more is, for routing, one that keeps them all.
//
// An endpoint that has not learned its own count yet takes the fleet's,
// the least any endpoint learned (servers behind one router usually run
// one configuration: four stock Ollama servers each keep one prompt), until
// its own answers show it warm at that distance or beyond; so one
// endpoint's misses teach the others, and the fleet pays for the lesson
// once rather than once per server.
//
// What it changes (Prefix.decide): a key beyond the endpoint's count is
// cold there whatever the index remembers; homes are sized so that no
// endpoint homes more keys than it keeps while the fleet can keep them all
// (homes.assign); and a spill to an endpoint that keeps its count of other
// keys costs the recompute of the one it evicts (at). Safe for
// concurrent use.
type warmth struct {
	mu  sync.Mutex
	eps map[uint64]*keyStack
	// where is, for each key in a stack, the endpoint it was last
	// dispatched to (latest: one lookup per mark, not a scan per
	// endpoint); nil where latest is never asked (newWarmth).
	where   map[uint64]uint64
	version atomic.Uint64 // moves whenever a count changes
	fleet   atomic.Int64  // the least count an endpoint learned; 0: none
	// gap is the mean time, in seconds, between a key's dispatch and its
	// next to the same endpoint (a moving average; gaps counts them).
	gap  float64
	gaps int
}

type keyStack struct {
	keys []uint64 // most recently dispatched first; at most maxWarmKeys
	at   []int64  // when each key was last dispatched (unix nanoseconds)
	// Decayed outcomes by distance: answers served warm, and all.
	warm, all [maxWarmKeys]float64
	// kept is the learned count (0: unknown); atLeast is one more than the
	// deepest distance seen mostly warm, which no count may be below.
	kept, atLeast int
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

// newSequences returns a warmth keyed by prompt marks (Prefix.seqs) that
// answers latest.
func newSequences() *warmth {
	w := newWarmth()
	w.where = make(map[uint64]uint64)
	return w
}

// see records a dispatch of key to endpoint id and returns the key's
// distance there before it: the keys dispatched there since it last was,
// or -1 when it was not among the last maxWarmKeys.
func (w *warmth) see(id, key uint64) int { return w.extend(id, key, key, time.Now()) }

// extend records, at now, a dispatch to endpoint id of key, which
// continues from (0: nothing): from's place in id's stack, if it has one,
// is key's, at the head (a conversation's turn replaces its previous one,
// as its engine's slot does). It returns from's distance before it, -1
// when from was not among the last maxWarmKeys.
func (w *warmth) extend(id, from, key uint64, now time.Time) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.eps[id]
	if s == nil {
		s = &keyStack{keys: make([]uint64, 0, maxWarmKeys), at: make([]int64, 0, maxWarmKeys)}
		w.eps[id] = s
	}
	d := -1
	if from != 0 {
		d = slices.Index(s.keys, from)
	}
	if d >= 0 && from != key {
		w.left(id, from)
	}
	if d >= 0 {
		g := float64(now.UnixNano()-s.at[d]) / 1e9
		w.gaps++
		w.gap += max(gapRate, 1/float64(w.gaps)) * (g - w.gap)
	}
	if o := slices.Index(s.keys, key); o >= 0 && o != d { // key was dispatched as its own too
		s.keys, s.at = slices.Delete(s.keys, o, o+1), slices.Delete(s.at, o, o+1)
		if d > o {
			d--
		}
	}
	switch {
	case d >= 0:
		copy(s.keys[1:d+1], s.keys[:d])
		copy(s.at[1:d+1], s.at[:d])
	case len(s.keys) < maxWarmKeys:
		s.keys, s.at = append(s.keys, 0), append(s.at, 0)
		copy(s.keys[1:], s.keys)
		copy(s.at[1:], s.at)
	default:
		w.left(id, s.keys[len(s.keys)-1])
		copy(s.keys[1:], s.keys[:len(s.keys)-1])
		copy(s.at[1:], s.at[:len(s.at)-1])
	}
	s.keys[0], s.at[0] = key, now.UnixNano()
	if w.where != nil {
		w.where[key] = id
	}
	return d
}

// left drops key's where entry if it names endpoint id, whose stack key
// leaves. w.mu is held.
func (w *warmth) left(id, key uint64) {
	if w.where[key] == id {
		delete(w.where, key)
	}
}

// latest returns the latest of marks (a request's, earliest first) that
// some endpoint's stack holds: the endpoint it was last dispatched to (id),
// the mark, its distance there and whether the engine is shown to keep it
// (within its count, or, the count unknown, within the distances its
// answers showed mostly warm); dist is -1 when none is held.
func (w *warmth) latest(marks []prefix.Mark) (id uint64, m prefix.Mark, dist int, kept bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for i := len(marks) - 1; i >= 0; i-- {
		at, ok := w.where[marks[i].Hash]
		if !ok {
			continue
		}
		s := w.eps[at]
		if d := slices.Index(s.keys, marks[i].Hash); d >= 0 {
			k := w.keptOf(s)
			return at, marks[i], d, d < k || k == 0 && d < s.atLeast
		}
	}
	return 0, prefix.Mark{}, -1, false
}

// crowded reports whether a new key dispatched to endpoint id at now
// would push out one its engine keeps that is live: its count is known,
// that many keys went there since, and the one it pushes out was
// dispatched within liveGaps × the mean gap between a key's dispatches
// (most keys that come back do within it).
func (w *warmth) crowded(id uint64, now time.Time) bool {
	if w.fleet.Load() == 0 {
		return false
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.eps[id]
	k := w.keptOf(s)
	return k > 0 && s != nil && len(s.keys) >= k && float64(now.UnixNano()-s.at[k-1])/1e9 < liveGaps*w.gap
}

// gapRate weighs one gap in warmth.gap once 20 were seen; liveGaps is how
// many mean gaps after its last dispatch a key counts as live (crowded).
const (
	gapRate  = 0.05
	liveGaps = 3
)

// outcome records that a request dispatched to id at distance dist (see)
// found its key warm or not, and relearns id's count and the fleet's.
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
	kept, atLeast := s.kept, 0
	for i := range s.all {
		if s.all[i] < minWarmEvidence {
			continue
		}
		if s.warm[i] < s.all[i]/2 {
			break
		}
		atLeast = i + 1
	}
	if k, ok := s.fit(); ok {
		kept = k
	} else if kept > 0 && atLeast > kept {
		kept = 0 // warm beyond the count: it keeps more
	}
	if kept == s.kept && atLeast == s.atLeast {
		return
	}
	s.kept, s.atLeast = kept, atLeast
	w.relearnFleet()
}

// fit returns the count that explains s's outcomes best: the least
// answers contradicting it (misses below it, hits at or beyond it), the
// middle of the counts that do equally well; 0 when keeping everything
// explains them as well. It pools every distance's answers, where a count
// read off one distance at a time waits for two misses at one of them: a
// conversation's turns reach an endpoint at scattered distances. ok is
// false while fewer than minWarmEvidence misses were seen (the count
// holds).
func (s *keyStack) fit() (kept int, ok bool) {
	var misses, hits float64
	for i := range s.all {
		misses += s.all[i] - s.warm[i]
		hits += s.warm[i]
	}
	if misses < minWarmEvidence {
		return 0, false
	}
	const eps = 1e-9
	best, lo, hi := misses-eps, 0, 0 // keeping everything: every miss contradicts it
	below := 0.0                     // misses at distances below k
	for k := 1; k <= maxWarmKeys; k++ {
		below += s.all[k-1] - s.warm[k-1]
		hits -= s.warm[k-1]
		switch e := below + hits; {
		case e < best-eps:
			best, lo, hi = e, k, k
		case e <= best+eps && lo > 0:
			hi = k
		}
	}
	return (lo + hi) / 2, true
}

// keptOf is s's count: its own, else the fleet's unless s was seen warm
// that deep; 0 when unknown. w.mu is held.
func (w *warmth) keptOf(s *keyStack) int {
	switch f := int(w.fleet.Load()); {
	case s != nil && s.kept > 0:
		return s.kept
	case s != nil && s.atLeast > f:
		return 0
	default:
		return f
	}
}

// kept returns the keys endpoint id is taken to keep warm (its own count,
// else the fleet's); 0 when unknown (as many as the index says).
func (w *warmth) kept(id uint64) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.keptOf(w.eps[id])
}

// at reports whether endpoint id may still hold key (holds: its count is
// unknown, or key is among its last kept keys) and whether dispatching key
// there would push out a key its engine keeps (evicts: its count is known,
// that many keys went there since, and key is not among them).
func (w *warmth) at(id, key uint64) (holds, evicts bool) {
	if w.fleet.Load() == 0 {
		return true, false // the common case: nothing learned, nothing to look up
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.eps[id]
	k := w.keptOf(s)
	switch {
	case k == 0:
		return true, false
	case s == nil:
		return false, false // nothing was sent there
	}
	d := slices.Index(s.keys, key)
	held := d >= 0 && d < k
	return held, !held && len(s.keys) >= k
}

// forget drops endpoint id (it left, or its engine restarted).
func (w *warmth) forget(id uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	s, ok := w.eps[id]
	if !ok {
		return
	}
	for _, k := range s.keys {
		w.left(id, k)
	}
	delete(w.eps, id)
	w.relearnFleet()
}

// relearnFleet sets the fleet's count, the least an endpoint learned, and
// moves the version. w.mu is held.
func (w *warmth) relearnFleet() {
	fleet := 0
	for _, o := range w.eps {
		if o.kept > 0 && (fleet == 0 || o.kept < fleet) {
			fleet = o.kept
		}
	}
	w.fleet.Store(int64(fleet))
	w.version.Add(1)
}
