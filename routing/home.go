package routing

import (
	"cmp"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/prefix"
)

// homes gives every prefix key (the hash of the block at depth
// MinMatchBlocks) a home endpoint, apart from the cache model: the index
// forgets blocks when it believes the engine evicted them, but a prefix that
// comes back returns to its home rather than to whichever endpoint is least
// loaded at that moment.
//
// The homes are a function of the set of recurring keys (seen at least twice
// within the TTL) and of the endpoint set, never of the order in which keys
// arrived: independent router replicas, each seeing a random share of the
// same traffic and so the same recurring keys, agree on every home. They
// are assigned in rounds on rendezvous order: in round r every unplaced key
// proposes to its r-th rendezvous choice, and each endpoint accepts the
// proposals with the highest rendezvous scores while it holds fewer than
// LoadFactor × recurring keys / endpoints (homeBound). No endpoint exceeds that
// bound, and most keys stay on their rendezvous winner: plain rendezvous
// hashing spreads 64 prefixes over 8 endpoints as unevenly as 4 to 13
// (binomial), and an endpoint homing 13 long prefixes cannot cache them and
// still run its batch. (Consistent hashing with bounded loads balances as
// well, but its homes depend on the order keys were first seen, so replicas
// disagreed on a third of them.) A key seen once weighs on nothing — a
// one-off prompt has nothing to keep cached — and is homed where the
// assignment would most likely put it if it recurred (place).
//
// That is for router replicas, which share the engines and so must agree.
// A router alone (lookup's alone: no other router's requests show in the
// engines' load), or replicas that gossip their placements (peerSaw),
// knows where each key went and makes homes sticky instead:
// a new key goes to its rendezvous winner unless that endpoint already
// homes its share of the live keys, recurring or seen once (their mean,
// rounded up), and then to its next choice below it (bounded-load
// rendezvous); a key that recurs keeps the endpoint its first request went
// to, and the assignment moves a key only when its endpoint is over the
// bound (LoadFactor × the mean). New keys fill the endpoints evenly, as a
// client sending group g to server g mod n would: placed under the bound,
// 64 prompt groups on 8 kvsim pods sized for 8 each went 9, 9, 8, 8, 8, 8,
// 7, 7, and the two pods of 9 queued on their full caches (TTFT p99 1.2 s at
// 48 req/s against 0.14 s); the bound's slack keeps homes from moving
// while the number of live keys wanders. Four prompt groups
// on four servers so get four homes from their first requests, as a client
// sending group g to server g would, where rendezvous alone puts two of
// them on one server three times in four; on engines that keep one prompt
// each (a stock Ollama server) every such collision cost recomputes until
// the homes moved.
//
// The assignment is recomputed when the recurring keys or the endpoints
// change: at once while that is cheap (keys × endpoints up to 2^12),
// otherwise at most once per 200 times the last computation took (under
// 0.5% of a core); a key that began recurring since is homed as if seen
// once meanwhile. Keys live in an LRU (golang-lru's simplelru) of bounded
// size and expire after the index's TTL. Safe for concurrent use.
type homes struct {
	mu        sync.Mutex
	lru       *simplelru.LRU[uint64, homeKey]
	recurring map[uint64]struct{} // the recurring keys
	ttl       time.Duration
	now       func() time.Time

	// The assignment, over the endpoints eps (an immutable set's slice),
	// and the homes it gives each endpoint.
	assigned map[uint64]uint64
	load     map[uint64]int
	eps      []*discovery.Endpoint
	factor   float64
	dirty    bool
	last     time.Time     // when it was last computed
	cost     time.Duration // how long that took

	proposals map[uint64][]uint64 // endpoint → its first-round proposals' scores, highest first
	pending   []proposal          // scratch

	// kept, when set, returns the keys an endpoint's engine is learned to
	// keep warm (0: unknown; warmth.kept), and keptVersion moves when one
	// changes: the assignment then is redone, bounded by them (bounds).
	kept        func(id uint64) int
	keptVersion func() uint64
	keptSeen    uint64
	bound       map[uint64]int // the assignment's bound per endpoint

	// alone: homes are sticky (lookup's alone). once counts, per endpoint,
	// the live keys seen once whose first request went there (homeKey.at),
	// onceTotal all of them.
	alone      bool
	once       map[uint64]int
	onceTotal  int
	placeBound map[uint64]int // placeAlone's scratch
	caps       []int          // boundsInto's scratch
}

