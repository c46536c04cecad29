package prefix

import (
	"sync"
	"sync/atomic"
	"time"
)

// Index is kvroute's approximate map of which endpoint holds which prompt
// prefix, learned from its own routing decisions. It keeps one LRU of block
// hashes per endpoint, sized like the engine's KV cache, and a reverse map
// from hash to the endpoints holding it; evicting a hash from an endpoint's
// LRU removes that endpoint from the hash's owners. Entries also expire
// after a TTL, and a global cap bounds memory.
//
// Endpoints are named by a caller-chosen uint64 id. All methods are safe for
// concurrent use; one mutex guards everything (no nested locks).
//
// The per-endpoint LRUs are intrusive lists in pointer-free slabs rather
// than golang-lru's simplelru: an entry costs 16 bytes instead of a
// heap-allocated 64-byte element plus a map slot, and the garbage collector
// never scans the slabs. That is what keeps the index under 100 bytes per
// (block, endpoint) entry.
type Index struct {
	mu     sync.Mutex
	owners table            // hash → endpoints holding it
	slots  []*lru           // by slot number; nil when free
	slotOf map[uint64]int32 // endpoint id → slot
	// truthIDs are the endpoints on engine truth (SetTruth); kept apart
	// from the slots, which Forget frees, so a forgotten endpoint's new
	// slot keeps its mode.
	truthIDs map[uint64]bool
	freeSlot []int32
	entries  int // Σ LRU lengths

	defaultCap int
	maxEntries int
	ttl        time.Duration
	now        func() time.Time
	epoch      time.Time

	evictions, expiries atomic.Uint64
	drops               atomic.Uint64 // claims removed by engine events (Drop)
	sink                uint64        // keeps table.touch's loads
}

// IndexConfig configures an Index.
type IndexConfig struct {
	// BlocksPerEndpoint is the LRU capacity of an endpoint whose capacity was
	// never set with SetCapacity (the engine's KV capacity in index blocks).
	BlocksPerEndpoint int
	// MaxEntries caps the (block, endpoint) entries of all endpoints
	// together; each endpoint's capacity is at most MaxEntries / endpoints.
	MaxEntries int
	// TTL expires a block nobody routed for this long (0: never).
	TTL time.Duration
	// Now is the clock (nil: time.Now).
	Now func() time.Time
}

// ref is one endpoint holding a hash: its slot and the hash's node in that
// endpoint's LRU.
type ref struct {
	slot, node int32
}

// lru is one endpoint's list of hashes, most recent at head, in a slab.
type lru struct {
	id  uint64
	cap int // configured capacity
	eff int // effective capacity: cap, lowered by Correct when the engine holds less
	// truth is set while the endpoint's engine publishes KV events
	// (SetTruth): its evictions arrive as events, so Correct leaves its
	// capacity alone and the LRU keeps truthHeadroom × cap.
	truth bool
	// lower are the hashes held here only on a slower tier (CPU memory,
	// storage) according to the engine's events (SetLower): a request
	// finds them cached but waits for them to load. nil until one is.
	lower      map[uint64]struct{}
	nodes      []node
	head, tail int32
	free       int32
	n          int
}

type node struct {
	key        uint64
	prev, next int32
}

const none = int32(-1)

// epochBack is how far before its creation an index's stamps count from:
// a claim imported from an older router (Import) is stamped with its own
// age, which the new index's clock must reach back to.
const epochBack = 1 << 24 * time.Second // 194 days; stamps are uint32 seconds

// NewIndex returns an empty Index.
func NewIndex(c IndexConfig) *Index {
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.BlocksPerEndpoint <= 0 {
		c.BlocksPerEndpoint = 1
	}
	if c.MaxEntries <= 0 {
		c.MaxEntries = c.BlocksPerEndpoint * 1024
	}
	return &Index{
		owners:     newTable(),
		slotOf:     make(map[uint64]int32),
		truthIDs:   make(map[uint64]bool),
		defaultCap: c.BlocksPerEndpoint,
		maxEntries: c.MaxEntries,
		ttl:        c.TTL,
		now:        c.Now,
		epoch:      c.Now().Add(-epochBack),
	}
}

