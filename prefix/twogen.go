package prefix

// TwoGen is a bounded map that forgets the least recently used half at a
// time: entries live in the current generation, or in the old one until
// the current fills its half of the bound; a hit in the old generation
// moves the entry to the current one. An entry weighs weight(v) (1 when
// weight is nil) against the bound; one heavier than half the bound is not
// kept. Not safe for concurrent use.
type TwoGen[V any] struct {
	cur, old map[uint64]V
	half     int // weight per generation
	curW     int // weight in cur
	weight   func(V) int
}

// NewTwoGen returns an empty TwoGen bounded to size in weight.
func NewTwoGen[V any](size int, weight func(V) int) TwoGen[V] {
	if weight == nil {
		weight = func(V) int { return 1 }
	}
	return TwoGen[V]{cur: make(map[uint64]V), old: make(map[uint64]V), half: max(1, size/2), weight: weight}
}

// Get returns k's value, refreshing it.
func (g *TwoGen[V]) Get(k uint64) (V, bool) {
	if v, ok := g.cur[k]; ok {
		return v, true
	}
	v, ok := g.old[k]
	if ok {
		delete(g.old, k)
		g.Put(k, v)
	}
	return v, ok
}

// Put sets k's value.
func (g *TwoGen[V]) Put(k uint64, v V) {
	w := g.weight(v)
	if w > g.half {
		return // heavier than a generation: not worth forgetting everything for
	}
	if g.curW+w > g.half {
		g.old, g.cur, g.curW = g.cur, make(map[uint64]V, g.half/4), 0
	}
	if prev, ok := g.cur[k]; ok {
		g.curW -= g.weight(prev)
	}
	g.cur[k] = v
	g.curW += w
}

// Len returns the number of entries.
func (g *TwoGen[V]) Len() int { return len(g.cur) + len(g.old) }

// Reset forgets every entry.
func (g *TwoGen[V]) Reset() { clear(g.cur); clear(g.old); g.curW = 0 }
