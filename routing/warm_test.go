package routing

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kvroute/kvroute/discovery"
)

// An engine that keeps one prompt: keys alternating on it miss at
// distance 1 and hit at distance 0; warmth learns 1, a key one back is no
// longer held, and the count holds while its evidence fades, until a key
// is seen warm beyond it.
func TestWarmthLearnsKeptPrompts(t *testing.T) {
	w := newWarmth()
	const ep = 7
	if d := w.see(ep, 1); d != -1 {
		t.Fatalf("first sight at distance %d", d)
	}
	for range 3 {
		w.outcome(ep, w.see(ep, 2), false) // -1 first: ignored
		w.outcome(ep, w.see(ep, 1), false) // distance 1: cold
		w.outcome(ep, w.see(ep, 1), true)  // distance 0: warm
	}
	if k := w.kept(ep); k != 1 {
		t.Fatalf("kept %d, want 1", k)
	}
	if !holds(w, ep, 1) || holds(w, ep, 2) {
		t.Fatalf("holds: last key %v, the one before %v", holds(w, ep, 1), holds(w, ep, 2))
	}
	for range 200 {
		w.outcome(ep, w.see(ep, 1), true)
	}
	if k := w.kept(ep); k != 1 {
		t.Fatalf("kept %d after its evidence faded, want 1 still", k)
	}
	for range 3 {
		w.see(ep, 3)
		w.outcome(ep, w.see(ep, 1), true) // distance 1 warm: it keeps more
	}
	if k := w.kept(ep); k != 0 {
		t.Fatalf("kept %d after warm answers at distance 1, want 0 (unknown)", k)
	}
	w.forget(ep)
	if w.fleet.Load() != 0 || w.see(ep, 1) != -1 {
		t.Fatal("forget left state behind")
	}
}

// holds is warmth.at's first answer.
func holds(w *warmth, id, key uint64) bool {
	h, _ := w.at(id, key)
	return h
}

// An endpoint with no count of its own takes the fleet's (the least any
// endpoint learned) until its own answers show it warm that deep.
func TestWarmthFleetCount(t *testing.T) {
	w := newWarmth()
	w.see(2, 9) // endpoint 2 exists, nothing learned
	for range 3 {
		w.see(1, 5)
		w.outcome(1, w.see(1, 6), false)
		w.outcome(1, w.see(1, 5), false)
	}
	if k1, k2, k3 := w.kept(1), w.kept(2), w.kept(3); k1 != 1 || k2 != 1 || k3 != 1 {
		t.Fatalf("kept %d, %d, %d; want 1 learned and 1 from the fleet twice", k1, k2, k3)
	}
	if holds(w, 2, 8) || !holds(w, 2, 9) || holds(w, 3, 9) {
		t.Fatal("the fleet's count is not applied to the endpoints without their own")
	}
	for range 3 {
		w.see(2, 7)
		w.outcome(2, w.see(2, 9), true) // warm at distance 1
	}
	if k := w.kept(2); k != 0 {
		t.Fatalf("kept %d for an endpoint warm at distance 1, want 0 (unknown)", k)
	}
}

// Homes follow what engines keep: endpoints that keep one prompt home one
// key each and the others take the rest; when the fleet cannot keep every
// key, they are spread evenly.
func TestHomesBoundedByKeptPrompts(t *testing.T) {
	var eps []*discovery.Endpoint
	for i := range 4 {
		e, err := discovery.NewEndpoint(fmt.Sprintf("http://127.0.0.1:%d", 1000+i), discovery.RoleMixed)
		if err != nil {
			t.Fatal(err)
		}
		eps = append(eps, e)
	}
	for _, tc := range []struct {
		keys int
		kept []int
		want []int
	}{
		{4, []int{1, 1, 1, 1}, []int{1, 1, 1, 1}},
		{8, []int{1, 1, 0, 0}, []int{1, 1, 3, 3}},
		{8, []int{1, 1, 1, 1}, []int{2, 2, 2, 2}},
		{8, []int{0, 0, 0, 0}, []int{2, 2, 2, 2}},
	} {
		h := newHomes(time.Hour, time.Now)
		h.kept = func(id uint64) int {
			return tc.kept[slices.IndexFunc(eps, func(e *discovery.Endpoint) bool { return e.ID == id })]
		}
		for k := range tc.keys {
			h.recur(uint64(1000 + k))
		}
		h.assign(eps, 1.1, time.Now())
		for i, e := range eps {
			if n := h.load[e.ID]; n != tc.want[i] {
				t.Errorf("%d keys, kept %v: endpoint %d homes %d, want %d", tc.keys, tc.kept, i, n, tc.want[i])
			}
		}
	}
}