// Match is one endpoint's matched prefix.
type Match struct {
	// ID is the endpoint id.
	ID uint64
	// Blocks is the number of leading blocks of the request held there.
	Blocks int
	// Lower is how many of those blocks are held there only on a slower
	// tier (SetLower).
	Lower int
	slot  int32
}

// Match walks hashes from the first and appends to dst, for every endpoint
// holding the first block, how many leading blocks it holds. The walk stops
// at the first block no candidate holds. Expired blocks count as absent.
func (x *Index) Match(hashes []uint64, dst []Match) []Match {
	dst = dst[:0]
	if len(hashes) == 0 {
		return dst
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	now := x.stamp()
	t := &x.owners
	for i, h := range hashes {
		at := t.find(h)
		if at >= 0 && x.expired(t.slots[at].stamp, now) {
			x.expire(at)
			at = -1
		}
		if at < 0 {
			break
		}
		if i == 0 {
			for k, n := 0, int(t.slots[at].n); k < n; k++ {
				r := t.owner(at, k)
				dst = append(dst, Match{ID: x.slots[r.slot].id, Blocks: 1, Lower: x.slots[r.slot].isLower(h), slot: r.slot})
			}
			continue
		}
		alive := false
		for j := range dst {
			if dst[j].Blocks != i {
				continue
			}
			if t.ownerOf(at, dst[j].slot) >= 0 {
				dst[j].Blocks++
				dst[j].Lower += x.slots[dst[j].slot].isLower(h)
				alive = true
			}
		}
		if !alive {
			break
		}
	}
	return dst
}

// Record notes that endpoint id now holds hashes (a request's chain, first
// block first). Blocks are touched last to first, so an endpoint's LRU
// evicts a prefix's tail before its head, as engines do.
func (x *Index) Record(id uint64, hashes []uint64) {
	if len(hashes) == 0 {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	s := x.slot(id)
	l := x.slots[s]
	now := x.stamp()
	t := &x.owners
	// If the deepest block was recorded here this second, so was the whole
	// chain (Record touches every block): nothing to refresh.
	if at := t.find(hashes[len(hashes)-1]); at >= 0 && t.slots[at].stamp == now && t.ownerOf(at, s) >= 0 {
		return
	}
	// Load the table slots this will visit before visiting them: the
	// chain's own, and those of the blocks it will evict here.
	x.sink += t.touch(hashes)
	for n, k := l.tail, l.n+len(hashes)-x.capOf(l); n != none && k > 0; n, k = l.nodes[n].prev, k-1 {
		x.sink += t.slots[t.home(norm(l.nodes[n].key))].key
	}
	for i := len(hashes) - 1; i >= 0; i-- {
		h := hashes[i]
		at := t.find(h)
		if at >= 0 {
			if k := t.ownerOf(at, s); k >= 0 {
				// Already held: refresh recency, unless it was refreshed
				// this second (an approximate LRU: order within a second
				// does not matter, and a warm burst then costs only
				// lookups).
				if t.slots[at].stamp != now {
					l.moveToHead(t.owner(at, k).node)
					t.slots[at].stamp = now
				}
				continue
			}
		}
		x.makeRoom(s, now)
		if at >= 0 {
			at = t.find(h) // making room may have moved or removed it
		}
		if at < 0 {
			at = t.insert(h)
		}
		t.slots[at].stamp = now
		t.addOwner(at, ref{slot: s, node: l.pushHead(h)})
		x.entries++
	}
}

// SetCapacity sets endpoint id's LRU capacity in blocks (from the engine's
// KV capacity), evicting its oldest entries if it shrank.
func (x *Index) SetCapacity(id uint64, blocks int) {
	if blocks <= 0 {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	s := x.slot(id)
	l := x.slots[s]
	l.cap, l.eff = blocks, blocks
	if l.truth {
		l.eff = blocks * truthHeadroom
	}
	for l.n > x.capOf(l) {
		x.evictTail(s)
	}
}

// Correct feeds back what the engine reported for a request routed to
// endpoint id: over is true when the engine had fewer cached tokens than the
// index claimed, i.e. it evicted earlier than the index modelled. The
// endpoint's effective capacity then shrinks by a tenth (evicting its
// oldest claims); each accurate report grows it back by a hundredth, up to
// the configured capacity (additive increase, multiplicative decrease). It
// returns the effective capacity.
func (x *Index) Correct(id uint64, over bool) int {
	x.mu.Lock()
	defer x.mu.Unlock()
	s, ok := x.slotOf[id]
	if !ok {
		return 0
	}
	l := x.slots[s]
	if l.truth {
		return l.eff
	}
	if over {
		l.eff = max(l.eff-l.eff/10, min(l.cap, 64))
		for l.n > x.capOf(l) {
			x.evictTail(s)
		}
	} else if l.eff < l.cap {
		l.eff = min(l.cap, l.eff+max(1, l.cap/100))
	}
	return l.eff
}

// truthHeadroom is how much more than its modelled capacity an endpoint's
// LRU keeps while its engine's events say what it evicted: the capacity in
// index blocks is an estimate (KV tokens × learned bytes per token), and
// the index must not forget before the engine does. The LRU stays as a
// bound on claims no event confirms (a request that never ran).
const truthHeadroom = 2

// SetTruth switches endpoint id between learning (off: the LRU models the
// engine's capacity and Correct shrinks it on over-claims) and engine
// truth (on: the engine's KV events remove what it evicted, through Drop,
// and the LRU is only a bound, truthHeadroom × its capacity).
func (x *Index) SetTruth(id uint64, on bool) {
	x.mu.Lock()
	defer x.mu.Unlock()
	s := x.slot(id)
	l := x.slots[s]
	if l.truth == on {
		return
	}
	l.truth = on
	if on {
		x.truthIDs[id] = true
		l.eff = l.cap * truthHeadroom
		return
	}
	delete(x.truthIDs, id)
	l.eff = l.cap
	for l.n > x.capOf(l) {
		x.evictTail(s)
	}
}

// OnTruth reports whether endpoint id is on engine truth (SetTruth).
func (x *Index) OnTruth(id uint64) bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.truthIDs[id]
}

// Drop removes endpoint id's claim on each of hashes (its engine evicted
// them). It returns how many claims it removed.
func (x *Index) Drop(id uint64, hashes ...uint64) int {
	x.mu.Lock()
	defer x.mu.Unlock()
	s, ok := x.slotOf[id]
	if !ok {
		return 0
	}
	n := 0
	for _, h := range hashes {
		at := x.owners.find(h)
		if at < 0 {
			continue
		}
		if k := x.owners.ownerOf(at, s); k >= 0 {
			x.unlink(at, k)
			n++
		}
	}
	x.drops.Add(uint64(n))
	return n
}

// SetLower marks endpoint id's claim on hash h as held only on a slower
// tier than the GPU (lower), or on the GPU again; a hash id is not shown
// holding is left alone. Forgetting the claim forgets the mark.
func (x *Index) SetLower(id uint64, h uint64, lower bool) {
	x.mu.Lock()
	defer x.mu.Unlock()
	s, ok := x.slotOf[id]
	if !ok {
		return
	}
	l := x.slots[s]
	if !lower {
		delete(l.lower, h)
		return
	}
	if at := x.owners.find(h); at >= 0 && x.owners.ownerOf(at, s) >= 0 {
		if l.lower == nil {
			l.lower = make(map[uint64]struct{})
		}
		l.lower[h] = struct{}{}
	}
}

// Holds reports whether endpoint id is shown holding hash h.
func (x *Index) Holds(id uint64, h uint64) bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	s, ok := x.slotOf[id]
	if !ok {
		return false
	}
	at := x.owners.find(h)
	return at >= 0 && x.owners.ownerOf(at, s) >= 0
}

// Forget removes every claim of endpoint id (it left, or its engine
// restarted with an empty cache).
func (x *Index) Forget(id uint64) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.forget(id)
}