type proposal struct{ key, endpoint, score uint64 }

type homeKey struct {
	seen      int64 // unix seconds of the last request with the key
	recurring bool
	// strayed: this router placed the key's first request off its home
	// (the home was busy), so its cache holds the key elsewhere and the home
	// is cold as far as this router knows.
	strayed bool
	// at is the endpoint the key's first request went to (placed), where
	// a router alone homes it.
	at uint64
	// The key's family (the requests sharing it, see family): the deepest
	// match in the index of its last familyRing requests, and the two least
	// deepest matches of its last two windows of familyWindow requests.
	depths       [familyRing]uint16
	filled, next uint8
	low          [2]lows // the last window's and this one's
	window       uint8   // requests in this window
	chained      bool
}

// lows are the two least depths of a window, least first; 0 is none.
type lows [2]uint16

// add takes one depth into l (0, none, changes nothing).
func (l *lows) add(d uint16) {
	switch {
	case d == 0:
	case l[0] == 0 || d < l[0]:
		l[0], l[1] = d, l[0]
	case l[1] == 0 || d < l[1]:
		l[1] = d
	}
}

// second returns the second least depth of l, or the least when l holds
// one; 0 when none.
func (l lows) second() uint16 {
	if l[1] > 0 {
		return l[1]
	}
	return l[0]
}

// familyRing is how many of a key's recent requests tell whether its family
// is chained; familyWindow is how many requests a new branch is expected
// within (the shared depth is the second least match of the last one to two
// windows, so a depth that was low by accident is forgotten after two).
const (
	familyRing   = 16
	familyWindow = 64
)

// maxHomes bounds the table: 65,536 keys ≈ 7.6 MB (115 bytes a key,
// measured), plus the assignment's maps for the recurring ones. A fleet serving more live distinct prefixes than that in one
// TTL gains little from balancing their homes individually; the least
// recently used keys are dropped first.
const maxHomes = 1 << 16

// cheapRounds is the work (keys × endpoints) of an assignment cheap enough
// to redo within a request whenever it changed: a few tens of microseconds.
const cheapRounds = 1 << 12

func newHomes(ttl time.Duration, now func() time.Time) *homes {
	h := &homes{recurring: make(map[uint64]struct{}), once: make(map[uint64]int), ttl: ttl, now: now}
	h.lru, _ = simplelru.NewLRU(maxHomes, func(k uint64, v homeKey) {
		if v.recurring {
			delete(h.recurring, k)
			h.dirty = true
		} else {
			h.uncount(v)
		}
	})
	return h
}

// uncount takes a key seen once off its endpoint's count. h.mu is held.
func (h *homes) uncount(v homeKey) {
	if v.at != 0 {
		h.once[v.at]--
		h.onceTotal--
		if h.once[v.at] <= 0 {
			delete(h.once, v.at)
		}
	}
}

// keyOf returns the prefix key of a request whose chain is hashes (see
// rendezvousKey; prefill: for the prefill pool), whether it has one
// (keyed: a prompt of MinMatchBlocks blocks at least), and, when the key is
// a conversation's own under a shared prefix (homes.family; among
// replicas), the shared part's depth in blocks (branch, presumed held at
// the branch's home; 0 otherwise). deepest is the deepest match in the
// index; see is decide's (the request counts).
func (p *Prefix) keyOf(hashes []uint64, prefill bool, prm *PrefixParams, deepest int, replicated, see bool) (key uint64, keyed bool, branch int) {
	key = rendezvousKey(hashes, prm.MinMatchBlocks)
	keyed = len(hashes) >= prm.MinMatchBlocks
	if keyed {
		// A family of conversations under one shared prefix: each
		// branch (conversation) is keyed by its own first block.
		shared, chained := p.homes.family(key, deepest, prm.MinMatchBlocks, see)
		if chained && shared < len(hashes) && replicated {
			key, branch = hashes[shared], shared
		}
	}
	if prefill {
		// The prefill pool homes a prefix apart from the serving one.
		key = prefix.Mix64(key ^ prefillPoolSalt)
	}
	return key, keyed, branch
}

// prefillPoolSalt separates a prefix key's home in the prefill pool from
// its home among the endpoints that answer clients.
const prefillPoolSalt = 0x5046_696c_6c50_6f6f // "PFillPoo"

