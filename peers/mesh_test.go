package peers

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/leakcheck"
	"github.com/kvroute/kvroute/prefix"
)

func TestMain(m *testing.M) { leakcheck.Run(m) }

// waitTimeout bounds every wait of these tests: a deadlock guard, not a
// speed assertion.
const waitTimeout = 15 * time.Second

// recorder is an index stand-in: the placements merged, per endpoint.
type recorder struct {
	mu  sync.Mutex
	got map[uint64][][]uint64
	ch  chan uint64
}

func newRecorder() *recorder {
	return &recorder{got: map[uint64][][]uint64{}, ch: make(chan uint64, 1024)}
}

func (r *recorder) Record(id uint64, hashes []uint64) {
	r.mu.Lock()
	r.got[id] = append(r.got[id], slices.Clone(hashes))
	r.mu.Unlock()
	r.ch <- id
}

func (r *recorder) chains(id uint64) [][]uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.got[id])
}

// start runs a mesh on 127.0.0.1 with cfg's other fields, stopped at the
// test's end, and returns it once bound.
func start(t *testing.T, cfg Config, rec *recorder) *Mesh {
	t.Helper()
	m, _ := startStoppable(t, cfg, rec)
	return m
}

// startStoppable is start, and returns a function that stops the mesh
// before the test's end as well.
func startStoppable(t *testing.T, cfg Config, rec *recorder) (*Mesh, func()) {
	t.Helper()
	cfg.Listen = "127.0.0.1:0"
	if cfg.Fingerprint == 0 {
		cfg.Fingerprint = Fingerprint(64, false, "test")
	}
	cfg.Known = func(id uint64) bool { return id < 100 }
	cfg.Record = rec.Record
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	stop := sync.OnceFunc(func() {
		cancel()
		if err := <-done; err != nil {
			t.Logf("%s: %v", m.Name(), err)
		}
	})
	t.Cleanup(stop)
	select {
	case <-m.Bound():
	case err := <-done:
		t.Fatal(err)
	case <-time.After(waitTimeout):
		t.Fatal("gossip listener not bound")
	}
	return m, stop
}

// until waits for cond, failing the test after waitTimeout.
func until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Two replicas on loopback: the second joins the first through its seed,
// each sees the other, and a placement made by either is merged by the
// other whole (a chain longer than a message, in pieces, first blocks
// first); a placement on an endpoint the peer does not route to is
// dropped and counted; a replica with another hashing configuration is
// ignored. Links, sequences and outcomes go the same way.
func TestPlacementsReachPeers(t *testing.T) {
	ra, rb, rc := newRecorder(), newRecorder(), newRecorder()
	var sink tupleSink
	a := start(t, Config{Name: "a"}, ra)
	if err := a.Ready(); err != nil {
		t.Fatalf("a replica without seeds is not ready: %v", err)
	}
	b := start(t, Config{Name: "b", Seeds: []string{a.Addr()}, Links: sink.link, Sequences: sink.sequence, Outcomes: sink.outcome}, rb)
	until(t, "the replicas to meet", func() bool { return a.Members() == 1 && b.Members() == 1 })
	until(t, "b ready (a's state merged at the join)", func() bool { return b.Ready() == nil })
	until(t, "both to route as one of several", func() bool { return a.Shared() && b.Shared() })
	c := start(t, Config{Name: "c", Seeds: []string{a.Addr()}, Fingerprint: Fingerprint(128, false, "test")}, rc)
	until(t, "the third replica to join", func() bool { return a.Members() == 2 && c.Members() == 2 })

	long := chain(7, 300)
	a.Placed(3, long)
	a.Placed(200, chain(8, 2)) // not an endpoint of b
	b.Placed(4, chain(9, 5))
	t.Cleanup(func() { t.Logf("a %+v\nb %+v\nc %+v", a.Stats(), b.Stats(), c.Stats()) })
	until(t, "b to merge a's chain", func() bool {
		var got []uint64
		for _, c := range rb.chains(3) {
			got = append(got, c...)
		}
		slices.Sort(got)
		want := slices.Sorted(slices.Values(long))
		return slices.Equal(got, want)
	})
	until(t, "a to merge b's chain", func() bool { return len(ra.chains(4)) == 1 })
	until(t, "b to drop the unknown endpoint", func() bool { return b.Stats().Unknown == 1 })
	until(t, "c to refuse the others' hashes", func() bool { return c.Stats().Mismatched >= 2 })
	if len(rc.chains(3)) != 0 || len(rc.chains(4)) != 0 {
		t.Fatal("a replica with another block size merged placements")
	}
	if got := rb.chains(200); len(got) != 0 {
		t.Fatalf("placement on an unknown endpoint merged: %v", got)
	}
	tuplesReachPeer(t, a, b, &sink)
	a.Placed(3, long) // the same chain again within the second: not resent
	s := a.Stats()
	if s.Members != 2 || !s.Joined || s.SentMessages == 0 || s.SentBytes == 0 {
		t.Fatalf("stats %+v", s)
	}
	t.Logf("a: %+v", s)
}