// Export calls yield with every claim the index holds that has not
// expired, endpoint by endpoint, most recently used first, at most max
// claims in all (shared evenly among the endpoints), with the claim's age
// in whole seconds: the state a router replica that joins its peers
// imports (Import). yield must not call the index.
func (x *Index) Export(max int, yield func(id, h uint64, age uint32)) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if len(x.slotOf) == 0 || max <= 0 {
		return
	}
	per := max / len(x.slotOf)
	now := x.stamp()
	for _, l := range x.slots {
		if l == nil {
			continue
		}
		k := 0
		for n := l.head; n != none && k < per; n = l.nodes[n].next {
			h := l.nodes[n].key
			stamp := x.owners.slots[x.owners.find(h)].stamp
			if x.expired(stamp, now) {
				continue
			}
			yield(l.id, h, now-stamp)
			k++
		}
	}
}

// Import adds claims of endpoint id that another router exported
// (Export): hashes, most recently used first, each ages[i] seconds old.
// They go behind the endpoint's own claims, into its free room only: an
// import never evicts. A hash already held keeps its place, expired ones
// are skipped, and a new hash is stamped as old as it is (its TTL runs
// on from the exporter's). It returns how many claims it added.
func (x *Index) Import(id uint64, hashes []uint64, ages []uint32) int {
	x.mu.Lock()
	defer x.mu.Unlock()
	s := x.slot(id)
	l := x.slots[s]
	t := &x.owners
	now := x.stamp()
	added := 0
	for i, h := range hashes {
		if l.n >= x.capOf(l) {
			break
		}
		age := ages[i]
		if x.ttl > 0 && time.Duration(age)*time.Second > x.ttl {
			continue
		}
		stamp := now - min(age, now)
		at := t.find(h)
		if at >= 0 && t.ownerOf(at, s) >= 0 {
			continue
		}
		if at >= 0 && x.expired(t.slots[at].stamp, now) {
			x.expire(at) // its other claims are gone: not revived by this one
			at = -1
		}
		if at < 0 {
			at = t.insert(h)
			t.slots[at].stamp = stamp
		} else {
			t.slots[at].stamp = max(t.slots[at].stamp, stamp)
		}
		t.addOwner(at, ref{slot: s, node: l.pushTail(h)})
		x.entries++
		added++
	}
	return added
}