// rendezvousKey is the hash of the block at depth minMatch (or the last
// block of shorter prompts): requests sharing a useful prefix share the key,
// requests sharing less (a short system prompt) do not. A prompt shorter
// than a block has nothing to share and gets a random key, so such prompts
// spread.
func rendezvousKey(hashes []uint64, minMatch int) uint64 {
	if len(hashes) == 0 {
		return rand.Uint64()
	}
	return hashes[min(minMatch, len(hashes))-1]
}

// lookup returns key's home among eps (every endpoint of the set, usable or
// not: replicas agree on the set, not on every endpoint's health) and
// what is known of the key (homeKey). When see is set the request counts: it refreshes
// the key, makes a key seen before recurring, and records a new one;
// /debug/route leaves it unset. alone is set for a router whose requests
// are all the engines see, and for gossiping replicas, which know where
// each other's keys went (homes are then sticky; see the type). ok is
// false for an empty eps. A branch's
// key (a conversation's, see family) is homed on its plain rendezvous
// winner and never joins the balanced assignment: conversations begin and
// end all the time, and every change of the recurring set may move homes,
// each move a conversation's full recompute.
func (h *homes) lookup(key uint64, eps []*discovery.Endpoint, factor float64, see, branch, alone bool, t turn) (home uint64, k homeKey, ok bool) {
	if len(eps) == 0 {
		return 0, homeKey{}, false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	now := h.now()
	h.expire(now.Unix())
	v, _ := h.lru.Peek(key)
	if see {
		v = h.sight(key, branch, now.Unix())
	}
	if alone != h.alone {
		h.alone, h.dirty = alone, true
	}
	if h.keptVersion != nil {
		if v := h.keptVersion(); v != h.keptSeen {
			h.keptSeen, h.dirty = v, true
		}
	}
	if !sameSlice(eps, h.eps) || factor != h.factor || h.dirty {
		if len(h.recurring)*len(eps) <= cheapRounds || now.Sub(h.last) >= 200*h.cost {
			h.assign(eps, factor, now)
		}
	}
	first, _, _ := choice(key, eps, 0, false)
	if branch {
		return first, v, true
	}
	if a, ok := h.assigned[key]; ok && v.recurring {
		return a, v, true
	}
	if alone && v.at != 0 && slices.ContainsFunc(eps, func(e *discovery.Endpoint) bool { return e.ID == v.at }) {
		return v.at, v, true
	}
	return h.place(key, first, eps, factor, t), v, true
}

// sight counts a request of key at now (unix seconds): a key seen before
// recurs (a branch's never joins the assignment), a new one is recorded.
// h.mu is held.
func (h *homes) sight(key uint64, branch bool, now int64) homeKey {
	v, seen := h.lru.Peek(key)
	changed := !seen || v.seen != now
	if seen && !v.recurring && !branch {
		h.turnRecurring(key, &v)
		changed = true
	}
	if changed {
		v.seen = now
		h.lru.Add(key, v)
	} else {
		h.lru.Get(key) // recency only
	}
	return v
}

// peerSaw counts a router replica's request of key, placed on endpoint at
// (its gossip), as if this router had seen it: replicas that each count
// only their own requests see a key recur up to n times later than one
// router would, and meanwhile disagree on its home. A key seen for the
// first time is placed where the peer placed it (placed), so that
// gossiping replicas, which route as a router alone does (Prefix.decide),
// home it there as its first request's router does, and count it there
// when they place new keys.
func (h *homes) peerSaw(key uint64, branch bool, at uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := h.now().Unix()
	h.expire(now)
	v := h.sight(key, branch, now)
	if !branch && !v.recurring && v.at == 0 {
		h.placeLocked(key, at, false)
	}
}

// family takes the deepest match (in blocks) the index found anywhere for a
// request with prefix key, when it reaches the key (at least minMatch), and
// returns what the key's requests say of it: shared, the depth they have in
// common (the second least deepest match in the last one to two windows of
// familyWindow requests: a request that begins a new branch matches exactly
// the shared part, and one request alone matching less is an accident —
// while picks recorded a new prompt's first block only, until its answer
// began, the request that followed it matched one block, and taken for the
// shared part that gave three replicas' conversations one key, the shared
// prompt's second block), and chained, true when most of its last
// familyRing requests (at least half, of at least four) matched deeper
// than that, at three depths or more, i.e. extended an earlier request of
// their own branch. That is a conversation resending its history under a
// system prompt common to many conversations; the requests of a
// shared-prefix group (questions, documents) each branch off at the shared
// depth and are never extended, so their family is not chained. With see
// unset (/debug/route) nothing is recorded; the answer is as if it were.
func (h *homes) family(key uint64, deepest, minMatch int, see bool) (shared int, chained bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	v, ok := h.lru.Peek(key)
	if !ok { // lookup records a key's first request
		return 0, false
	}
	if deepest >= minMatch {
		d := uint16(min(deepest, math.MaxUint16))
		v.seen = h.now().Unix()
		v.depths[v.next] = d
		v.next = (v.next + 1) % familyRing
		v.filled = min(v.filled+1, familyRing)
		if v.window == familyWindow {
			v.low[0], v.low[1], v.window = v.low[1], lows{}, 0
		}
		v.low[1].add(d)
		v.window++
	}
	if v.filled == 0 {
		return 0, false
	}
	both := v.low[1]
	both.add(v.low[0][0])
	both.add(v.low[0][1])
	shared = int(both.second())
	// deeper: the recent requests that matched deeper than the shared
	// part; at several depths (a conversation's turn matches its own last
	// turn), not all at one (the shared part of another group that begins
	// alike, or of this one when some request matched short of it).
	var deeper, depths int
	var at [familyRing]uint16
	for _, d := range v.depths[:v.filled] {
		if int(d) > shared {
			deeper++
			if !slices.Contains(at[:depths], d) {
				at[depths] = d
				depths++
			}
		}
	}
	// Hysteresis: a family turns chained when half its recent requests
	// extend their branch and stays so until fewer than a quarter do, so
	// that keys do not flip (each flip moves branches).
	switch n := int(v.filled); {
	case n >= 4 && 2*deeper >= n && depths >= 3:
		v.chained = true
	case 4*deeper < n:
		v.chained = false
	}
	if see {
		h.lru.Add(key, v)
	}
	return shared, v.chained
}

// placed records where the request of a key not yet recurring went: at,
// the first time (its endpoint; a router alone homes it there), and
// strayed, when it went elsewhere than its home although the key was cold
// (the home was busy).
func (h *homes) placed(key, at uint64, strayed bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.placeLocked(key, at, strayed)
}

// placeLocked is placed with h.mu held.
func (h *homes) placeLocked(key, at uint64, strayed bool) {
	v, ok := h.lru.Peek(key)
	if !ok || v.recurring || (v.at != 0 && (v.strayed || !strayed)) {
		return
	}
	v.strayed = v.strayed || strayed
	if v.at == 0 {
		v.at = at
		h.once[at]++
		h.onceTotal++
	}
	h.lru.Add(key, v)
}

// export yields up to n keys, most recently used first, each with the
// endpoint it is homed on (a recurring key's assigned home, else where its
// first request went; keys with neither are left out), whether it recurs,
// and its age in seconds: a joining replica's state (adopt). It lists the
// keys, then reads them exportChunk at a time, so that a request waits for
// its lock 2–3 ms at most with a full table (65,536 keys; the list), where
// reading them all at once held it 6 ms; a key gone meanwhile is left out.
func (h *homes) export(n int, yield func(key, at uint64, recurring bool, age uint32)) {
	h.mu.Lock()
	now := h.now().Unix()
	h.expire(now)
	keys := h.lru.Keys() // oldest first
	h.mu.Unlock()
	for end := len(keys); end > 0 && n > 0; end -= exportChunk {
		h.mu.Lock()
		for i := end - 1; i >= max(end-exportChunk, 0) && n > 0; i-- {
			v, ok := h.lru.Peek(keys[i])
			at := v.at
			if a, assigned := h.assigned[keys[i]]; assigned && v.recurring {
				at = a
			}
			if !ok || at == 0 {
				continue
			}
			yield(keys[i], at, v.recurring, uint32(min(max(now-v.seen, 0), math.MaxUint32)))
			n--
		}
		h.mu.Unlock()
	}
}

// exportChunk is how many keys export reads per hold of the lock.
const exportChunk = 2048

// adopt records a peer's key homed on endpoint at (export), last seen age
// seconds ago, unless this router knows the key or it has expired; it
// reports whether it did. A recurring key is homed there by the next
// assignment while it has room (keepHomes), as its peers home it; a key
// seen once counts there as if this router had placed it. A replica that
// joins so sends a prompt its index does not show warm (the peers'
// indexes forgot it, or their state left it out) where the fleet has kept
// it, instead of placing it by its own, empty counts.
func (h *homes) adopt(key, at uint64, recurring bool, age uint32) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := h.now().Unix()
	if _, ok := h.lru.Peek(key); ok || at == 0 || h.ttl > 0 && time.Duration(age)*time.Second > h.ttl {
		return false
	}
	v := homeKey{seen: now - int64(age)}
	if !recurring {
		h.lru.Add(key, v)
		h.placeLocked(key, at, false)
		return true
	}
	h.turnRecurring(key, &v)
	v.at = at
	h.lru.Add(key, v)
	return true
}