// A miss counts only where the endpoint ran nothing else of this router's:
// an engine with several slots computes a prompt afresh in a free slot
// while the one keeping it is busy (Ollama with OLLAMA_NUM_PARALLEL). A
// hit counts either way.
func TestWarmthIgnoresBusyMisses(t *testing.T) {
	p := newTestPrefix(DefaultPrefixParams())
	set := testSet(t, 1)
	e := set.Endpoints[0]
	miss := func(busy bool) {
		p.warm.see(e.ID, 2)
		d := Decision{Endpoint: e, PrefixKey: 1, PromptTokens: 1000, Prefill: 1000, busy: busy}
		d.distance = p.warm.see(e.ID, 1)
		p.Learn(d, 4000, 1000, 0)
	}
	p.warm.see(e.ID, 1)
	for range 4 {
		miss(true)
	}
	if k := p.Kept(e.ID); k != 0 {
		t.Fatalf("kept %d after misses while busy, want 0 (unknown)", k)
	}
	for range 4 {
		miss(false)
	}
	if k := p.Kept(e.ID); k != 1 {
		t.Fatalf("kept %d after misses while idle, want 1", k)
	}
	// Busy is a slot engine's with requests in flight; a paged cache's
	// misses under load are evictions and count.
	defer occupy(e, 1, 0)()
	for _, tc := range []struct {
		dialect discovery.Dialect
		busy    bool
	}{{discovery.DialectOllama, true}, {discovery.DialectLlamaCpp, true}, {discovery.DialectVLLM, false}} {
		e.SetDialect(tc.dialect)
		if d := p.Pick(request(system(52, 4096)+"q"), set); d.busy != tc.busy {
			t.Errorf("%s with a request in flight: busy %v, want %v", tc.dialect, d.busy, tc.busy)
		}
	}
}

// A TTFT that says a prompt the policy took for evicted was served from
// cache, or the reverse, contradicts the decision: the proxy then keeps the
// answer out of the endpoint's costs.
func TestLearnTTFTContradicts(t *testing.T) {
	p := newTestPrefix(DefaultPrefixParams())
	e := testSet(t, 1).Endpoints[0]
	predict := func(own int) time.Duration { // 1,000 tokens: 450 ms
		return 50*time.Millisecond + time.Duration(own)*400*time.Microsecond
	}
	unknown := func(int) time.Duration { return 0 }
	cold := Decision{Endpoint: e, PrefixKey: 1, PromptTokens: 1000, Prefill: 1000, distance: -1}
	warm := cold
	warm.Prefill = 40
	for _, tc := range []struct {
		name    string
		d       Decision
		ttft    time.Duration
		predict func(int) time.Duration
		want    bool
	}{
		{"cold as estimated", cold, 460 * time.Millisecond, predict, false},
		{"warm as estimated", warm, 70 * time.Millisecond, predict, false},
		{"estimated cold, served warm", cold, 70 * time.Millisecond, predict, true},
		{"estimated warm, computed", warm, 460 * time.Millisecond, predict, true},
		{"no costs yet", cold, 70 * time.Millisecond, unknown, false},
	} {
		if got := p.LearnTTFT(tc.d, 4000, tc.ttft, tc.predict); got != tc.want {
			t.Errorf("%s: contradicts %v, want %v", tc.name, got, tc.want)
		}
	}
}

// keepingOnePrompt returns a policy over two endpoints that both learned
// to keep one prompt, the first request of a 4k-token prompt (0.2 s to
// recompute; system(seed)) placed on home and another's on other.
func keepingOnePrompt(t *testing.T, seed int) (p *Prefix, set *discovery.Set, sysA string, home, other *discovery.Endpoint) {
	t.Helper()
	set = testSet(t, 2)
	p = newTestPrefix(DefaultPrefixParams())
	sysA = system(seed, 16384)
	home = p.Pick(request(sysA+"a"), set).Endpoint
	other = p.Pick(request(system(seed+1, 16384)+"a"), set).Endpoint
	if other == home {
		t.Fatal("two new prompts on two endpoints share one")
	}
	for _, e := range set.Endpoints {
		for range 3 {
			p.warm.outcome(e.ID, 1, false)
		}
		if k := p.Kept(e.ID); k != 1 {
			t.Fatalf("kept %d, want 1", k)
		}
	}
	return p, set, sysA, home, other
}