// IndexStats are an Index's size and counters.
type IndexStats struct {
	Endpoints int
	Hashes    int    // distinct block hashes
	Entries   int    // (block, endpoint) entries
	Bytes     int    // estimated heap bytes
	Evictions uint64 // entries evicted by capacity
	Expiries  uint64 // hashes expired by TTL
	Drops     uint64 // entries removed by the engines' eviction events
}

// TTL returns how long a block nobody was routed to is remembered (0:
// forever).
func (x *Index) TTL() time.Duration { return x.ttl }

// Stats returns the index's current size and counters.
func (x *Index) Stats() IndexStats {
	x.mu.Lock()
	defer x.mu.Unlock()
	var slab int
	for _, l := range x.slots {
		if l != nil {
			slab += cap(l.nodes) * 16
		}
	}
	return IndexStats{
		Endpoints: len(x.slotOf), Hashes: x.owners.n, Entries: x.entries,
		Bytes: slab + x.owners.bytes(), Evictions: x.evictions.Load(), Expiries: x.expiries.Load(),
		Drops: x.drops.Load(),
	}
}

// --- internals; x.mu is held ---

func (x *Index) stamp() uint32 {
	return uint32(x.now().Sub(x.epoch) / time.Second)
}

func (x *Index) expired(stamp, now uint32) bool {
	return x.ttl > 0 && time.Duration(now-stamp)*time.Second > x.ttl
}

// capOf is l's effective capacity: its own, bounded by a fair share of the
// global cap.
func (x *Index) capOf(l *lru) int {
	c := l.eff
	if share := x.maxEntries / max(1, len(x.slotOf)); share < c {
		c = share
	}
	return max(c, 1)
}

func (x *Index) slot(id uint64) int32 {
	if s, ok := x.slotOf[id]; ok {
		return s
	}
	l := &lru{id: id, cap: x.defaultCap, eff: x.defaultCap, head: none, tail: none, free: none, truth: x.truthIDs[id]}
	if l.truth {
		l.eff *= truthHeadroom
	}
	var s int32
	if n := len(x.freeSlot); n > 0 {
		s = x.freeSlot[n-1]
		x.freeSlot = x.freeSlot[:n-1]
		x.slots[s] = l
	} else {
		s = int32(len(x.slots))
		x.slots = append(x.slots, l)
	}
	x.slotOf[id] = s
	return s
}