// recur makes key recurring (an engine reported it cached: it was seen
// before, by this router or another), through turnRecurring as sight
// does: a key seen once leaves the count of the endpoint its request went
// to. Counted there and among the recurring keys too, it was one key more
// in every bound, and stayed so after it expired. (Stock Ollama servers,
// whose answers' TTFTs made a key recurring after its first request: eight
// prompt groups went 3-2-2-1 on four servers, the bound of 8 keys having
// risen to three.)
func (h *homes) recur(key uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	v, _ := h.lru.Peek(key)
	if v.recurring {
		return
	}
	if v.seen == 0 {
		v.seen = h.now().Unix()
	}
	h.turnRecurring(key, &v)
	h.lru.Add(key, v)
}

// turnRecurring makes key (its value v, stored by the caller) one of the
// recurring keys and takes it off the seen-once count of the endpoint its
// first request went to. h.mu is held.
func (h *homes) turnRecurring(key uint64, v *homeKey) {
	h.uncount(*v)
	v.recurring = true
	h.recurring[key] = struct{}{}
	h.dirty = true
}

// place returns the home of a key that the assignment does not place (seen
// once, or recurring since the last assignment), whose rendezvous winner is
// first. Among replicas, it is where the assignment would put it if it
// recurred, so that it keeps its home if it does: its winner accepts it in
// the first round when fewer than the bound of that round's proposals to
// it score higher; otherwise it goes to its first choice that the
// assignment left below the bound (later rounds are not rerun: a close
// guess). A router alone counts the live keys seen once as well, where
// their first requests went: the key goes to its first choice below the
// bound of all of them (bounded-load rendezvous), and stays there.
func (h *homes) place(key, first uint64, eps []*discovery.Endpoint, factor float64, t turn) uint64 {
	if h.alone {
		return h.placeAlone(key, eps, t)
	}
	if len(h.recurring) == 0 {
		return first
	}
	total := len(h.recurring)
	if _, ok := h.recurring[key]; !ok {
		total++
	}
	bound := homeBound(factor, total, len(eps))
	boundAt := func(e uint64) int {
		if b, ok := h.bound[e]; ok {
			return min(b, bound)
		}
		return bound
	}
	s := rendezvous(key, first)
	if higher, _ := slices.BinarySearchFunc(h.proposals[first], s, descending); higher < boundAt(first) {
		return first
	}
	for e, ok := first, true; ok; e, s, ok = choice(key, eps, s, true) {
		if h.load[e] < boundAt(e) {
			return e
		}
	}
	return first
}