// tupleSink records what a replica's Links, Sequences and Outcomes hooks
// were told, in order.
type tupleSink struct {
	mu    sync.Mutex
	links []uint64 // block, token, …
	seqs  []uint64 // endpoint, from, to, …
	outs  []uint64 // endpoint, distance, held, …
}

func (k *tupleSink) link(blocks, tokens []uint64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for i := range blocks {
		k.links = append(k.links, blocks[i], tokens[i])
	}
}

func (k *tupleSink) sequence(id, from, to uint64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.seqs = append(k.seqs, id, from, to)
}

func (k *tupleSink) outcome(id uint64, distance int, held bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	h := uint64(0)
	if held {
		h = 1
	}
	k.outs = append(k.outs, id, uint64(distance), h)
}

// tuplesReachPeer has a send links, sequences and outcomes, and checks that
// b, which routes to endpoint 3 but not 200, merged each whole into sink.
func tuplesReachPeer(t *testing.T, a, b *Mesh, sink *tupleSink) {
	t.Helper()
	pairs := chain(11, 2*(maxLinkPairs+5))
	a.Linked(pairs[:len(pairs)/2], pairs[len(pairs)/2:])
	until(t, "b to merge a's links", func() bool {
		sink.mu.Lock()
		defer sink.mu.Unlock()
		return len(sink.links) == len(pairs)
	})
	back := map[uint64]uint64{} // the messages may arrive in any order
	for i := 0; i < len(sink.links); i += 2 {
		back[sink.links[i]] = sink.links[i+1]
	}
	for i := range len(pairs) / 2 {
		if back[pairs[i]] != pairs[len(pairs)/2+i] {
			t.Fatalf("link %d: block %x back with token %x", i, pairs[i], back[pairs[i]])
		}
	}
	if got := b.Stats().Links; got != int64(len(pairs)/2) {
		t.Fatalf("b counted %d links merged, want %d", got, len(pairs)/2)
	}
	a.Sequenced(3, 0, 0xabc)
	a.Sequenced(200, 1, 2) // not an endpoint of b
	a.Sequenced(3, 0xabc, 0xdef)
	until(t, "b to merge a's sequences", func() bool {
		sink.mu.Lock()
		defer sink.mu.Unlock()
		return slices.Equal(sink.seqs, []uint64{3, 0, 0xabc, 3, 0xabc, 0xdef}) && b.Stats().Unknown == 2
	})
	if got := b.Stats().Sequences; got != 2 {
		t.Fatalf("b counted %d sequences merged, want 2", got)
	}
	a.Outcome(3, 4, false)
	a.Outcome(3, -1, true) // no distance: not sent
	a.Outcome(3, 0, true)
	until(t, "b to merge a's outcomes", func() bool {
		sink.mu.Lock()
		defer sink.mu.Unlock()
		return slices.Equal(sink.outs, []uint64{3, 4, 0, 3, 0, 1})
	})
	if got := b.Stats().Outcomes; got != 2 {
		t.Fatalf("b counted %d outcomes merged, want 2", got)
	}
}

// homeTable is routing's homes stand-in: key → endpoint and whether it
// recurs, exported most recently added first.
type homeTable struct {
	mu    sync.Mutex
	order []uint64
	at    map[uint64]home
}

