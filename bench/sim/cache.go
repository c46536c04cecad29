package sim

import (
	"encoding/binary"

	"github.com/zeebo/xxh3"
)

// blockCache is the KV block pool with vLLM-style automatic prefix caching:
// every block is either referenced (ref > 0: used by a running sequence or a
// prefill hold, pinned) or free; free blocks sit in one LRU queue and keep
// their content hash until they are reallocated, so a later request can hit
// them. Allocation takes the least recently freed block and evicts its hash.
// Not safe for concurrent use: only the engine goroutine touches it.
type blockCache struct {
	blocks     []cblock
	byHash     map[uint64]int32
	head, tail int32 // free queue; head is evicted/allocated first; -1 = empty
	free       int   // blocks with ref == 0
	evictions  uint64
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
	}
	b.ref = 1
	return i
}

// register records that block i holds content hash h. If another block
// already holds h (two sequences computed the same prefix at once) the
// first one stays canonical and i stays anonymous.
func (c *blockCache) register(i int32, h uint64) {
	if _, ok := c.byHash[h]; ok {
		return
	}
	c.byHash[h] = i
	c.blocks[i].hash, c.blocks[i].hashed = h, true
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
