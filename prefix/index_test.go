package prefix

import (
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"
	"time"
)

// chain returns n chained hashes for a prompt family (same family, same
// leading hashes).
func chain(family uint64, n int) []uint64 {
	var h Hasher
	h.Reset(8, n, Seed("m", ""))
	for i := 0; i < n; i++ {
		var b [8]byte
		for k := range b {
			b[k] = byte(family >> (8 * k))
		}
		if i >= n/2 { // the second half depends on the family's variant bits only
			b[0] ^= byte(i)
		}
		_, _ = h.Write(b[:])
	}
	return slices.Clone(h.Hashes)
}

func matches(t *testing.T, x *Index, hashes []uint64) map[uint64]int {
	t.Helper()
	got := map[uint64]int{}
	for _, m := range x.Match(hashes, nil) {
		got[m.ID] = m.Blocks
	}
	return got
}

func TestMatchCountsLeadingBlocksPerEndpoint(t *testing.T) {
	x := NewIndex(IndexConfig{BlocksPerEndpoint: 100})
	a := chain(1, 10)
	x.Record(1, a[:10])
	x.Record(2, a[:4])
	x.Record(3, chain(2, 10)) // another prompt entirely
	got := matches(t, x, a)
	if len(got) != 2 || got[1] != 10 || got[2] != 4 {
		t.Fatalf("matches %v", got)
	}
	// A request sharing only the first 6 blocks.
	b := slices.Clone(a)
	b[6], b[7] = 111, 222
	if got := matches(t, x, b); got[1] != 6 || got[2] != 4 {
		t.Fatalf("partial matches %v", got)
	}
	if got := matches(t, x, []uint64{42}); len(got) != 0 {
		t.Fatalf("unknown prefix matched %v", got)
	}
	if got := x.Match(nil, nil); len(got) != 0 {
		t.Fatal("empty request matched")
	}
}

// SetLower marks claims as held on a slower tier: Match counts them among
// the matched blocks, per endpoint; a claim not held is not marked, and a
// claim forgotten forgets its mark.
func TestSetLowerCountsInMatch(t *testing.T) {
	x := NewIndex(IndexConfig{BlocksPerEndpoint: 8})
	x.Record(1, []uint64{10, 11, 12})
	x.Record(2, []uint64{10, 11})
	x.SetLower(1, 11, true)
	x.SetLower(1, 12, true)
	x.SetLower(2, 12, true) // not held by 2: ignored
	x.SetLower(3, 10, true) // unknown endpoint: ignored
	got := map[uint64][2]int{}
	for _, m := range x.Match([]uint64{10, 11, 12}, nil) {
		got[m.ID] = [2]int{m.Blocks, m.Lower}
	}
	if got[1] != [2]int{3, 2} || got[2] != [2]int{2, 0} {
		t.Fatalf("matches %v, want 1: 3 blocks 2 lower, 2: 2 blocks 0 lower", got)
	}
	x.SetLower(1, 12, false)
	x.Drop(1, 11)
	x.Record(1, []uint64{10, 11}) // held again: on the GPU until marked
	for _, m := range x.Match([]uint64{10, 11, 12}, nil) {
		if m.ID == 1 && (m.Blocks != 3 || m.Lower != 0) {
			t.Fatalf("after unmarking and re-recording: %+v, want 3 blocks 0 lower", m)
		}
	}
}

func TestEvictionIsLRUAndTailFirst(t *testing.T) {
	now := time.Unix(1000, 0)
	x := NewIndex(IndexConfig{BlocksPerEndpoint: 10, Now: func() time.Time { now = now.Add(time.Second); return now }})
	a, b := chain(1, 6), chain(2, 6)
	x.Record(1, a)
	x.Record(1, b) // 12 blocks into 10: a's last two blocks go first
	if got := matches(t, x, a); got[1] != 4 {
		t.Fatalf("a matched %v, want its first 4 blocks kept", got)
	}
	if got := matches(t, x, b); got[1] != 6 {
		t.Fatalf("b matched %v", got)
	}
	x.Record(1, a[:4]) // touch a's head: now b is older
	x.Record(1, chain(3, 4))
	if got := matches(t, x, b); got[1] != 2 {
		t.Fatalf("b after more traffic %v, want 2", got)
	}
	st := x.Stats()
	if st.Entries != 10 || st.Evictions != 6 {
		t.Fatalf("stats %+v", st)
	}
}