func newHomeTable(hs ...home) *homeTable {
	t := &homeTable{at: map[uint64]home{}}
	for _, x := range hs {
		t.ImportHomes(x.key, x.endpoint, x.recurring, x.age)
	}
	return t
}

func (t *homeTable) ExportHomes(n int, yield func(key, id uint64, recurring bool, age uint32)) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, k := range slices.Backward(t.order) {
		if n--; n < 0 {
			return
		}
		x := t.at[k]
		yield(x.key, x.endpoint, x.recurring, x.age)
	}
}

func (t *homeTable) ImportHomes(key, id uint64, recurring bool, age uint32) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.at[key]; ok {
		return false
	}
	t.order = append(t.order, key)
	t.at[key] = home{key: key, endpoint: id, recurring: recurring, age: age}
	return true
}

func (t *homeTable) get(key uint64) (home, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	x, ok := t.at[key]
	return x, ok
}

// A replica that joins starts warm: before it is ready it has merged a
// peer's index (memberlist's push/pull), its claims on the endpoints this
// replica routes to, into their free room, and the peer's homes of keys it
// does not know on those endpoints; the peer merged the joiner's.
func TestJoinPullsState(t *testing.T) {
	newIndex := func() *prefix.Index {
		return prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: 1000, TTL: time.Hour})
	}
	xa, xb := newIndex(), newIndex()
	warm, known := chain(1, 40), chain(2, 10)
	xa.Record(3, warm)
	xa.Record(200, chain(3, 5)) // not an endpoint of b's
	xb.Record(4, known)
	ha := newHomeTable(home{key: 11, endpoint: 3, recurring: true, age: 5}, home{key: 12, endpoint: 200}, home{key: 13, endpoint: 5})
	hb := newHomeTable(home{key: 13, endpoint: 4})
	cfg := func(name string, x *prefix.Index, h *homeTable, seeds ...string) Config {
		return Config{Name: name, Seeds: seeds, Export: x.Export, Import: x.Import,
			ExportHomes: h.ExportHomes, ImportHomes: h.ImportHomes, SyncTimeout: time.Hour}
	}
	a := start(t, cfg("a", xa, ha), newRecorder())
	b := start(t, cfg("b", xb, hb, a.Addr()), newRecorder())
	until(t, "b ready", func() bool { return b.Ready() == nil })
	if got := xb.Match(warm, nil); len(got) != 1 || got[0].ID != 3 || got[0].Blocks != len(warm) {
		t.Fatalf("b ready without a's claims: %+v", got)
	}
	if x, ok := hb.get(11); !ok || x != (home{key: 11, endpoint: 3, recurring: true, age: 5}) {
		t.Errorf("b's home of a's recurring key: %+v, %v", x, ok)
	}
	if _, ok := hb.get(12); ok {
		t.Error("b imported a home on an endpoint it does not route to")
	}
	if x, _ := hb.get(13); x.endpoint != 4 {
		t.Errorf("b's own home of key 13 became %d, want its own 4", x.endpoint)
	}
	if xb.Holds(200, chain(3, 5)[0]) {
		t.Error("b imported claims on an endpoint it does not route to")
	}
	until(t, "a to merge b's state", func() bool {
		got := xa.Match(known, nil)
		return len(got) == 1 && got[0].ID == 4 && got[0].Blocks == len(known)
	})
	if s := b.Stats(); s.States == 0 || s.Imported != int64(len(warm)) || s.ImportedHomes != 1 || s.Unknown == 0 {
		t.Errorf("b's stats %+v: want a state merged, %d claims and 1 home imported, an endpoint unknown", s, len(warm))
	}
}

