package prefix

import (
	"github.com/zeebo/xxh3"
)

// Seed returns the hash chain's seed for a model and a cache salt. Requests
// with a different model or salt never share a block hash, as engines never
// share KV blocks across them.
func Seed(model, cacheSalt string) uint64 {
	return xxh3.HashStringSeed(cacheSalt, xxh3.HashString(model))
}

// Hasher cuts a byte stream into fixed-size blocks and hashes them as a
// chain: block i's hash covers its bytes and block i-1's hash (the seed for
// block 0), so equal hashes at position i imply equal bytes up to the end of
// block i. A trailing partial block is not hashed, as engines cache only full
// blocks. Bytes beyond MaxBlocks full blocks are counted but not hashed.
//
// A Hasher is not safe for concurrent use. The zero value is not usable; call
// Reset before each stream. Hashes is reused across Resets.
type Hasher struct {
	blockSize int
	maxBlocks int
	prev      uint64
	partial   []byte // bytes of the current incomplete block, cap blockSize
	total     int    // bytes written since Reset
	// Hashes holds the chained hashes of the full blocks written so far.
	Hashes []uint64
	// Marks holds the last MaxMarks marks (Mark), earliest first.
	Marks []Mark
}

// A Mark is a point of the rendering where a later prompt may continue
// this one: the end of a chat message, or of the prompt. Hash covers every
// byte written before it (the full blocks' chain and the partial block's
// bytes), so a later prompt that extends this one through that point has a
// mark of the same Hash, whatever the block boundaries; Bytes is its
// offset.
type Mark struct {
	Hash  uint64
	Bytes int
}

// MaxMarks bounds the marks kept per stream: the last ones, where a
// conversation's previous turn ended. Each mark hashes the partial block
// before it (at most a block), so a caller that knows where the stream's
// last MaxMarks marks fall marks only those.
const MaxMarks = 16

// markSalt keeps a mark's hash apart from the block hashes.
const markSalt = 0x4d61_726b_5461_696c // "MarkTail"

// Reset prepares h for a new stream with the given block size (bytes, > 0),
// block cap (> 0) and chain seed.
func (h *Hasher) Reset(blockSize, maxBlocks int, seed uint64) {
	h.blockSize = blockSize
	h.maxBlocks = maxBlocks
	h.prev = seed
	if cap(h.partial) < blockSize {
		h.partial = make([]byte, 0, blockSize)
	}
	h.partial = h.partial[:0]
	h.total = 0
	h.Hashes = h.Hashes[:0]
	h.Marks = h.Marks[:0]
}

// Mark records the end of everything written so far (Mark), unless
// nothing was, the last mark is at the same offset, or the stream went past
// MaxBlocks (its bytes there are not kept). Only the last MaxMarks marks
// are kept.
func (h *Hasher) Mark() {
	if h.total == 0 || len(h.Hashes) >= h.maxBlocks || len(h.Marks) > 0 && h.Marks[len(h.Marks)-1].Bytes == h.total {
		return
	}
	if len(h.Marks) == MaxMarks {
		copy(h.Marks, h.Marks[1:])
		h.Marks = h.Marks[:MaxMarks-1]
	}
	h.Marks = append(h.Marks, Mark{Hash: Mix64(h.prev ^ xxh3.Hash(h.partial) ^ markSalt), Bytes: h.total})
}

// Len returns the number of bytes written since Reset.
func (h *Hasher) Len() int { return h.total }

// Write adds p to the stream. It never fails; the signature matches io.Writer.
func (h *Hasher) Write(p []byte) (int, error) {
	n := len(p)
	h.total += n
	if len(h.Hashes) >= h.maxBlocks {
		return n, nil
	}
	if len(h.partial) > 0 {
		k := copy(h.partial[len(h.partial):h.blockSize], p)
		h.partial = h.partial[:len(h.partial)+k]
		p = p[k:]
		if len(h.partial) < h.blockSize {
			return n, nil
		}
		h.push(h.partial)
		h.partial = h.partial[:0]
	}
	for len(p) >= h.blockSize && len(h.Hashes) < h.maxBlocks {
		h.push(p[:h.blockSize])
		p = p[h.blockSize:]
	}
	if len(h.Hashes) < h.maxBlocks {
		h.partial = append(h.partial, p...)
	}
	return n, nil
}

// WriteString is Write for a string, without converting it to a new slice.
func (h *Hasher) WriteString(s string) (int, error) {
	// The bytes are only read, never retained past the call.
	return h.Write(unsafeBytes(s))
}

// push chains one block: the parent's hash and the block's unseeded xxh3
// are combined by a bijective 64-bit mixer (SplitMix64's finaliser).
// Seeding xxh3 with the parent instead costs a 192-byte secret derivation
// per block of more than 240 bytes, which tripled hashing time.
func (h *Hasher) push(block []byte) {
	h.prev = Mix64(h.prev ^ xxh3.Hash(block))
	h.Hashes = append(h.Hashes, h.prev)
}

// Mix64 is SplitMix64's finaliser: a bijective 64-bit mixer whose every
// output bit depends on every input bit.
func Mix64(z uint64) uint64 {
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}
