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
}

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