// Keys: replicas sharing a key mesh and exchange placements; one with
// another key cannot join them. Without a key, gossip binds loopback only.
func TestKeys(t *testing.T) {
	k1, k2 := []byte("0123456789abcdef"), []byte("fedcba9876543210")
	ra, rb, rc := newRecorder(), newRecorder(), newRecorder()
	a := start(t, Config{Name: "a", Keys: [][]byte{k1}}, ra)
	b := start(t, Config{Name: "b", Keys: [][]byte{k1, k2}, Seeds: []string{a.Addr()}}, rb) // sends with k1, accepts k2 too
	until(t, "the keyed replicas to meet", func() bool { return a.Members() == 1 && b.Members() == 1 })
	a.Placed(5, chain(5, 3))
	until(t, "an encrypted placement", func() bool { return len(rb.chains(5)) == 1 })

	c := start(t, Config{Name: "c", Keys: [][]byte{[]byte("another key 0123")}, Seeds: []string{a.Addr()}, SyncTimeout: time.Hour}, rc)
	time.Sleep(2 * time.Second) // the join attempt at c's start, refused
	if c.Members() != 0 || a.Members() != 1 || c.Ready() == nil {
		t.Fatalf("a replica with the wrong key joined: c sees %d, a %d, c ready %v", c.Members(), a.Members(), c.Ready())
	}

	for _, cfg := range []Config{
		{Listen: "0.0.0.0:7946"},
		{Listen: "10.0.0.1:7946"},
		{Listen: "127.0.0.1"},
		{Listen: "127.0.0.1:0", Seeds: []string{"no-port"}},
	} {
		cfg.Known, cfg.Record = func(uint64) bool { return true }, func(uint64, []uint64) {}
		if _, err := New(cfg); err == nil {
			t.Errorf("%+v accepted", cfg)
		}
	}
	if _, err := New(Config{Listen: "0.0.0.0:0", Keys: [][]byte{k1}, Known: func(uint64) bool { return true },
		Record: func(uint64, []uint64) {}}); err != nil {
		t.Errorf("keyed gossip on all addresses refused: %v", err)
	}
}

// A replica whose seeds never answer becomes ready after SyncTimeout, not
// before: the first replica of a fleet has no one to meet.
func TestReadyAfterSyncTimeout(t *testing.T) {
	m := start(t, Config{Name: "alone", Seeds: []string{"127.0.0.1:1"}, SyncTimeout: 300 * time.Millisecond}, newRecorder())
	if err := m.Ready(); err == nil {
		t.Fatal("ready at once with seeds unreached")
	}
	until(t, "the sync timeout", func() bool { return m.Ready() == nil })
	if err := (&Mesh{cfg: Config{Seeds: []string{"x:1"}}}).Ready(); err == nil || errors.Is(err, ErrBadMessage) {
		t.Fatalf("a mesh not started is ready: %v", err)
	}
}

// loadBoard is a replica's endpoints' load: its own requests in flight
// (Load) and what the peers told (SetLoad).
type loadBoard struct {
	mu         sync.Mutex
	own, peers map[uint64]int64
}

func (l *loadBoard) Load(yield func(id uint64, n int64)) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for id, n := range l.own {
		yield(id, n)
	}
}

func (l *loadBoard) SetLoad(id uint64, n int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.peers[id] = n
}

func (l *loadBoard) set(id uint64, n int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.own[id] = n
}

func (l *loadBoard) peer(id uint64) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.peers[id]
}

// Replicas tell each other their requests in flight per endpoint: each
// sees the sum of the others' (never its own, nor what it was told passed
// on), follows changes, ignores endpoints it does not route to, and drops
// a replica's report once it is gone.
func TestLoadReachesPeers(t *testing.T) {
	boards := make([]*loadBoard, 3)
	var ms []*Mesh
	stops := make([]func(), 3)
	for i := range boards {
		boards[i] = &loadBoard{own: map[uint64]int64{}, peers: map[uint64]int64{}}
		cfg := Config{Name: fmt.Sprintf("r%d", i), Load: boards[i].Load, SetLoad: boards[i].SetLoad}
		if i > 0 {
			cfg.Seeds = []string{ms[0].Addr()}
		}
		m, stop := startStoppable(t, cfg, newRecorder())
		ms, stops[i] = append(ms, m), stop
	}
	until(t, "the replicas to meet", func() bool { return ms[0].Members() == 2 && ms[1].Members() == 2 && ms[2].Members() == 2 })
	boards[0].set(3, 5)
	boards[1].set(3, 2)
	boards[1].set(200, 9) // not an endpoint of theirs
	until(t, "r2 to see 7 in flight at endpoint 3", func() bool { return boards[2].peer(3) == 7 })
	until(t, "r0 to see r1's 2", func() bool { return boards[0].peer(3) == 2 })
	boards[0].set(3, 1)
	until(t, "r2 to follow r0's change", func() bool { return boards[2].peer(3) == 3 })
	if n := boards[2].peer(200); n != 0 {
		t.Errorf("load on an unknown endpoint passed on: %d", n)
	}
	stops[1]()
	until(t, "r1's report to lapse", func() bool { return boards[2].peer(3) == 1 && boards[0].peer(3) == 0 })
}

