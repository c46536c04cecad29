package load

import "testing"

// Time outside the benchmark is the machine's busy time less the tree's;
// unknown where the tree's time fell (a descendant ended) or is unknown.
func TestOutsideBetween(t *testing.T) {
	a := cpuSample{ok: true, total: 1000, idle: 600, tree: 100}
	b := cpuSample{ok: true, total: 1200, idle: 650, tree: 200}
	if got, ok := outsideBetween(a, b); !ok || got != 50 {
		t.Errorf("outside %v (%v), want 50", got, ok)
	}
	b.tree = 400 // the tree more busy than the machine (sampled later): none outside
	if got, ok := outsideBetween(a, b); !ok || got != 0 {
		t.Errorf("outside %v (%v), want 0", got, ok)
	}
	b.tree = 50
	if _, ok := outsideBetween(a, b); ok {
		t.Error("known though a descendant's time left the tree")
	}
	a.tree = -1
	if _, ok := outsideBetween(a, b); ok {
		t.Error("known without the tree's time")
	}
}