func TestTTLExpires(t *testing.T) {
	now := time.Unix(1000, 0)
	x := NewIndex(IndexConfig{BlocksPerEndpoint: 100, TTL: time.Minute, Now: func() time.Time { return now }})
	a := chain(1, 5)
	x.Record(1, a)
	now = now.Add(59 * time.Second)
	if got := matches(t, x, a); got[1] != 5 {
		t.Fatalf("before TTL %v", got)
	}
	now = now.Add(2 * time.Minute)
	if got := matches(t, x, a); len(got) != 0 {
		t.Fatalf("after TTL %v", got)
	}
	if st := x.Stats(); st.Expiries == 0 || st.Hashes != 0 && st.Entries > 4 {
		t.Fatalf("stats %+v", st)
	}
	// Expired entries at an LRU's tail make room before live ones are evicted.
	x.Record(2, chain(2, 5))
	now = now.Add(2 * time.Minute)
	x.Record(2, chain(3, 5))
	if st := x.Stats(); st.Evictions != 0 {
		t.Fatalf("evicted live entries: %+v", st)
	}
}

func TestForget(t *testing.T) {
	x := NewIndex(IndexConfig{BlocksPerEndpoint: 100})
	a := chain(1, 8)
	for id := uint64(1); id <= 4; id++ {
		x.Record(id, a)
	}
	x.Forget(2)
	x.Forget(3)
	got := matches(t, x, a)
	if len(got) != 2 || got[1] != 8 || got[4] != 8 {
		t.Fatalf("after forgetting 2 and 3: %v", got)
	}
	if st := x.Stats(); st.Endpoints != 2 || st.Entries != 16 || st.Hashes != 8 {
		t.Fatalf("stats %+v", st)
	}
	x.Record(5, a) // a new endpoint reuses a freed slot
	if got := matches(t, x, a); got[5] != 8 {
		t.Fatalf("new endpoint %v", got)
	}
}

func TestSetCapacity(t *testing.T) {
	x := NewIndex(IndexConfig{BlocksPerEndpoint: 100})
	a := chain(1, 10)
	x.Record(1, a)
	x.SetCapacity(1, 3)
	if got := matches(t, x, a); got[1] != 3 {
		t.Fatalf("after shrinking %v", got)
	}
}

// The global cap bounds memory however many endpoints and prompts arrive.
func TestGlobalCapBoundsGrowth(t *testing.T) {
	x := NewIndex(IndexConfig{BlocksPerEndpoint: 1 << 20, MaxEntries: 10_000})
	r := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 2000; i++ {
		x.Record(uint64(r.IntN(20)), chain(r.Uint64(), 50))
	}
	if st := x.Stats(); st.Entries > 10_000 || st.Hashes > 10_000 {
		t.Fatalf("unbounded: %+v", st)
	}
}

