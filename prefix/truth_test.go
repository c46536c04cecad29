package prefix

import (
	"slices"
	"testing"
)

// truthFixture is a prompt of nBytes bytes rendered into 64-byte index
// blocks, whose engine tokens are one per 4 bytes (16 tokens per 64 bytes:
// one engine block of 16 tokens per index block), and the engine's block
// hashes of it (its own numbering: 1000+j).
type truthFixture struct {
	hashes []uint64 // index blocks
	tokens []uint32
	engine []uint64 // engine block hashes
}

func newTruthFixture(nBytes int, salt uint32) truthFixture {
	var h Hasher
	h.Reset(64, 256, 1)
	buf := make([]byte, nBytes)
	for i := range buf {
		buf[i] = byte('a' + (i*7+int(salt))%26)
	}
	_, _ = h.Write(buf)
	f := truthFixture{hashes: append([]uint64(nil), h.Hashes...)}
	for i := range nBytes / 4 {
		f.tokens = append(f.tokens, uint32(i)*31+salt)
	}
	for j := range len(f.tokens) / 16 {
		f.engine = append(f.engine, uint64(1000+j)+uint64(salt)<<32)
	}
	return f
}

func newTestTruth() (*Truth, *Index) {
	x := NewIndex(IndexConfig{BlocksPerEndpoint: 1024})
	return NewTruth(x, TruthConfig{BlockBytes: 64}), x
}

// held returns how many leading index blocks of f endpoint id is shown
// holding.
func held(x *Index, id uint64, f truthFixture) int {
	for _, m := range x.Match(f.hashes, nil) {
		if m.ID == id {
			return m.Blocks
		}
	}
	return 0
}

func TestTruthStoreConfirmsAndRemoveDrops(t *testing.T) {
	tr, x := newTestTruth()
	f := newTruthFixture(640, 0) // 10 index blocks, 160 tokens, 10 engine blocks
	const ep = 7
	// The engine announces the whole prompt before any link exists.
	tr.Stored(ep, 0, false, f.engine, f.tokens, 16, "", 0)
	if got := held(x, ep, f); got != 0 {
		t.Fatalf("before the link: held %d blocks, want 0 (stores of unlinked tokens confirm nothing)", got)
	}
	if !tr.NeedsLink(f.hashes) {
		t.Fatal("NeedsLink = false for a new chain")
	}
	if tr.NeedsLink(f.hashes) {
		t.Fatal("NeedsLink = true twice while the first tokenization is under way")
	}
	tr.Link("", f.hashes, 640, f.tokens)
	if got := held(x, ep, f); got != 10 {
		t.Fatalf("after the link: held %d blocks, want 10", got)
	}
	if tr.NeedsLink(f.hashes) {
		t.Fatal("NeedsLink = true for a linked chain")
	}
	// The engine evicts the tail from block 6: the index keeps 6 blocks.
	tr.Removed(ep, f.engine[6:], 0)
	if got := held(x, ep, f); got != 6 {
		t.Fatalf("after removing engine blocks 6..9: held %d, want 6", got)
	}
	// Stored again (recomputed): confirmed again by its end blocks.
	tr.Stored(ep, f.engine[5], true, f.engine[6:], f.tokens[6*16:], 16, "", 0)
	if got := held(x, ep, f); got != 10 {
		t.Fatalf("after storing 6..9 again: held %d, want 10", got)
	}
	// The root goes first (llm-d's simulator evicts the oldest block): the
	// chain is unusable from its root.
	tr.Removed(ep, f.engine[:1], 0)
	if got := held(x, ep, f); got != 0 {
		t.Fatalf("after removing the root: held %d, want 0", got)
	}
	st := tr.Stats()
	if st.Dropped == 0 || st.Confirmed == 0 || st.Endpoints != 1 {
		t.Fatalf("stats %+v: want drops, confirmations and one endpoint", st)
	}
}

