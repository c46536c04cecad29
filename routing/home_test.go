package routing

import (
	"testing"
	"time"
)

func TestHomesExpireAndForget(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	h := newHomes(time.Minute, func() time.Time { return now })
	h.assign(1, 10)
	h.assign(2, 10)
	h.assign(3, 20)
	h.assign(1, 30) // a key keeps its first home
	if ep, ok := h.lookup(1, true); !ok || ep != 10 {
		t.Fatalf("lookup(1) = %d, %v", ep, ok)
	}
	if h.count[10] != 2 || h.count[20] != 1 || h.count[30] != 0 {
		t.Fatalf("loads %d %d %d", h.count[10], h.count[20], h.count[30])
	}
	now = now.Add(50 * time.Second)
	h.lookup(2, true) // refreshes 2 only
	now = now.Add(20 * time.Second)
	if _, ok := h.lookup(1, true); ok || h.len() != 1 {
		t.Fatalf("key 1 outlived its TTL (ok %v, %d live)", ok, h.len())
	}
	if h.count[10] != 1 || h.count[20] != 0 {
		t.Fatalf("after expiry: loads %d %d", h.count[10], h.count[20])
	}
	h.forget(10)
	if _, ok := h.lookup(2, true); ok || h.len() != 0 || h.count[10] != 0 {
		t.Fatalf("forgotten endpoint kept its homes (ok %v, %d live)", ok, h.len())
	}
}

func TestHomeBound(t *testing.T) {
	for _, tc := range []struct {
		factor   float64
		total, n int
		want     int
	}{
		{1.1, 0, 8, 1}, {1.1, 63, 8, 9}, {1, 63, 8, 8}, {1.25, 99, 10, 13}, {1.1, 5, 0, 7},
	} {
		if got := homeBound(tc.factor, tc.total, tc.n); got != tc.want {
			t.Errorf("homeBound(%v, %d, %d) = %d, want %d", tc.factor, tc.total, tc.n, got, tc.want)
		}
	}
}
