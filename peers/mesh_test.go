package peers

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/leakcheck"
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
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Logf("%s: %v", m.Name(), err)
		}
	})
	select {
	case <-m.Bound():
	case err := <-done:
		t.Fatal(err)
	case <-time.After(waitTimeout):
		t.Fatal("gossip listener not bound")
	}
	return m
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
// ignored.
func TestPlacementsReachPeers(t *testing.T) {
	ra, rb, rc := newRecorder(), newRecorder(), newRecorder()
	a := start(t, Config{Name: "a"}, ra)
	if err := a.Ready(); err != nil {
		t.Fatalf("a replica without seeds is not ready: %v", err)
	}
	b := start(t, Config{Name: "b", Seeds: []string{a.Addr()}}, rb)
	until(t, "the replicas to meet", func() bool { return a.Members() == 1 && b.Members() == 1 })
	if err := b.Ready(); err != nil {
		t.Fatalf("joined but not ready: %v", err)
	}
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
	a.Placed(3, long) // the same chain again within the second: not resent
	s := a.Stats()
	if s.Members != 2 || !s.Joined || s.SentMessages == 0 || s.SentBytes == 0 {
		t.Fatalf("stats %+v", s)
	}
	t.Logf("a: %+v", s)
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
