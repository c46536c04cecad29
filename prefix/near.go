package prefix

import (
	"bytes"

	golru "github.com/hashicorp/golang-lru/v2"
	"github.com/zeebo/xxh3"
)

// Near-identical prompts: system prompts that are "the same" but differ in
// a byte-order mark, CRLF against LF line endings, runs of blanks or
// trailing blanks. The engine sees different tokens and recomputes them;
// the router sees different block hashes. The detector hashes a
// normalised rendering of a prompt's first blocks beside the exact one and
// reports a request whose normalised prefix was seen before with other
// bytes.

// Normalizer hashes the normal form of the first blocks of a rendering:
// without byte-order marks and carriage returns, with runs of blanks
// (space, tab) as one space and no blanks before a line end. For each
// normalised block it also keeps a digest of the raw bytes up to the end
// of that block and the raw offset where the block began, so that two
// renderings with the same normal form tell where their bytes first
// differ. Write it the rendering, as a Hasher.
type Normalizer struct {
	h        Hasher
	raw      *xxh3.Hasher
	total    int // raw bytes of the Writes before the current one
	digested int // raw bytes in the raw digest
	start    int // raw offset where the current normalised block began
	room     int // normalised bytes still to put in the current block
	blanks   int // pending blanks (emitted as one space unless a line ends)
	bom      int // bytes of a possible BOM matched so far
	buf      []byte
	// Raw is, per full normalised block, the digest of the raw bytes up
	// to its end; Offsets, the raw offset where it began.
	Raw     []uint64
	Offsets []int
}

// Reset prepares n for a new rendering: blocks of blockSize bytes, at most
// maxBlocks of them, chained from seed.
func (n *Normalizer) Reset(blockSize, maxBlocks int, seed uint64) {
	n.h.Reset(blockSize, maxBlocks, seed)
	if n.raw == nil {
		n.raw = xxh3.New()
	}
	n.raw.Reset()
	n.total, n.digested, n.start, n.blanks, n.bom, n.room = 0, 0, 0, 0, 0, blockSize
	n.Raw, n.Offsets = n.Raw[:0], n.Offsets[:0]
}

// Hashes returns the normalised blocks' chained hashes.
func (n *Normalizer) Hashes() []uint64 { return n.h.Hashes }

// Done reports whether every block the normalizer hashes is complete:
// later bytes change nothing.
func (n *Normalizer) Done() bool { return len(n.h.Hashes) >= n.h.maxBlocks }

var bomBytes = [3]byte{0xEF, 0xBB, 0xBF}

// Write adds raw bytes of the rendering. It never fails.
func (n *Normalizer) Write(p []byte) (int, error) {
	if n.Done() {
		return len(p), nil
	}
	n.buf = n.buf[:0]
	for i := 0; i < len(p); {
		if n.blanks == 0 && n.bom == 0 {
			// The bytes up to the first that normalisation could change
			// (searched for with the vectorised byte searches) pass in
			// bulk, up to the end of the block.
			w := p[i:min(len(p), i+n.room)]
			k := firstSpecial(w)
			if k > 0 {
				n.buf = append(n.buf, w[:k-1]...)
				n.room -= k - 1
				if n.put(w[k-1], p, i+k) {
					return len(p), nil
				}
				i += k
				continue
			}
		}
		if n.special(p[i], p, i) {
			return len(p), nil // the last block is hashed: the rest changes nothing
		}
		i++
	}
	if len(n.buf) > 0 {
		_, _ = n.h.Write(n.buf)
		n.buf = n.buf[:0]
	}
	_, _ = n.raw.Write(p[n.digested-n.total:])
	n.total += len(p)
	n.digested = n.total
	return len(p), nil
}

