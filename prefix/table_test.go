package prefix

import (
	"math/rand/v2"
	"testing"
)

// The table against a Go map, through random inserts, owner changes and
// deletions over a small key space (so probe runs collide, wrap around the
// end of the slab and are shifted back), across growth.
func TestTableMatchesMap(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	tb := newTable()
	want := map[uint64][]int32{} // hash → owner endpoint slots, in table order
	keys := []uint64{0}          // stored as 1
	for range 3000 {
		// Keys with equal top bits collide in every table size.
		keys = append(keys, rng.Uint64()>>50<<50|rng.Uint64()&7, rng.Uint64())
	}
	check := func() {
		t.Helper()
		if tb.n != len(want) {
			t.Fatalf("table holds %d hashes, want %d", tb.n, len(want))
		}
		for k, owners := range want {
			at := tb.find(k)
			if at < 0 || int(tb.slots[at].n) != len(owners) {
				t.Fatalf("hash %x: slot %d, want %d owners", k, at, len(owners))
			}
			for i, s := range owners {
				if tb.owner(at, i).slot != s || tb.ownerOf(at, s) != i {
					t.Fatalf("hash %x owner %d: %+v, want endpoint %d", k, i, tb.owner(at, i), s)
				}
			}
		}
		if len(tb.more) != countOver(want, 2) {
			t.Fatalf("%d overflow lists, want %d", len(tb.more), countOver(want, 2))
		}
	}
	for step := range 200_000 {
		k := keys[rng.IntN(len(keys))]
		at := tb.find(k)
		if (at >= 0) != (want[k] != nil) {
			t.Fatalf("step %d: find(%x) = %d, present %v", step, k, at, want[k] != nil)
		}
		switch {
		case at < 0 || rng.IntN(3) == 0 && len(want[k]) < 5:
			if at < 0 {
				at = tb.insert(k)
			}
			s := int32(step) // distinct endpoints
			tb.addOwner(at, ref{slot: s, node: int32(step)})
			want[k] = append(want[k], s)
		default:
			i := rng.IntN(len(want[k]))
			tb.removeOwner(at, i)
			o := want[k]
			last := len(o) - 1
			o[i] = o[last]
			want[k] = o[:last]
			if last == 0 {
				tb.del(at)
				delete(want, k)
			}
		}
		if step%10_000 == 0 {
			check()
		}
	}
	check()
	if len(tb.slots) <= minTableSlots {
		t.Fatalf("the table never grew (%d slots)", len(tb.slots))
	}
}

func countOver(m map[uint64][]int32, n int) int {
	c := 0
	for _, o := range m {
		if len(o) > n {
			c++
		}
	}
	return c
}