func TestTruthLinkConfirmsOnlyWhatEveryEngineHolds(t *testing.T) {
	tr, x := newTestTruth()
	f := newTruthFixture(640, 1)
	tr.Stored(1, 0, false, f.engine[:4], f.tokens[:4*16], 16, "", 0) // 4 blocks
	tr.Stored(2, 0, false, f.engine, f.tokens, 16, "", 0)            // all 10
	tr.Stored(3, 0, false, f.engine, f.tokens, 16, "adapter", 0)     // another adapter's keys
	tr.NeedsLink(f.hashes)
	tr.Link("", f.hashes, 640, f.tokens)
	for _, c := range []struct {
		id   uint64
		want int
	}{{1, 4}, {2, 10}, {3, 0}} {
		if got := held(x, c.id, f); got != c.want {
			t.Errorf("endpoint %d: held %d, want %d", c.id, got, c.want)
		}
	}
}

// lowerOf returns how many of the leading index blocks of f endpoint id is
// shown holding are held there only on a slower tier.
func lowerOf(x *Index, id uint64, f truthFixture) int {
	for _, m := range x.Match(f.hashes, nil) {
		if m.ID == id {
			return m.Lower
		}
	}
	return 0
}

func TestTruthRefsAndTiers(t *testing.T) {
	tr, x := newTestTruth()
	f := newTruthFixture(256, 2) // 4 blocks
	tr.NeedsLink(f.hashes)
	tr.Link("", f.hashes, 256, f.tokens)
	const ep = 3
	tr.Stored(ep, 0, false, f.engine, f.tokens, 16, "", 0)
	tr.Stored(ep, 0, false, f.engine, f.tokens, 16, "", 0) // announced twice
	tr.Removed(ep, f.engine[3:], 0)
	if got := held(x, ep, f); got != 4 {
		t.Fatalf("one of two announcements removed: held %d, want 4", got)
	}
	// Offloaded to CPU (announced as vLLM's offloading connector does: the
	// GPU blocks' hashes, no tokens), then gone from the GPU: still held.
	tr.Stored(ep, 0, false, f.engine[3:], nil, 16, "", 1)
	if got := lowerOf(x, ep, f); got != 0 {
		t.Fatalf("copied to CPU, still on the GPU: %d blocks lower, want 0", got)
	}
	tr.Removed(ep, f.engine[3:], 0)
	if got := held(x, ep, f); got != 4 {
		t.Fatalf("held on CPU only: held %d, want 4", got)
	}
	// ... but as a load, not a GPU hit.
	if got := lowerOf(x, ep, f); got != 1 {
		t.Fatalf("held on CPU only: %d blocks lower, want 1", got)
	}
	if st := tr.Stats(); st.Blocks[1] != 1 || st.Blocks[0] != 3 {
		t.Fatalf("blocks by tier %v, want [3 1 0]", st.Blocks)
	}
	// Loaded back onto the GPU (a BlockStored with the tokens): a GPU hit
	// again; and evicted once more.
	tr.Stored(ep, f.engine[2], true, f.engine[3:], f.tokens[48:], 16, "", 0)
	if got := lowerOf(x, ep, f); got != 0 {
		t.Fatalf("back on the GPU: %d blocks lower, want 0", got)
	}
	tr.Removed(ep, f.engine[3:], 0)
	if got := lowerOf(x, ep, f); got != 1 {
		t.Fatalf("evicted again: %d blocks lower, want 1", got)
	}
	tr.Removed(ep, f.engine[3:], 1)
	if got := held(x, ep, f); got != 3 {
		t.Fatalf("gone from every tier: held %d, want 3", got)
	}
	if got := lowerOf(x, ep, f); got != 0 {
		t.Fatalf("gone from every tier: %d blocks lower, want 0", got)
	}
	// A prompt linked after its blocks went to CPU is confirmed as lower.
	g := newTruthFixture(128, 5) // 2 blocks
	tr.Stored(ep, 0, false, g.engine, g.tokens, 16, "", 0)
	tr.Stored(ep, 0, false, g.engine, nil, 16, "", 1)
	tr.Removed(ep, g.engine, 0)
	tr.NeedsLink(g.hashes)
	tr.Link("", g.hashes, 128, g.tokens)
	if h, l := held(x, ep, g), lowerOf(x, ep, g); h != 2 || l != 2 {
		t.Fatalf("linked while on CPU only: held %d, %d lower, want 2 and 2", h, l)
	}
	if tr.Removed(ep, []uint64{99}, 0); tr.Stats().Unknown != 1 {
		t.Fatal("a removal of a block never stored is not counted")
	}
	if tr.Stored(ep, 0, false, []uint64{98}, nil, 16, "", 1); tr.Stats().Orphans != 1 {
		t.Fatal("a copy of a block never stored is not an orphan")
	}
}

