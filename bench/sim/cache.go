package sim

import (
	"encoding/binary"

	"github.com/hashicorp/golang-lru/v2/simplelru"
	"github.com/zeebo/xxh3"
)

// blockCache is the KV block pool with vLLM-style automatic prefix caching:
// every block is either referenced (ref > 0: used by a running sequence or a
// prefill hold, pinned) or free; free blocks sit in one LRU queue and keep
// their content hash until they are reallocated, so a later request can hit
// them. Allocation takes the least recently freed block and evicts its hash.
// With ev set it records a BlockRemoved when it evicts a hash (the caller
// records BlockStored, knowing the chain and the tokens); with cpu set it
// has a CPU tier behind it. Not safe for concurrent use: only the engine
// goroutine touches it.
type blockCache struct {
	blocks     []cblock
	byHash     map[uint64]int32
	head, tail int32 // free queue; head is evicted/allocated first; -1 = empty
	free       int   // blocks with ref == 0
	evictions  uint64
	ev         *kvEvents // nil: KV events off
	cpu        *cpuTier  // nil: no CPU tier
}

type cblock struct {
	hash       uint64
	hashed     bool
	ref        int32
	prev, next int32 // free-queue links, -1 = none
}

const noBlock = -1

func newBlockCache(n int) *blockCache {
	c := &blockCache{blocks: make([]cblock, n), byHash: make(map[uint64]int32, n), head: noBlock, tail: noBlock}
	for i := range c.blocks {
		c.blocks[i].prev, c.blocks[i].next = noBlock, noBlock
		c.pushTail(int32(i))
	}
	c.free = n
	return c
}

func (c *blockCache) used() int { return len(c.blocks) - c.free }

func (c *blockCache) pushTail(i int32) {
	b := &c.blocks[i]
	b.prev, b.next = c.tail, noBlock
	if c.tail != noBlock {
		c.blocks[c.tail].next = i
	} else {
		c.head = i
	}
	c.tail = i
}

func (c *blockCache) unlink(i int32) {
	b := &c.blocks[i]
	if b.prev != noBlock {
		c.blocks[b.prev].next = b.next
	} else {
		c.head = b.next
	}
	if b.next != noBlock {
		c.blocks[b.next].prev = b.prev
	} else {
		c.tail = b.prev
	}
	b.prev, b.next = noBlock, noBlock
}

// lookup returns the block holding content hash h.
func (c *blockCache) lookup(h uint64) (int32, bool) {
	i, ok := c.byHash[h]
	return i, ok
}

// acquire adds a reference to block i, taking it off the free queue.
func (c *blockCache) acquire(i int32) {
	b := &c.blocks[i]
	if b.ref == 0 {
		c.unlink(i)
		c.free--
	}
	b.ref++
}

// release drops a reference; an unreferenced block becomes the most recently
// used free block (its hash stays findable until it is reallocated).
func (c *blockCache) release(i int32) {
	b := &c.blocks[i]
	b.ref--
	if b.ref == 0 {
		c.pushTail(i)
		c.free++
	}
}

// releaseAll releases blocks in reverse order, so a sequence's tail blocks
// are evicted before its head blocks (as vLLM does).
func (c *blockCache) releaseAll(ids []int32) {
	for k := len(ids) - 1; k >= 0; k-- {
		c.release(ids[k])
	}
}

// alloc takes the least recently used free block, evicting its hash. The
// caller must have checked c.free > 0.
func (c *blockCache) alloc() int32 {
	i := c.head
	c.unlink(i)
	c.free--
	b := &c.blocks[i]
	if b.hashed {
		if j, ok := c.byHash[b.hash]; ok && j == i {
			delete(c.byHash, b.hash)
		}
		b.hashed = false
		c.evictions++
		if c.ev != nil {
			c.ev.removed(b.hash, mediumGPU)
		}
	}
	b.ref = 1
	return i
}

