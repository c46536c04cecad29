package routing

import (
	"math"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"

	"github.com/kvroute/kvroute/discovery"
)

// homes assigns every prefix key (the hash of the block at depth
// MinMatchBlocks) one home endpoint, the first time the key is seen, and
// remembers it apart from the cache model: the index forgets blocks when it
// believes the engine evicted them, but a prefix that comes back returns to
// its home rather than to whichever endpoint is least loaded at that moment.
//
// The assignment is consistent hashing with bounded loads (Mirrokni, Thorup,
// Zadimoghaddam, 2018) on rendezvous order: the key goes to the endpoint with
// the highest rendezvous score among those holding fewer than
// ⌈LoadFactor × (homes + 1) / endpoints⌉ homes. Plain rendezvous hashing
// spreads 64 prefixes over 8 endpoints as unevenly as 4 to 13 (binomial), and
// an endpoint homing 13 long prefixes cannot cache them and still run its
// batch; the bound keeps every endpoint within LoadFactor of the mean, like
// SGLang's "smallest tree" choice, while independent router replicas, whose
// counts are alike when each sees a random share of the traffic, still mostly
// agree (each picks the rendezvous winner unless it is at the bound).
//
// Keys live in an LRU (golang-lru's simplelru) of bounded size and expire
// after the index's TTL, so one-off prompts do not weigh on the counts
// forever. Safe for concurrent use.
type homes struct {
	mu    sync.Mutex
	lru   *simplelru.LRU[uint64, home]
	count map[uint64]int // live homes per endpoint
	ttl   time.Duration
	now   func() time.Time
}

type home struct {
	endpoint uint64
	seen     int64 // unix seconds of the last request with the key
}

// maxHomes bounds the table: 65,536 keys ≈ 7.6 MB (115 bytes a key,
// measured). A fleet serving more live distinct prefixes than that in one
// TTL gains little from balancing their homes individually; the least
// recently used keys are dropped first.
const maxHomes = 1 << 16

func newHomes(ttl time.Duration, now func() time.Time) *homes {
	h := &homes{count: make(map[uint64]int), ttl: ttl, now: now}
	h.lru, _ = simplelru.NewLRU(maxHomes, func(_ uint64, v home) { h.drop(v.endpoint) })
	return h
}

func (h *homes) drop(endpoint uint64) {
	if n := h.count[endpoint] - 1; n > 0 {
		h.count[endpoint] = n
	} else {
		delete(h.count, endpoint)
	}
}

// lookup returns key's home, refreshing its recency when touch is set,
// and ok false when the key has none (or it expired).
func (h *homes) lookup(key uint64, touch bool) (endpoint uint64, ok bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := h.now().Unix()
	h.expire(now)
	if !touch {
		v, ok := h.lru.Peek(key)
		return v.endpoint, ok
	}
	v, ok := h.lru.Get(key)
	if ok && v.seen != now {
		v.seen = now
		h.lru.Add(key, v)
	}
	return v.endpoint, ok
}

// choose returns the home a new key would get among the usable endpoints
// of eps: the highest rendezvous score among those homing fewer than
// homeBound; ok false if none qualifies. It assigns nothing.
func (h *homes) choose(key uint64, eps []*discovery.Endpoint, r *Request, factor float64) (endpoint uint64, ok bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	bound := homeBound(factor, h.lru.Len(), len(eps))
	var best uint64
	for _, e := range eps {
		if !usable(r, e) || h.count[e.ID] >= bound {
			continue
		}
		if score := rendezvous(key, e.ID); !ok || score > best {
			endpoint, best, ok = e.ID, score, true
		}
	}
	return endpoint, ok
}

// len returns how many keys have a home.
func (h *homes) len() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.lru.Len()
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

// assign makes endpoint key's home unless the key already has one (a
// concurrent request assigned it first).
func (h *homes) assign(key, endpoint uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.lru.Contains(key) {
		return
	}
	h.lru.Add(key, home{endpoint: endpoint, seen: h.now().Unix()})
	h.count[endpoint]++
}

// forget drops every home on endpoint (it left the set, or its engine
// restarted with an empty cache); its keys are assigned afresh.
func (h *homes) forget(endpoint uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.count[endpoint] == 0 {
		return
	}
	for _, k := range h.lru.Keys() {
		if v, ok := h.lru.Peek(k); ok && v.endpoint == endpoint {
			h.lru.Remove(k) // the eviction callback decrements the count
		}
	}
}

// bound is the most homes an endpoint may hold for it to take one more,
// with total homes over n endpoints.
func homeBound(factor float64, total, n int) int {
	return int(math.Ceil(factor * float64(total+1) / float64(max(n, 1))))
}
