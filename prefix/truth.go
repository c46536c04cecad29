package prefix

import (
	"encoding/binary"
	"sync"
	"time"

	"github.com/zeebo/xxh3"
)

// Truth is engine truth about the Index: what each endpoint's engine
// announced in its KV-cache events (blocks of tokens stored, removed,
// everything cleared), and the links from those token blocks to the
// Index's blocks of bytes, learned off the request path by asking an engine
// to tokenize a prompt that was forwarded. Through the links a store
// confirms a byte block on the endpoint, a removal drops it and a cleared
// cache empties the endpoint, in the Index the policy already reads: the
// decision stays one mechanism, and no tokenizer runs on the request path.
//
// Token blocks are keyed by kvroute's own chained hash of their token ids
// (TokenHashes), not by the engine's block hash, so neither the engine's
// hash algorithm nor its seed matter; an event's blocks are chained from
// its parent block's key, which the endpoint's earlier store gave. A block
// whose parent is unknown (evicted, or stored before the subscription)
// starts nothing: its key cannot be computed, as a chain broken there
// cannot be matched from its root either.
//
// An endpoint is on engine truth (Live) from its first event until Drop or
// a restart; the Index then takes its evictions from the events
// (Index.SetTruth). All methods are safe for concurrent use. The events'
// mutex is taken after no other lock, and the Index's calls are made with
// it held (the Index's mutex nests inside, never the reverse); the request
// path's NeedsLink takes only a mutex of its own.
type Truth struct {
	index      *Index
	blockBytes int
	maxBlocks  int // bound on the (block, tier) entries of all endpoints
	now        func() time.Time

	mu         sync.Mutex
	eps        map[uint64]*engineView
	blocks     int          // Σ entries over eps
	tokenBlock int          // tokens per engine block (events' block_size)
	links      TwoGen[link] // token key → the byte block it completes or breaks
	stats      TruthStats
	onLinked   func(blocks, tokens []uint64)

	// The request path's side (NeedsLink), apart from the events' mutex so
	// that applying a large batch never holds up a request: linkMu guards
	// linked (the deepest byte block of a chain linked, or that its engine
	// could not tokenize) and pending (chains being tokenized).
	linkMu  sync.Mutex
	linked  TwoGen[bool]
	pending map[uint64]struct{}
}

// TruthConfig configures a Truth.
type TruthConfig struct {
	// BlockBytes is the Index's block size in bytes of rendering.
	BlockBytes int
	// MaxBlocks bounds the token blocks remembered over all endpoints and
	// tiers (an endpoint whose engine announces more than its share is
	// dropped back to learning). Default 4,000,000 (≈ 280 MB).
	MaxBlocks int
	// MaxLinks bounds the token-to-byte links (default 2,000,000).
	MaxLinks int
	// Now is the clock (nil: time.Now).
	Now func() time.Time
}

// TruthStats are a Truth's sizes and counters.
type TruthStats struct {
	Endpoints int       `json:"endpoints"`        // endpoints on engine truth
	Blocks    [3]int    `json:"blocks_by_tier"`   // token blocks held, by tier (GPU, CPU, storage)
	Links     int       `json:"links"`            // token blocks linked to byte blocks
	PeerLinks uint64    `json:"peer_links"`       // links taken from router replicas (PeerLinked)
	Bytes     int       `json:"bytes"`            // estimated heap bytes
	Confirmed uint64    `json:"confirmed"`        // byte blocks confirmed by stores or links
	Dropped   uint64    `json:"dropped"`          // byte-block claims dropped by removals
	Orphans   uint64    `json:"orphan_blocks"`    // stored blocks whose parent was unknown
	Unknown   uint64    `json:"unknown_removals"` // removals of blocks never seen stored
	Cleared   uint64    `json:"cleared"`          // caches cleared (events or restarts)
	Overflows uint64    `json:"overflows"`        // endpoints dropped for exceeding MaxBlocks
	LastEvent time.Time `json:"last_event"`
}

// DefaultTokenBlock is the engine block size (tokens) assumed until an
// event states one: vLLM's default block size.
const DefaultTokenBlock = 16