// register records that block i holds content hash h and reports whether
// it does now. If another block already holds h (two sequences computed
// the same prefix at once) the first one stays canonical and i stays
// anonymous (false): only canonical hashes are announced as stored.
func (c *blockCache) register(i int32, h uint64) bool {
	if _, ok := c.byHash[h]; ok {
		return false
	}
	c.byHash[h] = i
	c.blocks[i].hash, c.blocks[i].hashed = h, true
	return true
}

// reset empties the prefix cache, as vLLM's reset_prefix_cache: every
// hash is forgotten, including those of blocks in use (their sequences
// go on; their blocks are no longer found), and the CPU tier is emptied.
// It records one AllBlocksCleared.
func (c *blockCache) reset() {
	for i := range c.blocks {
		c.blocks[i].hashed = false
	}
	clear(c.byHash)
	if c.cpu != nil {
		c.cpu.reset()
	}
	if c.ev != nil {
		c.ev.cleared()
	}
}

// cpuTier is a CPU copy of KV blocks by content hash with the semantics of
// vLLM's OffloadingConnector with its LRU manager (vllm/v1/kv_offload,
// --kv-offloading-size): every block that becomes full and computed on
// the GPU is also stored in CPU memory (write-through, asynchronous in
// vLLM, so free here), the least recently used block is evicted when the
// tier is full, and a request whose prefix misses on the GPU loads the
// blocks that follow from the CPU instead of computing them. With ev set
// it records a BlockStored (medium CPU, no parent, no tokens, as the
// connector announces them) for stored blocks and a BlockRemoved (medium
// CPU) for evicted ones. Engine goroutine only.
type cpuTier struct {
	size int
	lru  *simplelru.LRU[uint64, struct{}]
	ev   *kvEvents
	run  int // index in ev.list of the BlockStored being filled, -1: none
}

func newCPUTier(blocks int, ev *kvEvents) *cpuTier {
	t := &cpuTier{size: blocks, ev: ev, run: -1}
	t.reset()
	return t
}

// reset empties the tier without recording removals.
func (t *cpuTier) reset() {
	t.lru, _ = simplelru.NewLRU[uint64, struct{}](t.size, t.evicted)
}

func (t *cpuTier) evicted(h uint64, _ struct{}) {
	if t.ev != nil {
		t.run = -1 // stores after this removal go in a new event
		t.ev.removed(h, mediumCPU)
	}
}

// lookup reports whether the tier holds h, making it the most recently used.
func (t *cpuTier) lookup(h uint64) bool {
	_, ok := t.lru.Get(h)
	return ok
}

// store offloads the blocks of hashes (a run of one sequence's newly
// computed blocks) and returns how many were not in the tier already; those
// it had are made most recently used. As vLLM's LRU manager prepares a
// store, it evicts room for the new blocks first (a BlockRemoved each),
// then records one BlockStored of them.
func (t *cpuTier) store(hashes []uint64) (stored int) {
	for _, h := range hashes {
		if !t.lookup(h) {
			stored++
		}
	}
	if stored == 0 {
		return 0
	}
	for over := t.lru.Len() + stored - t.size; over > 0; over-- {
		t.lru.RemoveOldest()
	}
	t.run = -1
	for _, h := range hashes {
		if t.lru.Contains(h) {
			continue
		}
		t.lru.Add(h, struct{}{}) // evicts only when the run outgrows the tier
		if t.ev == nil {
			continue
		}
		if t.run < 0 {
			t.run = t.ev.stored(kvEvent{medium: mediumCPU})
		}
		t.ev.list[t.run].hashes = append(t.ev.list[t.run].hashes, h)
	}
	return stored
}

// hasher computes chained block hashes: key(i) = xxh3(key(i-1) ‖ tokens of
// block i), as vLLM's prefix caching chains block hashes. Not safe for
// concurrent use.
type hasher struct{ buf []byte }

func (h *hasher) block(parent uint64, toks []uint32) uint64 {
	b := h.buf[:0]
	b = binary.LittleEndian.AppendUint64(b, parent)
	for _, t := range toks {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	h.buf = b
	return xxh3.Hash(b)
}

// rootHash is the parent of a sequence's first block: requests with
// different cache_salt values never share blocks.
func rootHash(salt string) uint64 { return xxh3.HashString("kvsim-root\x00" + salt) }
