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
		b.Mark()
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
		// A mark names the data before it, however it was written.
		p.Mark()
		if k > 0 && (len(b.Marks) != 1 || len(p.Marks) != 1 || b.Marks[0] != p.Marks[0] || p.Marks[0].Bytes != k) {
			t.Fatalf("marks at %d: %v and %v", k, b.Marks, p.Marks)
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

// A mark names everything written before it: a later stream that extends
// the first through a mark's offset has a mark of the same hash there,
// however its writes and blocks fall; other bytes give another hash.
func TestMarksNameTheRenderingSoFar(t *testing.T) {
	turn1 := []string{"system: be brief.", "user: what is a KV cache?"}
	turn2 := append(append([]string{}, turn1...), "assistant: attention state, kept.", "user: and a prefix?")
	marks := func(msgs []string, chunk int) []Mark {
		var h Hasher
		h.Reset(16, 100, Seed("m", ""))
		for _, m := range msgs {
			for i := 0; i < len(m); i += chunk {
				_, _ = h.WriteString(m[i:min(i+chunk, len(m))])
			}
			h.Mark()
			h.Mark() // twice at one offset is one mark
		}
		return append([]Mark(nil), h.Marks...)
	}
	first, second := marks(turn1, 5), marks(turn2, 3)
	if len(first) != 2 || len(second) != 4 {
		t.Fatalf("%d and %d marks, want 2 and 4", len(first), len(second))
	}
	if second[1] != first[1] || second[0] != first[0] {
		t.Fatalf("the second turn does not carry the first's marks: %v, %v", first, second)
	}
	if first[1].Bytes != len(turn1[0])+len(turn1[1]) {
		t.Fatalf("mark at %d bytes", first[1].Bytes)
	}
	other := marks([]string{"system: be brief.", "user: what is a KV cachE?"}, 5)
	if other[1].Hash == first[1].Hash || other[0] != first[0] {
		t.Fatal("a changed byte keeps the mark, or an equal prefix changes it")
	}
	// Only the last MaxMarks are kept; none past the block cap.
	var h Hasher
	h.Reset(4, 5, 0)
	for i := range 30 {
		_, _ = h.WriteString("x")
		h.Mark()
		if i == 0 && len(h.Marks) != 1 {
			t.Fatal("no first mark")
		}
	}
	if len(h.Marks) != MaxMarks || h.Marks[len(h.Marks)-1].Bytes != 19 {
		t.Fatalf("%d marks, last at %d: want %d, the last at the cap (19 bytes)", len(h.Marks), h.Marks[len(h.Marks)-1].Bytes, MaxMarks)
	}
}
