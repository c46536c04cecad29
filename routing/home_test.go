package routing

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvroute/kvroute/discovery"
)

// Keys seen twice are homed in rounds of bounded proposals; the homes
// depend on the set of recurring keys, not on the order they arrived in,
// and spread evenly where plain rendezvous hashing does not.
func TestHomesAreBalancedAndOrderFree(t *testing.T) {
	eps := testSet(t, 8).Mixed
	keys := make([]uint64, 64)
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range keys {
		keys[i] = rng.Uint64()
	}
	homesAfter := func(order []int) (map[uint64]uint64, map[uint64]int) {
		h := newHomes(time.Hour, time.Now)
		for range 2 {
			for _, i := range order {
				h.lookup(keys[i], eps, 1.1, true, false)
			}
		}
		at, load := map[uint64]uint64{}, map[uint64]int{}
		for _, k := range keys {
			e, hk, ok := h.lookup(k, eps, 1.1, false, false)
			recurring := hk.recurring
			if !ok || !recurring {
				t.Fatalf("key %x: ok %v recurring %v", k, ok, recurring)
			}
			at[k] = e
			load[e]++
		}
		return at, load
	}
	forward, backward := rng.Perm(len(keys)), rng.Perm(len(keys))
	a, load := homesAfter(forward)
	b, _ := homesAfter(backward)
	for k := range a {
		if a[k] != b[k] {
			t.Errorf("key %x homed on %x in one order, %x in another", k, a[k], b[k])
		}
	}
	plain := map[uint64]int{}
	for _, k := range keys {
		e, _, _ := newHomes(0, time.Now).lookup(k, eps, 1.1, false, false)
		plain[e]++
	}
	most := func(m map[uint64]int) (n int) {
		for _, v := range m {
			n = max(n, v)
		}
		return n
	}
	// 64 keys on 8 endpoints: the bound is ⌈1.1 × 8⌉ = 9.
	t.Logf("most homes on one endpoint: %d balanced, %d plain rendezvous", most(load), most(plain))
	if most(load) > 9 || most(load) >= most(plain) {
		t.Errorf("balanced homes put %d keys on one endpoint (plain rendezvous %d)", most(load), most(plain))
	}
}

// A key seen once is homed where it will be when it recurs, but for the
// few that its rendezvous winner turns away (placing those exactly would
// mean rerunning the assignment per new prompt).
func TestNewKeyKeepsItsHome(t *testing.T) {
	eps := testSet(t, 8).Mixed
	rng := rand.New(rand.NewPCG(7, 8))
	h := newHomes(time.Hour, time.Now)
	for range 63 {
		k := rng.Uint64()
		h.lookup(k, eps, 1.1, true, false)
		h.lookup(k, eps, 1.1, true, false)
	}
	moved := 0
	for range 200 {
		k := rng.Uint64()
		first, hk, _ := h.lookup(k, eps, 1.1, false, false)
		recurring := hk.recurring
		if recurring {
			t.Fatal("an unseen key recurs")
		}
		h.lookup(k, eps, 1.1, true, false)
		if home, _, _ := h.lookup(k, eps, 1.1, true, false); home != first {
			moved++
		}
		h.lru.Remove(k) // the next key sees the same 63 recurring keys

	}
	t.Logf("%d of 200 new keys changed home when they recurred", moved)
	if moved > 10 {
		t.Errorf("%d of 200 new keys changed home when they recurred, want at most 10", moved)
	}
}

func TestHomesExpireAndForget(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	h := newHomes(time.Minute, func() time.Time { return now })
	eps := testSet(t, 3).Mixed
	see := func(k uint64) (uint64, bool) {
		e, hk, _ := h.lookup(k, eps, 1.1, true, false)
		recurring := hk.recurring
		return e, recurring
	}
	if _, recurring := see(1); recurring {
		t.Fatal("a key seen once recurs")
	}
	see(2)
	if _, recurring := see(1); !recurring || h.len() != 1 {
		t.Fatalf("a key seen twice: recurring %v, %d recurring", recurring, h.len())
	}
	see(2)
	now = now.Add(50 * time.Second)
	see(2) // refreshes 2 only
	now = now.Add(20 * time.Second)
	if _, hk, _ := h.lookup(1, eps, 1.1, false, false); hk.recurring || h.len() != 1 {
		t.Fatalf("key 1 outlived its TTL (recurring %v, %d recurring)", hk.recurring, h.len())
	}
	home, _ := see(2)
	h.forget(home)
	if _, hk, _ := h.lookup(2, eps, 1.1, false, false); hk.recurring || h.len() != 0 {
		t.Fatalf("a forgotten endpoint kept its keys (recurring %v, %d)", hk.recurring, h.len())
	}
	// Without its old primary the key proposes to the next one.
	var rest []*discovery.Endpoint
	for _, e := range eps {
		if e.ID != home {
			rest = append(rest, e)
		}
	}
	see(2)
	if e, hk, _ := h.lookup(2, rest, 1.1, true, false); !hk.recurring || e == home {
		t.Fatalf("after the endpoint left: home %x (recurring %v)", e, hk.recurring)
	}
}

func TestHomeBound(t *testing.T) {
	for _, tc := range []struct {
		factor   float64
		total, n int
		want     int
	}{
		{1.1, 0, 8, 0}, {1.1, 64, 8, 9}, {1, 64, 8, 8}, {1.25, 100, 10, 13}, {1.1, 5, 0, 6},
		{1.1, 4, 4, 1}, {1.1, 32, 8, 4}, {1.1, 9, 4, 3}, {1.5, 4, 4, 2},
	} {
		if got := homeBound(tc.factor, tc.total, tc.n); got != tc.want {
			t.Errorf("homeBound(%v, %d, %d) = %d, want %d", tc.factor, tc.total, tc.n, got, tc.want)
		}
	}
}