// placeAlone is place for a router alone: the key's first choice whose
// live keys (homed recurring ones and those seen once) are below its share
// (bounds at LoadFactor 1, over all of them and this one); the winner when
// none is. A gossiping replica's choices are in its turn (t), so that
// replicas placing one new key at once place it apart.
func (h *homes) placeAlone(key uint64, eps []*discovery.Endpoint, t turn) uint64 {
	total := len(h.recurring) + h.onceTotal + 1
	h.placeBound = h.boundsInto(h.placeBound, 1, total, eps)
	if e := t.first(key, eps, func(id uint64) bool { return h.load[id]+h.once[id] < h.placeBound[id] }); e != 0 {
		return e
	}
	return t.first(key, eps, nil)
}

// hasRoom reports whether endpoint id homes fewer live keys than its bound
// at the last placement of a new key (placeAlone): a router alone places
// a new key nowhere else.
func (h *homes) hasRoom(id uint64) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	b, ok := h.placeBound[id]
	return !ok || h.load[id]+h.once[id] < b
}

// bounds returns how many of total recurring keys each endpoint of eps may
// home: LoadFactor × the mean (homeBound), and no more than its engine is
// learned to keep warm (kept). When the capped endpoints leave keys over,
// the others' bound rises until they hold every key (keys go where they
// stay cached); when the fleet cannot keep them all, they are spread as
// evenly as they can be (the mean, rounded up), so that no engine thrashes
// more of them than another.
func (h *homes) bounds(factor float64, total int, eps []*discovery.Endpoint) map[uint64]int {
	return h.boundsInto(make(map[uint64]int, len(eps)), factor, total, eps)
}