// newLoadMesh returns a mesh, not running, that knows endpoints below 100
// and exchanges load through board.
func newLoadMesh(t *testing.T) (*Mesh, *loadBoard) {
	t.Helper()
	board := &loadBoard{own: map[uint64]int64{}, peers: map[uint64]int64{}}
	m, err := New(Config{Name: "r", Listen: "127.0.0.1:0", Fingerprint: 1, Known: func(id uint64) bool { return id < 100 },
		Record: func(uint64, []uint64) {}, Load: board.Load, SetLoad: board.SetLoad})
	if err != nil {
		t.Fatal(err)
	}
	return m, board
}

// A peer's placement counts as one of its requests in flight at the
// endpoint (once per endpoint a message names) until its next report says
// how many run.
func TestPlacementCountsAsInFlightUntilReported(t *testing.T) {
	m, board := newLoadMesh(t)
	const peer = 77
	now := time.Now()
	m.mergeLoad(peer, []loadEntry{{4, 2}}, now)
	var sc scratch
	h := header{sender: peer, fingerprint: 1}
	for _, b := range encodePlacements(nil, h, []placement{{4, chain(1, 3)}, {4, chain(2, 3)}, {5, chain(3, 2)}, {200, chain(4, 1)}}) {
		m.apply(b, &sc)
	}
	if a, b := board.peer(4), board.peer(5); a != 3 || b != 1 {
		t.Fatalf("after the placements: %d and %d in flight, want 3 and 1", a, b)
	}
	m.mergeLoad(peer, []loadEntry{{4, 2}, {5, 0}}, now)
	if a, b := board.peer(4), board.peer(5); a != 2 || b != 0 {
		t.Fatalf("after the report: %d and %d in flight, want 2 and 0", a, b)
	}
}

// Echo, how many of the peers' requests one of this replica's stands for,
// is learned from the loads: every peer sending as many as this replica
// until they show otherwise; the peers' requests in flight over this
// replica's once they do, at most the number of peers.
func TestEchoLearnsThePeersShare(t *testing.T) {
	m, board := newLoadMesh(t)
	m.others.Store(3)
	if e := m.Echo(); e != 3 {
		t.Fatalf("Echo before any load %v, want the peers' number 3", e)
	}
	// learn runs the load loop's step ticks times with this replica's
	// own requests in flight at endpoint 1 and the peers' reports.
	learn := func(own int64, peers map[uint64]int64, ticks int) float64 {
		board.set(1, own)
		for sender, n := range peers {
			m.mergeLoad(sender, []loadEntry{{1, n}}, time.Now())
		}
		for range ticks {
			m.loads.own = m.loads.own[:0]
			m.cfg.Load(func(id uint64, n int64) { m.loads.own = append(m.loads.own, loadEntry{id, n}) })
			m.learnEcho()
		}
		return m.Echo()
	}
	long := int(3 * echoDecay / loadEvery) // three decay times
	if e := learn(0, nil, 50); e != 3 {
		t.Errorf("Echo with no load anywhere %v, want the prior 3", e)
	}
	if e := learn(4, map[uint64]int64{7: 2, 8: 2}, long); math.Abs(e-1) > 0.1 {
		t.Errorf("Echo with 4 of this replica's in flight and 4 of two peers' %v, want about 1", e)
	}
	if e := learn(6, map[uint64]int64{7: 0, 8: 0}, long); e > 0.3 {
		t.Errorf("Echo with every request this replica's %v, want about 0", e)
	}
	if e := learn(1, map[uint64]int64{7: 20, 8: 20}, long); e != 3 {
		t.Errorf("Echo with the peers' 40 against 1 %v, want at most the peers' number 3", e)
	}
}