// makeRoom evicts from slot s's LRU until one more entry fits: expired
// entries first (at most a few per call), then the least recently used.
func (x *Index) makeRoom(s int32, now uint32) {
	l := x.slots[s]
	for expired := 0; l.tail != none; {
		at := x.owners.find(l.nodes[l.tail].key)
		switch {
		case expired < 2 && x.expired(x.owners.slots[at].stamp, now):
			x.expire(at)
			expired++
		case l.n >= x.capOf(l):
			x.evict(s, at)
		default:
			return
		}
	}
}

func (x *Index) evictTail(s int32) {
	l := x.slots[s]
	x.evict(s, x.owners.find(l.nodes[l.tail].key))
}

// evict removes slot s's claim on the hash in table slot at.
func (x *Index) evict(s int32, at int) {
	x.unlink(at, x.owners.ownerOf(at, s))
	x.evictions.Add(1)
}

// unlink removes owner k of the hash in table slot at, and the hash when
// that was its last owner.
func (x *Index) unlink(at, k int) {
	t := &x.owners
	r := t.owner(at, k)
	x.slots[r.slot].remove(r.node)
	x.entries--
	t.removeOwner(at, k)
	if t.slots[at].n == 0 {
		t.del(at)
	}
}

// expire removes the hash in table slot at from every endpoint.
func (x *Index) expire(at int) {
	t := &x.owners
	n := int(t.slots[at].n)
	for k := range n {
		r := t.owner(at, k)
		x.slots[r.slot].remove(r.node)
	}
	x.entries -= n
	delete(t.more, t.slots[at].key)
	t.del(at)
	x.expiries.Add(1)
}

func (x *Index) forget(id uint64) {
	s, ok := x.slotOf[id]
	if !ok {
		return
	}
	l := x.slots[s]
	for n := l.head; n != none; {
		next := l.nodes[n].next
		if at := x.owners.find(l.nodes[n].key); at >= 0 {
			if k := x.owners.ownerOf(at, s); k >= 0 {
				x.unlink(at, k)
			}
		}
		n = next
	}
	x.slots[s] = nil
	delete(x.slotOf, id)
	x.freeSlot = append(x.freeSlot, s)
}

func (l *lru) pushHead(key uint64) int32 {
	var n int32
	if l.free != none {
		n = l.free
		l.free = l.nodes[n].next
	} else {
		n = int32(len(l.nodes))
		l.nodes = append(l.nodes, node{})
	}
	l.nodes[n] = node{key: key, prev: none, next: l.head}
	if l.head != none {
		l.nodes[l.head].prev = n
	}
	l.head = n
	if l.tail == none {
		l.tail = n
	}
	l.n++
	return n
}

// pushTail adds key behind every other entry (the next to be evicted).
func (l *lru) pushTail(key uint64) int32 {
	if l.head == none {
		return l.pushHead(key)
	}
	var n int32
	if l.free != none {
		n = l.free
		l.free = l.nodes[n].next
	} else {
		n = int32(len(l.nodes))
		l.nodes = append(l.nodes, node{})
	}
	l.nodes[n] = node{key: key, prev: l.tail, next: none}
	l.nodes[l.tail].next = n
	l.tail = n
	l.n++
	return n
}

// isLower is 1 when l's hash h is held only on a slower tier, else 0.
func (l *lru) isLower(h uint64) int {
	if _, ok := l.lower[h]; ok {
		return 1
	}
	return 0
}

func (l *lru) remove(n int32) {
	nd := l.nodes[n]
	if l.lower != nil {
		delete(l.lower, nd.key)
	}
	if nd.prev != none {
		l.nodes[nd.prev].next = nd.next
	} else {
		l.head = nd.next
	}
	if nd.next != none {
		l.nodes[nd.next].prev = nd.prev
	} else {
		l.tail = nd.prev
	}
	l.nodes[n] = node{next: l.free, prev: none}
	l.free = n
	l.n--
}

func (l *lru) moveToHead(n int32) {
	if l.head == n {
		return
	}
	nd := l.nodes[n]
	l.nodes[nd.prev].next = nd.next
	if nd.next != none {
		l.nodes[nd.next].prev = nd.prev
	} else {
		l.tail = nd.prev
	}
	l.nodes[n].prev = none
	l.nodes[n].next = l.head
	l.nodes[l.head].prev = n
	l.head = n
}