// boundsInto is bounds, written into out (cleared; allocated when nil).
func (h *homes) boundsInto(out map[uint64]int, factor float64, total int, eps []*discovery.Endpoint) map[uint64]int {
	if out == nil {
		out = make(map[uint64]int, len(eps))
	}
	clear(out)
	caps := h.caps[:0]
	for _, e := range eps {
		n := 0
		if h.kept != nil {
			n = h.kept(e.ID)
		}
		caps = append(caps, n)
	}
	h.caps = caps
	capped := func(i, b int) int {
		if caps[i] > 0 && caps[i] < b {
			return caps[i]
		}
		return b
	}
	room := func(b int) (n int) {
		for i := range caps {
			n += capped(i, b)
		}
		return n
	}
	// The least bound from LoadFactor × the mean up whose room holds every
	// key (room grows with the bound: a binary search), if any does.
	lo, hi := homeBound(factor, total, len(eps)), max(total, 1)
	if lo < hi && room(hi) >= total {
		for lo < hi {
			if mid := (lo + hi) / 2; room(mid) >= total {
				hi = mid
			} else {
				lo = mid + 1
			}
		}
	}
	if lo <= max(total, 1) && room(lo) >= total {
		for i, e := range eps {
			out[e.ID] = capped(i, lo)
		}
		return out
	}
	even := homeBound(1, total, len(eps))
	for _, e := range eps {
		out[e.ID] = even
	}
	return out
}

func descending(a, b uint64) int { return cmp.Compare(b, a) }

// byEndpoint orders proposals by endpoint, the highest scores first.
func byEndpoint(a, b proposal) int {
	if c := cmp.Compare(a.endpoint, b.endpoint); c != 0 {
		return c
	}
	return descending(a.score, b.score)
}

func sameSlice(a, b []*discovery.Endpoint) bool {
	return len(a) == len(b) && (len(a) == 0 || &a[0] == &b[0])
}

// assign recomputes the homes of the recurring keys over eps, in rounds: in
// round r every unplaced key proposes to its r-th rendezvous choice, and
// each endpoint accepts the highest-scoring proposals while it homes fewer
// than the bound. It keeps each endpoint's first-round proposals (their
// scores, highest first) for place. A router alone first keeps every key where
// it is (keepHomes); only the keys it cannot keep go through the rounds.
func (h *homes) assign(eps []*discovery.Endpoint, factor float64, now time.Time) {
	start := time.Now()
	prev := h.assigned
	h.assigned = make(map[uint64]uint64, len(h.recurring))
	h.load = make(map[uint64]int, len(eps))
	h.proposals = make(map[uint64][]uint64, len(eps))
	pending := h.pending[:0]
	for k := range h.recurring {
		pending = append(pending, proposal{key: k})
	}
	h.bound = h.bounds(factor, len(pending), eps)
	if h.alone {
		pending = h.keepHomes(pending, prev, eps, factor)
	}
	for round := 0; len(pending) > 0; round++ {
		n := 0
		for _, p := range pending {
			// The key's next choice; none left cannot happen while the
			// bound × endpoints covers the keys.
			var ok bool
			if p.endpoint, p.score, ok = choice(p.key, eps, p.score, round > 0); ok {
				pending[n] = p
				n++
			}
		}
		pending = pending[:n]
		slices.SortFunc(pending, byEndpoint)
		rejected := pending[:0]
		for _, p := range pending {
			if round == 0 {
				h.proposals[p.endpoint] = append(h.proposals[p.endpoint], p.score)
			}
			if h.load[p.endpoint] >= h.bound[p.endpoint] {
				rejected = append(rejected, p)
				continue
			}
			h.load[p.endpoint]++
			h.assigned[p.key] = p.endpoint
		}
		pending = rejected
	}
	h.pending = pending[:0]
	h.eps, h.factor, h.dirty = eps, factor, false
	h.last, h.cost = now, time.Since(start)
}

