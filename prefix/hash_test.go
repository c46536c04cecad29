package prefix

import (
	"bytes"
	"strconv"
	"strings"
	"testing"
)

func TestHasherChainsAndIsStreamingInvariant(t *testing.T) {
	text := []byte(strings.Repeat("abcdefghij", 100)) // 1000 bytes
	var whole, parts Hasher
	whole.Reset(64, 100, Seed("m", ""))
	_, _ = whole.Write(text)
	parts.Reset(64, 100, Seed("m", ""))
	for i := 0; i < len(text); i += 7 { // odd-sized writes straddle blocks
		_, _ = parts.Write(text[i:min(i+7, len(text))])
	}
	if len(whole.Hashes) != 1000/64 || whole.Len() != 1000 {
		t.Fatalf("%d hashes for 1000 bytes", len(whole.Hashes))
	}
	for i := range whole.Hashes {
		if whole.Hashes[i] != parts.Hashes[i] {
			t.Fatalf("block %d differs between one write and many", i)
		}
	}
	// Equal blocks at different depths hash differently (the chain).
	var h Hasher
	h.Reset(10, 10, 0)
	_, _ = h.WriteString("aaaaaaaaaaaaaaaaaaaa")
	if h.Hashes[0] == h.Hashes[1] {
		t.Fatal("block hash does not depend on its parent")
	}
	// The cap stops hashing but not counting.
	var c Hasher
	c.Reset(64, 3, 0)
	_, _ = c.Write(text)
	if len(c.Hashes) != 3 || c.Len() != 1000 {
		t.Fatalf("cap: %d hashes, %d bytes", len(c.Hashes), c.Len())
	}
}

func FuzzHasher(f *testing.F) {
	f.Add([]byte("hello world, a prompt"), uint8(5), uint8(3))
	f.Fuzz(func(t *testing.T, data []byte, bs, split uint8) {
		blockSize := int(bs%64) + 1
		var a, b Hasher
		a.Reset(blockSize, 1<<20, 42)
		_, _ = a.Write(data)
		b.Reset(blockSize, 1<<20, 42)
		k := int(split) % (len(data) + 1)
		_, _ = b.Write(data[:k])
		_, _ = b.WriteString(string(data[k:]))
		if len(a.Hashes) != len(data)/blockSize || !equal(a.Hashes, b.Hashes) || a.Len() != len(data) {
			t.Fatalf("hashes differ for a split write, or wrong count")
		}
		// A prefix of the data yields a prefix of the hashes.
		var p Hasher
		p.Reset(blockSize, 1<<20, 42)
		_, _ = p.Write(bytes.Clone(data[:k]))
		if !equal(p.Hashes, a.Hashes[:len(p.Hashes)]) {
			t.Fatal("prefix property broken")
		}
	})
}

func equal(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func BenchmarkHasher128KiB(b *testing.B) {
	text := []byte(strings.Repeat("The quick brown fox jumps over the lazy dog. ", 3000)[:128<<10])
	for _, bs := range []int{64, 256, 1024} {
		b.Run("block-"+strconv.Itoa(bs), func(b *testing.B) {
			var h Hasher
			b.SetBytes(int64(len(text)))
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				h.Reset(bs, 1<<20, 1)
				_, _ = h.Write(text)
			}
		})
	}
}