// firstSpecial returns the length of w's prefix that normalises to
// itself: up to a carriage return, a tab, a byte-order mark's first byte,
// two blanks or a blank before a line end, or a blank that ends w (a line
// end may follow).
func firstSpecial(w []byte) int {
	k := len(w)
	for _, c := range [...]byte{'\r', '\t', bomBytes[0]} {
		if j := bytes.IndexByte(w[:k], c); j >= 0 {
			k = j
		}
	}
	for _, pat := range [...]string{"  ", " \n"} {
		if j := bytes.Index(w[:k], unsafeBytes(pat)); j >= 0 {
			k = j
		}
	}
	if k > 0 && w[k-1] == ' ' {
		k--
	}
	return k
}

// special handles a byte that may be normalised away: a byte of a BOM
// (EF BB BF, dropped; a partial match that fails is emitted as it was), a
// carriage return (dropped), a blank (pending), a line feed (pending
// blanks dropped). It reports whether the normaliser is done.
func (n *Normalizer) special(c byte, p []byte, i int) bool {
	if n.bom < 3 && c == bomBytes[n.bom] {
		if n.bom++; n.bom == 3 {
			n.bom = 0
		}
		return false
	}
	for _, b := range bomBytes[:n.bom] {
		if n.put(b, p, i) {
			return true
		}
	}
	if n.bom = 0; c == bomBytes[0] {
		n.bom = 1
		return false
	}
	switch c {
	case '\r':
		return false
	case ' ', '\t':
		n.blanks++
		return false
	case '\n':
		n.blanks = 0
		return n.put(c, p, i+1)
	}
	if n.blanks > 0 {
		n.blanks = 0
		if n.put(' ', p, i) {
			return true
		}
	}
	return n.put(c, p, i+1)
}

// WriteString is Write for a string.
func (n *Normalizer) WriteString(s string) (int, error) { return n.Write(unsafeBytes(s)) }

// put adds one normalised byte, made of the raw bytes of p up to end (of
// the current Write); it reports whether the normaliser is done.
func (n *Normalizer) put(c byte, p []byte, end int) bool {
	n.buf = append(n.buf, c)
	if n.room--; n.room > 0 {
		return false
	}
	return n.blockEnd(p, end)
}

// blockEnd hashes the normalised block that the last byte put completed,
// and the raw bytes so far.
func (n *Normalizer) blockEnd(p []byte, end int) bool {
	n.room = n.h.blockSize
	_, _ = n.h.Write(n.buf)
	n.buf = n.buf[:0]
	_, _ = n.raw.Write(p[n.digested-n.total : end])
	n.digested = n.total + end
	n.Raw = append(n.Raw, n.raw.Sum64())
	n.Offsets = append(n.Offsets, n.start)
	n.start = n.digested
	return n.Done()
}

// NearMisses remembers, for the normalised prefixes of recent requests,
// the raw digest of the first request seen with each. Safe for concurrent
// use.
type NearMisses struct {
	seen *golru.Cache[uint64, uint64]
}

// NewNearMisses remembers up to size normalised blocks.
func NewNearMisses(size int) *NearMisses {
	c, _ := golru.New[uint64, uint64](size) // size > 0
	return &NearMisses{seen: c}
}

// Observe checks a request's normalised blocks (hashes, with their raw
// digests and raw start offsets) against those seen before and remembers
// the new ones. It returns the normalised blocks matched (depth) and the
// blocks over which the raw bytes were the same too (exact); exact <
// depth means a near-identical prefix whose bytes first differ in block
// exact, which starts at raw byte offset.
func (m *NearMisses) Observe(hashes, raw []uint64, offsets []int) (depth, exact, offset int) {
	exact = -1
	for i, h := range hashes {
		r, ok := m.seen.Get(h)
		if !ok {
			for j := i; j < len(hashes); j++ { // this block and the rest are new
				m.seen.Add(hashes[j], raw[j])
			}
			break
		}
		depth = i + 1
		if exact < 0 && r != raw[i] {
			exact, offset = i, offsets[i]
		}
	}
	if exact < 0 {
		exact = depth
	}
	return depth, exact, offset
}
