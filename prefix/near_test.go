package prefix

import (
	"slices"
	"strings"
	"testing"
)

func normalize(t *testing.T, s string, chunk int) *Normalizer {
	t.Helper()
	var n Normalizer
	n.Reset(64, 8, 1)
	for len(s) > 0 { // in pieces, as renderings are written
		k := min(chunk, len(s))
		_, _ = n.WriteString(s[:k])
		s = s[k:]
	}
	return &n
}

// Renderings that differ only by a BOM, CRLF, runs of blanks or trailing
// blanks have the same normalised hashes, whatever the write sizes; other
// text does not; the raw digests tell them apart.
func TestNormalizer(t *testing.T) {
	base := strings.Repeat("You are a helpful assistant.\nAnswer in  English, briefly.\n", 12)
	variants := map[string]string{
		"bom":            "\uFEFF" + base,
		"crlf":           strings.ReplaceAll(base, "\n", "\r\n"),
		"trailing":       strings.ReplaceAll(base, "\n", "  \t\n"),
		"blank runs":     strings.ReplaceAll(base, " ", "   "),
		"tabs for space": strings.ReplaceAll(base, " ", "\t"),
	}
	want := normalize(t, base, 1<<20)
	if len(want.Hashes()) != 8 || len(want.Raw) != 8 || want.Offsets[0] != 0 {
		t.Fatalf("%d blocks, %d raw digests, offsets %v", len(want.Hashes()), len(want.Raw), want.Offsets)
	}
	for name, v := range variants {
		for _, chunk := range []int{1, 7, 1 << 20} {
			got := normalize(t, v, chunk)
			if !slices.Equal(got.Hashes(), want.Hashes()) {
				t.Errorf("%s (writes of %d): normalised hashes differ", name, chunk)
			}
			if got.Raw[0] == want.Raw[0] {
				t.Errorf("%s: the raw digest does not see the difference", name)
			}
		}
	}
	same := normalize(t, base, 5)
	for i := range want.Raw {
		if same.Raw[i] != want.Raw[i] || same.Offsets[i] != want.Offsets[i] {
			t.Fatalf("block %d: raw digest or offset depends on the write sizes", i)
		}
	}
	other := normalize(t, strings.Replace(base, "helpful", "careful", 1), 1<<20)
	if other.Hashes()[0] == want.Hashes()[0] {
		t.Error("different words normalise alike")
	}
}

// NearMisses: a second request with the same normal form but other bytes
// is a near miss from its first differing block, with that block's raw
// offset; the same bytes again are not.
func TestNearMisses(t *testing.T) {
	m := NewNearMisses(1024)
	base := strings.Repeat("system prompt line, the same for every group\n", 20)
	first := normalize(t, base, 1<<20)
	if d, e, _ := m.Observe(first.Hashes(), first.Raw, first.Offsets); d != 0 || e != 0 {
		t.Errorf("first request: depth %d exact %d", d, e)
	}
	again := normalize(t, base, 3)
	if d, e, _ := m.Observe(again.Hashes(), again.Raw, again.Offsets); d != 8 || e != 8 {
		t.Errorf("same bytes: depth %d exact %d, want 8 and 8", d, e)
	}
	// The first difference in the third normalised block: trailing blanks
	// on a line that starts there.
	i := 2*64 + 10
	j := i + strings.IndexByte(base[i:], '\n')
	near := normalize(t, base[:j]+"   "+base[j:], 1<<20)
	d, e, off := m.Observe(near.Hashes(), near.Raw, near.Offsets)
	if d != 8 || e != 2 || off != near.Offsets[2] || off < 128 || off > 140 {
		t.Errorf("near miss: depth %d exact %d offset %d, want 8, 2 and ≈ 128", d, e, off)
	}
}