// engineView is one endpoint's announced blocks.
type engineView struct {
	blocks map[tierHash]heldBlock // (engine hash, tier) → block
	held   map[uint64]uint16      // token key → entries holding it (any tier)
	gpu    map[uint64]uint16      // token key → GPU entries holding it
	last   time.Time              // the last event applied
	stale  bool                   // events stopped (Stale) until the next
}

type tierHash struct {
	hash uint64
	tier uint8
}

type heldBlock struct {
	key  uint64 // kvroute's token key
	refs uint16 // announcements not yet removed
}

// link ties a token block to the byte block whose rendering it ends in:
// end marks the last token block the byte block needs (its store confirms
// the byte block); any of them removed breaks it.
type link struct {
	bytes uint64
	end   bool
}

// NewTruth returns an empty Truth over index.
func NewTruth(index *Index, c TruthConfig) *Truth {
	if c.MaxBlocks <= 0 {
		c.MaxBlocks = 4_000_000
	}
	if c.MaxLinks <= 0 {
		c.MaxLinks = 2_000_000
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return &Truth{index: index, blockBytes: max(1, c.BlockBytes), maxBlocks: c.MaxBlocks, now: c.Now,
		eps: make(map[uint64]*engineView), tokenBlock: DefaultTokenBlock,
		links: NewTwoGen[link](c.MaxLinks, nil), linked: NewTwoGen[bool](c.MaxLinks/4, nil),
		pending: make(map[uint64]struct{})}
}

// TokenRoot is the key a chain of token blocks starts from: per LoRA
// adapter ("" for the base model), as engines key an adapter's blocks
// apart.
func TokenRoot(lora string) uint64 { return xxh3.HashString("kvroute-tokens\x00" + lora) }

// TokenKey chains one block of token ids onto parent's key.
func TokenKey(parent uint64, tokens []uint32) uint64 {
	var buf [64]byte
	h := xxh3.New()
	for len(tokens) > 0 {
		n := min(len(tokens), len(buf)/4)
		for i, t := range tokens[:n] {
			binary.LittleEndian.PutUint32(buf[4*i:], t)
		}
		_, _ = h.Write(buf[:4*n])
		tokens = tokens[n:]
	}
	return Mix64(parent ^ h.Sum64())
}

// Stored applies a BlockStored event of endpoint id: hashes are the
// engine's keys of the blocks, in chain order, tokens their token ids
// (blockSize per block), parent the engine key of the block before the
// first (hasParent false at a chain's root), tier the medium (0 GPU, 1
// CPU, 2 storage). Each stored block that ends a linked byte block
// confirms it on the endpoint.
func (t *Truth) Stored(id uint64, parent uint64, hasParent bool, hashes []uint64, tokens []uint32, blockSize int, lora string, tier uint8) {
	if len(tokens) == 0 && len(hashes) > 0 {
		t.copied(id, hashes, tier)
		return
	}
	if blockSize <= 0 || len(tokens) != len(hashes)*blockSize {
		t.mu.Lock()
		t.stats.Orphans += uint64(len(hashes))
		t.mu.Unlock()
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	v := t.view(id)
	if blockSize != t.tokenBlock {
		// Links were cut for another block size: they no longer line up.
		t.tokenBlock = blockSize
		t.links.Reset()
		t.linkMu.Lock()
		t.linked.Reset()
		t.linkMu.Unlock()
	}
	key := TokenRoot(lora)
	if hasParent {
		p, ok := t.keyOf(v, parent)
		if !ok {
			t.stats.Orphans += uint64(len(hashes))
			return
		}
		key = p
	}
	for i, h := range hashes {
		key = TokenKey(key, tokens[i*blockSize:(i+1)*blockSize])
		t.hold(id, v, tierHash{hash: h, tier: tier}, key)
	}
	t.overflow(id, v)
}

// copied applies a store without tokens: blocks copied to another tier
// (vLLM's offloading connector announces its CPU copies by the GPU
// blocks' hashes alone). A block the endpoint holds on any tier keeps its
// key; one it does not is an orphan.
func (t *Truth) copied(id uint64, hashes []uint64, tier uint8) {
	t.mu.Lock()
	defer t.mu.Unlock()
	v := t.view(id)
	for _, h := range hashes {
		key, ok := t.keyOf(v, h)
		if !ok {
			t.stats.Orphans++
			continue
		}
		t.hold(id, v, tierHash{hash: h, tier: tier}, key)
	}
	t.overflow(id, v)
}

// hold adds one announcement of block th, whose token key is key, to v,
// and confirms the byte block key ends.
func (t *Truth) hold(id uint64, v *engineView, th tierHash, key uint64) {
	b, ok := v.blocks[th]
	if ok && b.key != key {
		// The engine reused the hash for other tokens: the old block is
		// gone.
		t.release(id, v, th, b, true)
		ok = false
	}
	if !ok {
		b = heldBlock{key: key}
		t.blocks++
		t.stats.Blocks[min(th.tier, 2)]++
		v.held[key]++
		if th.tier == 0 {
			v.gpu[key]++
		}
	}
	b.refs++
	v.blocks[th] = b
	if l, ok := t.links.Get(key); ok && l.end {
		t.index.Record(id, []uint64{l.bytes})
		t.index.SetLower(id, l.bytes, v.gpu[key] == 0)
		t.stats.Confirmed++
	}
}

// Removed applies a BlockRemoved event of endpoint id: hashes left tier.
// A block no tier holds any more drops the byte block it was linked to.
func (t *Truth) Removed(id uint64, hashes []uint64, tier uint8) {
	t.mu.Lock()
	defer t.mu.Unlock()
	v := t.view(id)
	for _, h := range hashes {
		th := tierHash{hash: h, tier: tier}
		b, ok := v.blocks[th]
		if !ok {
			t.stats.Unknown++
			continue
		}
		t.release(id, v, th, b, false)
	}
}

// Cleared applies AllBlocksCleared, or an engine restart: endpoint id
// holds nothing, in the engine's view and in the Index's.
func (t *Truth) Cleared(id uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	v := t.view(id)
	t.clearView(v)
	t.index.Forget(id)
	t.index.SetTruth(id, true)
	t.stats.Cleared++
}

// Drop ends engine truth for endpoint id (its events stopped, went stale,
// or a gap could not be replayed): what it announced is forgotten and the
// Index learns the endpoint again from the router's own history.
func (t *Truth) Drop(id uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if v, ok := t.eps[id]; ok {
		t.clearView(v)
		delete(t.eps, id)
	}
	t.index.SetTruth(id, false)
}

// Stale puts endpoint id back on learning while its events have stopped
// (the publisher may be gone while the engine serves): the Index models
// its capacity again. What it announced is kept, and its next event puts
// it back on engine truth.
func (t *Truth) Stale(id uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if v, ok := t.eps[id]; ok && !v.stale {
		v.stale = true
		t.index.SetTruth(id, false)
	}
}

// Live reports whether endpoint id is on engine truth, and when its last
// event was applied (the zero time when it never had one, or was
// dropped).
func (t *Truth) Live(id uint64) (bool, time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	v, ok := t.eps[id]
	if !ok {
		return false, time.Time{}
	}
	return !v.stale, v.last
}

// NeedsLink reports whether the chain hashes (a prompt's byte blocks)
// should be tokenized: its deepest block is not linked, and no
// tokenization of it is under way. (It does not wait for an endpoint to be
// on engine truth: the first request's answer may come before its
// engine's events do.) A true answer marks it under way until
// Link or Unlinked.
func (t *Truth) NeedsLink(hashes []uint64) bool {
	if len(hashes) == 0 {
		return false
	}
	deepest := hashes[len(hashes)-1]
	t.linkMu.Lock()
	defer t.linkMu.Unlock()
	if _, ok := t.linked.Get(deepest); ok {
		return false
	}
	if _, ok := t.pending[deepest]; ok || len(t.pending) >= maxPendingLinks {
		return false
	}
	t.pending[deepest] = struct{}{}
	return true
}

// maxPendingLinks bounds the chains being tokenized at once (the
// tokenizer's queue drops the rest; they are asked again when they recur).
const maxPendingLinks = 1024

// Unlinked ends a tokenization of hashes that did not happen. With retry
// (it was never sent: a full queue, a shutdown) the chain may be asked for
// again at once; without (the engine failed it) not until it is forgotten
// like a linked chain, so that an engine that cannot tokenize is not asked
// for the same prompt on every request.
func (t *Truth) Unlinked(hashes []uint64, retry bool) {
	if len(hashes) == 0 {
		return
	}
	deepest := hashes[len(hashes)-1]
	t.linkMu.Lock()
	defer t.linkMu.Unlock()
	delete(t.pending, deepest)
	if !retry {
		t.linked.Put(deepest, false)
	}
}

// Link learns how the byte blocks hashes of a prompt whose rendering is
// promptBytes long line up with the engine's tokens of it (for the LoRA
// adapter lora, "" for the base model), and confirms every byte block the
// endpoints' engines already hold. Byte block i ends at byte
// (i+1)·BlockBytes, placed among the tokens in proportion (the engine's
// rendering, chat template included, and the Index's differ by a few
// tokens at most, a small part of a block of bytes); it is linked to the
// token blocks from the one after the previous byte block's end to the
// last token block wholly before its own end. The ends it did not know
// go to OnLinked's function.
func (t *Truth) Link(lora string, hashes []uint64, promptBytes int, tokens []uint32) {
	if len(hashes) == 0 {
		return
	}
	t.linkMu.Lock()
	delete(t.pending, hashes[len(hashes)-1])
	t.linkMu.Unlock()
	if promptBytes <= 0 || len(tokens) == 0 {
		return
	}
	t.mu.Lock()
	blocks, ends, f := t.link(lora, hashes, promptBytes, tokens)
	t.mu.Unlock()
	t.linkMu.Lock()
	t.linked.Put(hashes[len(hashes)-1], true)
	t.linkMu.Unlock()
	if f != nil && len(blocks) > 0 {
		f(blocks, ends)
	}
}

// link is Link's work under t.mu: it returns the byte blocks whose end
// was not linked so, with the token keys of their ends, and the function
// to tell them to.
func (t *Truth) link(lora string, hashes []uint64, promptBytes int, tokens []uint32) (blocks, endKeys []uint64, f func(blocks, tokens []uint64)) {
	bs := t.tokenBlock
	nblocks := len(tokens) / bs
	keys := make([]uint64, nblocks)
	key := TokenRoot(lora)
	for j := range keys {
		key = TokenKey(key, tokens[j*bs:(j+1)*bs])
		keys[j] = key
	}
	from := 0 // the first token block of byte block i
	ends := make([]int, 0, len(hashes))
	for i, bh := range hashes {
		endTok := int(int64(i+1) * int64(t.blockBytes) * int64(len(tokens)) / int64(promptBytes))
		end := min(endTok/bs, nblocks) - 1 // the last token block wholly inside
		if end < from {
			break // the byte block ends before a token block does
		}
		if t.onLinked != nil {
			if l, ok := t.links.Get(keys[end]); !ok || l != (link{bytes: bh, end: true}) {
				blocks, endKeys = append(blocks, bh), append(endKeys, keys[end])
			}
		}
		for j := from; j <= end; j++ {
			t.links.Put(keys[j], link{bytes: bh, end: j == end})
		}
		ends = append(ends, end)
		from = end + 1
	}
	// Confirm what the engines already hold, from the chain's root: a
	// byte block is held where every token block up to its end is.
	for id, v := range t.eps {
		var chain []uint64
		j := 0
		for i, end := range ends {
			for ; j <= end && v.held[keys[j]] > 0; j++ {
			}
			if j <= end {
				break
			}
			chain = append(chain, hashes[i])
		}
		if len(chain) > 0 {
			t.index.Record(id, chain)
			t.stats.Confirmed += uint64(len(chain))
			for i := range chain {
				if v.gpu[keys[ends[i]]] == 0 {
					t.index.SetLower(id, chain[i], true)
				}
			}
		}
	}
	return blocks, endKeys, t.onLinked
}

// OnLinked sets f to be told the links Link learns: byte blocks and the
// token keys of their last token blocks (parallel slices, valid only
// during the call), each one that this Truth did not link so before. The
// router replicas' gossip sends them to the other replicas (PeerLinked).
func (t *Truth) OnLinked(f func(blocks, tokens []uint64)) {
	t.mu.Lock()
	t.onLinked = f
	t.mu.Unlock()
}

// PeerLinked takes links a router replica learned (its OnLinked): byte
// block blocks[i] ends at the token block keyed tokens[i]. A replica
// tokenizes only the prompts it forwards, yet its peers' placements put
// every replica's prompts in its Index: without their links, an engine's
// events could confirm or drop none of those blocks, and a claim of a
// prompt that another replica's request extended and the engine then
// evicted would stay, sending the prompt's next turn to a server that
// recomputes it. With them, this Truth confirms a byte block when its
// last token block is stored and drops it when that block is removed (the
// first of its blocks an engine evicts, as engines evict a chain from its
// tail), and does not tokenize a chain whose deepest block a peer linked.
// A token key this Truth linked itself keeps its own link.
func (t *Truth) PeerLinked(blocks, tokens []uint64) {
	n := min(len(blocks), len(tokens))
	t.mu.Lock()
	for i := range n {
		if _, ok := t.links.Get(tokens[i]); ok {
			continue
		}
		t.links.Put(tokens[i], link{bytes: blocks[i], end: true})
		t.stats.PeerLinks++
		for id, v := range t.eps {
			if v.held[tokens[i]] > 0 {
				t.index.Record(id, blocks[i:i+1])
				t.index.SetLower(id, blocks[i], v.gpu[tokens[i]] == 0)
				t.stats.Confirmed++
			}
		}
	}
	t.mu.Unlock()
	t.linkMu.Lock()
	for _, b := range blocks[:n] {
		t.linked.Put(b, true)
	}
	t.linkMu.Unlock()
}

// Stats returns the Truth's sizes and counters.
func (t *Truth) Stats() TruthStats {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.stats
	s.Endpoints = len(t.eps)
	s.Links = t.links.Len()
	// A map entry of the views ≈ 48 bytes with the map's overhead, a link
	// ≈ 40.
	t.linkMu.Lock()
	s.Bytes = t.blocks*48*2 + s.Links*40 + t.linked.Len()*24
	t.linkMu.Unlock()
	return s
}

// --- internals; t.mu is held ---

func (t *Truth) view(id uint64) *engineView {
	v, ok := t.eps[id]
	now := t.now()
	if !ok {
		v = &engineView{blocks: make(map[tierHash]heldBlock), held: make(map[uint64]uint16), gpu: make(map[uint64]uint16)}
		t.eps[id] = v
		t.index.SetTruth(id, true)
	}
	if v.stale {
		v.stale = false
		t.index.SetTruth(id, true)
	}
	v.last = now
	t.stats.LastEvent = now
	return v
}

// keyOf returns the token key of the engine block hash on any tier.
func (t *Truth) keyOf(v *engineView, hash uint64) (uint64, bool) {
	for tier := uint8(0); tier < 3; tier++ {
		if b, ok := v.blocks[tierHash{hash: hash, tier: tier}]; ok {
			return b.key, true
		}
	}
	return 0, false
}

// release takes one announcement of th off v (all of them when all), and
// drops the byte block linked to its key once no tier holds it.
func (t *Truth) release(id uint64, v *engineView, th tierHash, b heldBlock, all bool) {
	if b.refs > 1 && !all {
		b.refs--
		v.blocks[th] = b
		return
	}
	delete(v.blocks, th)
	t.blocks--
	t.stats.Blocks[min(th.tier, 2)]--
	if th.tier == 0 {
		if v.gpu[b.key]--; v.gpu[b.key] == 0 {
			delete(v.gpu, b.key)
		}
	}
	if v.held[b.key]--; v.held[b.key] > 0 {
		if l, ok := t.links.Get(b.key); ok && l.end && v.gpu[b.key] == 0 {
			// Held on a slower tier only: still cached, but loaded.
			t.index.SetLower(id, l.bytes, true)
		}
		return
	}
	delete(v.held, b.key)
	if l, ok := t.links.Get(b.key); ok {
		t.stats.Dropped += uint64(t.index.Drop(id, l.bytes))
	}
}

func (t *Truth) clearView(v *engineView) {
	for th := range v.blocks {
		t.stats.Blocks[min(th.tier, 2)]--
	}
	t.blocks -= len(v.blocks)
	clear(v.blocks)
	clear(v.held)
	clear(v.gpu)
}

// overflow drops endpoint id back to learning when its engine announced
// more than its share of MaxBlocks (a publisher that never removes).
func (t *Truth) overflow(id uint64, v *engineView) {
	if len(v.blocks) <= t.maxBlocks/max(1, len(t.eps)) {
		return
	}
	t.clearView(v)
	delete(t.eps, id)
	t.index.SetTruth(id, false)
	t.stats.Overflows++
}