// Heap bytes per (block, endpoint) entry, measured: the target is ≤ 100.
func TestMemoryPerEntry(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates ~100 MB")
	}
	const endpoints, perEndpoint = 16, 60_000
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	x := NewIndex(IndexConfig{BlocksPerEndpoint: perEndpoint, MaxEntries: endpoints * perEndpoint})
	r := rand.New(rand.NewPCG(3, 4))
	hashes := make([]uint64, 64)
	for x.Stats().Entries < endpoints*perEndpoint*9/10 {
		base := r.Uint64()
		for i := range hashes {
			hashes[i] = base + uint64(i)
		}
		// Each prefix lives on one or two endpoints, as with sticky routing.
		x.Record(uint64(r.IntN(endpoints)), hashes)
		if r.IntN(4) == 0 {
			x.Record(uint64(r.IntN(endpoints)), hashes)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	st := x.Stats()
	per := float64(after.HeapAlloc-before.HeapAlloc) / float64(st.Entries)
	t.Logf("%d entries, %d hashes: %.1f heap bytes per entry (estimate %.1f)", st.Entries, st.Hashes, per, float64(st.Bytes)/float64(st.Entries))
	if per > 100 {
		t.Errorf("%.1f bytes per entry, target ≤ 100", per)
	}
	runtime.KeepAlive(x)
}

// A replica joining its peers imports their claims (Export, Import):
// the most recent first, behind its own claims and into its free room only
// (never evicting one of its own), each as old as the exporter had it, so
// that it expires when it would have there; expired claims stay behind.
func TestExportImport(t *testing.T) {
	now := time.Unix(1000, 0)
	clock := func() time.Time { return now }
	a := NewIndex(IndexConfig{BlocksPerEndpoint: 100, TTL: time.Minute, Now: clock})
	older, fresh, other := chain(1, 10), chain(2, 6), chain(3, 10)
	a.Record(1, older)
	now = now.Add(30 * time.Second)
	a.Record(1, fresh)
	a.Record(2, other)
	type claim struct {
		h   uint64
		age uint32
	}
	exported := map[uint64][]claim{}
	a.Export(1000, func(id, h uint64, age uint32) { exported[id] = append(exported[id], claim{h, age}) })
	if n1, n2 := len(exported[1]), len(exported[2]); n1 != 16 || n2 != 10 {
		t.Fatalf("exported %d and %d claims, want 16 and 10", n1, n2)
	}
	if c := exported[1][0]; c.h != fresh[0] || c.age != 0 {
		t.Errorf("first claim exported %+v, want the most recent chain's first block, age 0", c)
	}
	if c := exported[1][len(exported[1])-1]; c.age != 30 {
		t.Errorf("last claim exported %+v, want age 30", c)
	}
	limited := 0
	a.Export(4, func(uint64, uint64, uint32) { limited++ })
	if limited != 4 {
		t.Errorf("Export(4) gave %d claims", limited)
	}

	// b starts later, with room for 12 blocks an endpoint, 5 of them its own.
	b := NewIndex(IndexConfig{BlocksPerEndpoint: 12, TTL: time.Minute, Now: clock})
	own := chain(4, 5)
	b.Record(1, own)
	imp := func(id uint64) int {
		var hs []uint64
		var ages []uint32
		for _, c := range exported[id] {
			hs, ages = append(hs, c.h), append(ages, c.age)
		}
		return b.Import(id, hs, ages)
	}
	if n := imp(1); n != 7 {
		t.Errorf("imported %d claims on endpoint 1, want its 7 free blocks", n)
	}
	if n := imp(2); n != 10 {
		t.Errorf("imported %d claims on endpoint 2, want 10", n)
	}
	for _, c := range []struct {
		name  string
		chain []uint64
		id    uint64
		want  int
	}{
		{"own chain kept", own, 1, 5},
		{"recent chain imported", fresh, 1, 6},
		{"older chain's first block in the room left", older, 1, 1},
		{"other endpoint", other, 2, 10},
	} {
		if got := matches(t, b, c.chain)[c.id]; got != c.want {
			t.Errorf("%s: %d blocks matched, want %d", c.name, got, c.want)
		}
	}
	if n := imp(1); n != 0 {
		t.Errorf("imported again: %d claims added", n)
	}
	if n := b.Import(3, []uint64{99}, []uint32{61}); n != 0 {
		t.Errorf("an expired claim was imported")
	}
	// 31 s on, the claim 30 s old at the export is past the minute.
	now = now.Add(31 * time.Second)
	if got := matches(t, b, older); len(got) != 0 {
		t.Errorf("claim past its TTL still matched: %v", got)
	}
	if got := matches(t, b, fresh)[1]; got != 6 {
		t.Errorf("recent chain: %d blocks matched after 31 s, want 6", got)
	}
}