// keepHomes assigns the recurring keys of pending to where they are homed
// (prev, the last assignment; else where their first request went) while
// that endpoint of eps is below its bound, the highest rendezvous scores
// first, and returns the keys left, to be assigned in rounds. The bound
// that keeps a key is at least LoadFactor × the mean of the live keys,
// recurring and seen once (homeBound; placeAlone placed them under the
// mean, so this is slack), whatever its engine is learned to keep: a count
// that fell bounds where new keys go, and moves none. (Bounded by the
// recurring keys alone, two keys placed on one endpoint that recurred first
// were one too many: one was homed elsewhere while it stayed cached where it
// was, that endpoint looked emptier than it was, and the next new key went
// there too: of eight prompt groups on four llama.cpp servers, three on one and
// one on another.) (On Ollama servers with four slots, where requests
// sharing a slot's prompt at once push each other's prompts out, counts
// learned from those misses rose and fell, and every change moved homes:
// 53 of 96 requests missed, against 19 for a client sending group g to
// server g.)
func (h *homes) keepHomes(pending []proposal, prev map[uint64]uint64, eps []*discovery.Endpoint, factor float64) []proposal {
	keep := homeBound(factor, len(pending)+h.onceTotal, len(eps))
	in := make(map[uint64]bool, len(eps))
	for _, e := range eps {
		in[e.ID] = true
	}
	for i, p := range pending {
		at, ok := prev[p.key]
		if !ok {
			v, _ := h.lru.Peek(p.key)
			at = v.at
		}
		if in[at] {
			pending[i] = proposal{key: p.key, endpoint: at, score: rendezvous(p.key, at)}
		}
	}
	slices.SortFunc(pending, byEndpoint)
	left := pending[:0]
	for _, p := range pending {
		if p.endpoint == 0 || h.load[p.endpoint] >= max(keep, h.bound[p.endpoint]) {
			left = append(left, proposal{key: p.key})
			continue
		}
		h.load[p.endpoint]++
		h.assigned[p.key] = p.endpoint
	}
	return left
}

// choice returns the endpoint of eps with the highest rendezvous score for
// key below the score of the previous choice (limited; the first choice
// when not), and that score; ok is false when there is none.
func choice(key uint64, eps []*discovery.Endpoint, prev uint64, limited bool) (id, score uint64, ok bool) {
	for _, e := range eps {
		s := rendezvous(key, e.ID)
		if (!limited || s < prev) && (!ok || s > score) {
			id, score, ok = e.ID, s, true
		}
	}
	return id, score, ok
}

// rendezvous is the highest-random-weight score of endpoint id for key
// (SplitMix64's finaliser over their combination): the same everywhere, so
// independent router replicas agree.
func rendezvous(key, id uint64) uint64 {
	return prefix.Mix64(key ^ (id * 0x9e3779b97f4a7c15))
}

// len returns how many keys recur.
func (h *homes) len() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.recurring)
}

// expire drops keys unseen for longer than the TTL, oldest first: the LRU's
// order is the order of last use, so it stops at the first live key.
func (h *homes) expire(now int64) {
	if h.ttl <= 0 {
		return
	}
	for {
		_, v, ok := h.lru.GetOldest()
		if !ok || time.Duration(now-v.seen)*time.Second <= h.ttl {
			return
		}
		h.lru.RemoveOldest()
	}
}

// forget drops the keys homed on endpoint, and those seen once that went
// there (it left the set, or its engine restarted with an empty cache);
// they are homed afresh when seen again.
func (h *homes) forget(endpoint uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for k, e := range h.assigned {
		if e == endpoint {
			h.lru.Remove(k)
			delete(h.assigned, k)
		}
	}
	if h.once[endpoint] == 0 {
		return
	}
	for _, k := range h.lru.Keys() {
		if v, _ := h.lru.Peek(k); !v.recurring && v.at == endpoint {
			h.lru.Remove(k)
		}
	}
}

// homeBound is how many recurring keys an endpoint may home: LoadFactor ×
// the mean, with total keys over n endpoints, to the nearest whole key, and
// at least the mean rounded up (so that the endpoints hold every key). The
// slack is a whole key or none: rounding LoadFactor × the mean up gave a
// fleet of four endpoints and four keys a bound of two, and two keys shared
// an endpoint while another had none.
func homeBound(factor float64, total, n int) int {
	mean := float64(total) / float64(max(n, 1))
	return max(int(math.Ceil(mean)), int(math.Floor(factor*mean+0.5)))
}