func TestTruthOrphanParent(t *testing.T) {
	tr, x := newTestTruth()
	f := newTruthFixture(256, 4)
	tr.NeedsLink(f.hashes)
	tr.Link("", f.hashes, 256, f.tokens)
	tr.Stored(5, 424242, true, f.engine[1:], f.tokens[16:], 16, "", 0)
	if got := held(x, 5, f); got != 0 {
		t.Fatalf("blocks after an unknown parent: held %d, want 0", got)
	}
	if tr.Stats().Orphans != 3 {
		t.Fatalf("orphans %d, want 3", tr.Stats().Orphans)
	}
	tr.Stored(5, 0, false, f.engine, f.tokens[:16], 16, "", 0) // tokens do not match the hashes
	if tr.Stats().Orphans != 7 {
		t.Fatalf("a store whose tokens do not fill its blocks: orphans %d, want 7", tr.Stats().Orphans)
	}
}

func TestTruthClearedAndDrop(t *testing.T) {
	tr, x := newTestTruth()
	f := newTruthFixture(256, 5)
	tr.NeedsLink(f.hashes)
	tr.Link("", f.hashes, 256, f.tokens)
	tr.Stored(1, 0, false, f.engine, f.tokens, 16, "", 0)
	x.Record(2, f.hashes) // learned: the router sent it there
	tr.Stored(2, 0, false, f.engine, f.tokens, 16, "", 0)
	tr.Cleared(1)
	if got := held(x, 1, f); got != 0 {
		t.Fatalf("after AllBlocksCleared: held %d, want 0", got)
	}
	if live, _ := tr.Live(1); !live {
		t.Fatal("a cleared endpoint is no longer on engine truth")
	}
	tr.Stale(2)
	if live, last := tr.Live(2); live || last.IsZero() || x.OnTruth(2) {
		t.Fatal("a stale endpoint is still on engine truth")
	}
	tr.Stored(2, 0, false, f.engine[:1], f.tokens[:16], 16, "", 0)
	if live, _ := tr.Live(2); !live || !x.OnTruth(2) {
		t.Fatal("an event does not bring a stale endpoint back on engine truth")
	}
	x.Forget(2) // a scraped restart: the index forgets, the mode stays
	if !x.OnTruth(2) {
		t.Fatal("Index.Forget lost the endpoint's engine-truth mode")
	}
	x.Record(2, f.hashes)
	tr.Drop(2)
	if live, _ := tr.Live(2); live {
		t.Fatal("a dropped endpoint is still on engine truth")
	}
	if got := held(x, 2, f); got != 4 {
		t.Fatalf("after Drop the learned claims stay: held %d, want 4", got)
	}
	if st := tr.Stats(); st.Blocks[0] != 0 || st.Endpoints != 1 {
		t.Fatalf("stats after clearing and dropping: %+v", st)
	}
}

func TestTruthIndexModes(t *testing.T) {
	x := NewIndex(IndexConfig{BlocksPerEndpoint: 100})
	x.SetTruth(1, true)
	if eff := x.Correct(1, true); eff != 200 {
		t.Fatalf("on engine truth Correct changed the capacity to %d, want the headroom 200", eff)
	}
	x.SetTruth(1, false)
	if eff := x.Correct(1, true); eff != 90 {
		t.Fatalf("learning again: Correct gave %d, want 90", eff)
	}
}

func TestTruthUnlinked(t *testing.T) {
	tr, _ := newTestTruth()
	f := newTruthFixture(256, 6)
	if !tr.NeedsLink(f.hashes) {
		t.Fatal("NeedsLink = false")
	}
	tr.Unlinked(f.hashes, true)
	if !tr.NeedsLink(f.hashes) {
		t.Fatal("a tokenization never sent may not be asked again")
	}
	tr.Unlinked(f.hashes, false)
	if tr.NeedsLink(f.hashes) {
		t.Fatal("a tokenization the engine failed is asked again at once")
	}
}