// On engines that keep one prompt each, a spill evicts the prompt kept
// where it lands, and that prompt's next request recomputes it: a spill
// must save more than that too. A home queued a little longer than the
// recompute keeps its request; one queued far longer spills it.
func TestSpillWeighsThePromptItEvicts(t *testing.T) {
	p, set, sysA, home, other := keepingOnePrompt(t, 50)
	release := occupy(home, 1, 8_000) // 0.4 s queued: a spill saves less than it costs
	if d := p.Pick(request(sysA+"b"), set); d.Endpoint != home || d.Reason != ReasonWarm {
		release()
		t.Fatalf("spilled onto the endpoint keeping another prompt for a 0.4 s queue: %+v", d)
	}
	release()
	defer occupy(home, 1, 30_000)() // 1.5 s queued
	if d := p.Pick(request(sysA+"c"), set); d.Endpoint != other || d.Reason != ReasonSpill {
		t.Fatalf("did not spill a 1.5 s queue: %+v", d)
	}
}

// A recurring key whose home, keeping one prompt, has since taken another
// is cold there as anywhere and evicts a prompt at either: when every slot
// of the home is busy, the home's queue alone decides. A short one keeps
// the request; a cold prefill's length spills it to the idle endpoint; a
// home with a slot free starts it at once and keeps it.
func TestColdAtAFullHomeSpillsPastItsQueue(t *testing.T) {
	p, set, sysA, home, other := keepingOnePrompt(t, 60)
	slots := func(n int) {
		for _, e := range set.Endpoints {
			e.SetCosts(&discovery.Costs{PrefillTokensPerSec: 20_000, PendingTokensPerSec: 20_000, BatchLimit: n})
		}
	}
	slots(1)
	if d := p.Pick(request(sysA+"b"), set); d.Endpoint != home || d.Reason != ReasonWarm {
		t.Fatalf("second request of the key: %+v", d)
	}
	p.warm.see(home.ID, 0xfeed) // another prompt took the home's one slot
	release := occupy(home, 1, 1_000)
	d := p.Pick(request(sysA+"c"), set)
	release()
	if d.Endpoint != home || d.Reason != ReasonCold {
		t.Fatalf("left a home queued 0.05 s for an endpoint keeping another prompt: %+v", d)
	}
	p.warm.see(home.ID, 0xfeed)
	defer occupy(home, 1, 8_000)() // 0.4 s queued: a cold prefill
	if d := p.Pick(request(sysA+"d"), set); d.Endpoint != other || d.Reason != ReasonCold {
		t.Fatalf("waited 0.4 s at a home that keeps another prompt: %+v", d)
	}
	p.warm.see(home.ID, 0xfeed)
	p.warm.see(other.ID, 0xbeef) // and the spill's copy is gone too
	slots(2)
	if d := p.Pick(request(sysA+"e"), set); d.Endpoint != home {
		t.Fatalf("left a home with a slot free: %+v", d)
	}
}

// A router alone keeps its homes when learned counts fall: a count bounds
// where new keys go and moves none (on Ollama servers with several slots
// the counts rose and fell, and every change moved homes).
func TestAloneHomesStayWhenCountsFall(t *testing.T) {
	eps := testSet(t, 4).Mixed
	h := newHomes(time.Hour, time.Now)
	kept := []int{0, 0, 0, 0}
	var version uint64
	at := func(id uint64) int {
		return slices.IndexFunc(eps, func(e *discovery.Endpoint) bool { return e.ID == id })
	}
	h.kept = func(id uint64) int { return kept[at(id)] }
	h.keptVersion = func() uint64 { return version }
	homes := map[uint64]uint64{}
	for k := uint64(1); k <= 8; k++ {
		e, _, _ := h.lookup(k, eps, 1.1, true, false, true, turn{})
		h.placed(k, e, false)
		homes[k] = e
	}
	for k := uint64(1); k <= 8; k++ {
		if e, hk, _ := h.lookup(k, eps, 1.1, true, false, true, turn{}); !hk.recurring || e != homes[k] {
			t.Fatalf("key %d: recurring %v, home %x, first sent to %x", k, hk.recurring, e, homes[k])
		}
	}
	kept, version = []int{1, 1, 0, 0}, version+1
	for k := uint64(1); k <= 8; k++ {
		if e, _, _ := h.lookup(k, eps, 1.1, true, false, true, turn{}); e != homes[k] {
			t.Errorf("key %d moved from endpoint %d to %d when counts fell", k, at(homes[k]), at(e))
		}
	}
	if e, _, _ := h.lookup(100, eps, 1.1, false, false, true, turn{}); kept[at(e)] != 0 {
		t.Errorf("a new key went to endpoint %d, which keeps one prompt and homes two", at(e))
	}
}