func TestTwoGenForgetsOldest(t *testing.T) {
	g := NewTwoGen[int](4, nil)
	for k := range uint64(6) {
		g.Put(k, int(k))
	}
	if _, ok := g.Get(0); ok {
		t.Fatal("the oldest entry survived two generations")
	}
	if v, ok := g.Get(5); !ok || v != 5 {
		t.Fatal("the newest entry is gone")
	}
	// Weighed: a generation holds 5 in weight; an entry of 6 is not kept,
	// and entries of 3 each fill a generation two at a time.
	w := NewTwoGen(10, func(v []int) int { return len(v) })
	w.Put(1, make([]int, 6))
	if _, ok := w.Get(1); ok {
		t.Fatal("an entry heavier than a generation was kept")
	}
	for k := range uint64(5) {
		w.Put(k, make([]int, 2))
	}
	if _, ok := w.Get(0); ok || w.Len() != 3 {
		t.Fatalf("weighed: the oldest entry kept, or %d entries, want 3", w.Len())
	}
}

// Two router replicas' Truths over the same engine: replica A forwards a
// prompt and tokenizes it; replica B only merges A's placement (the
// chain recorded on the endpoint, as gossip does). When the engine evicts
// the prompt's tail, B keeps claiming it without A's links, and drops it
// with them; B confirms a block an engine holds when the link arrives,
// does not tokenize a chain A linked, and keeps its own links over a
// peer's.
func TestPeerLinksLetEventsDropAPeersPrompt(t *testing.T) {
	const ep, ep2 = 7, 8
	f := newTruthFixture(640, 3) // 10 index blocks, 10 engine blocks
	a, _ := newTestTruth()
	var blocks, tokens []uint64
	a.OnLinked(func(b, k []uint64) { blocks, tokens = append(blocks, b...), append(tokens, k...) })
	without, xw := newTestTruth()
	b, xb := newTestTruth()
	for _, tr := range []*Truth{a, without, b} {
		tr.Stored(ep, 0, false, f.engine, f.tokens, 16, "", 0)
	}
	a.NeedsLink(f.hashes)
	a.Link("", f.hashes, 640, f.tokens)
	if len(blocks) != 10 || !slices.Equal(blocks, f.hashes) {
		t.Fatalf("OnLinked gave %d blocks, want the chain's 10", len(blocks))
	}
	n := len(blocks)
	a.Link("", f.hashes, 640, f.tokens)
	if len(blocks) != n {
		t.Fatalf("linking the same chain again told %d more links", len(blocks)-n)
	}
	xw.Record(ep, f.hashes) // the peer's placement
	xb.Record(ep, f.hashes)
	b.PeerLinked(blocks, tokens)
	if b.NeedsLink(f.hashes) {
		t.Fatal("NeedsLink = true for a chain a peer linked")
	}
	for _, tr := range []*Truth{a, without, b} {
		tr.Removed(ep, f.engine[6:], 0)
	}
	if got := held(xw, ep, f); got != 10 {
		t.Fatalf("without the peer's links: held %d, want the stale 10 (the case the links are for)", got)
	}
	if got := held(xb, ep, f); got != 6 {
		t.Fatalf("with the peer's links: held %d after the engine evicted blocks 6..9, want 6", got)
	}
	// Another engine already holds the prompt when the links arrive.
	c, xc := newTestTruth()
	c.Stored(ep2, 0, false, f.engine, f.tokens, 16, "", 0)
	c.PeerLinked(blocks, tokens)
	if got := held(xc, ep2, f); got != 10 {
		t.Fatalf("links of a prompt an engine holds: held %d, want 10", got)
	}
	if st := c.Stats(); st.PeerLinks != 10 {
		t.Fatalf("peer links %d, want 10", st.PeerLinks)
	}
	// A token key B linked itself keeps its link: a peer's other byte
	// block for it is ignored.
	g := newTruthFixture(640, 4)
	d, xd := newTestTruth()
	d.Stored(ep, 0, false, g.engine, g.tokens, 16, "", 0)
	d.NeedsLink(g.hashes)
	d.Link("", g.hashes, 640, g.tokens)
	var ends []uint64
	for j, key := 0, TokenRoot(""); j < 10; j++ {
		key = TokenKey(key, g.tokens[j*16:(j+1)*16])
		ends = append(ends, key)
	}
	d.PeerLinked(f.hashes, ends)
	d.Removed(ep, g.engine[8:], 0)
	if got := held(xd, ep, g); got != 8 {
		t.Fatalf("own links after a peer's conflicting ones: held %d, want 8", got)
	}
}
