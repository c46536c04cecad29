package peers

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

func testSet(t *testing.T, n int) *discovery.Set {
	t.Helper()
	var pool discovery.Pool
	var eps []*discovery.Endpoint
	for i := 0; i < n; i++ {
		e, err := discovery.NewEndpoint(fmt.Sprintf("http://10.1.0.%d:8000", i+1), discovery.RoleMixed)
		if err != nil {
			t.Fatal(err)
		}
		eps = append(eps, e)
	}
	return pool.Publish(eps)
}

func request(text string) *routing.Request {
	var h prefix.Hasher
	h.Reset(1024, 256, prefix.Seed("m", ""))
	_, _ = h.WriteString(text)
	return &routing.Request{Kind: routing.KindCompletions, PromptBytes: len(text), PromptTokens: len(text) / 4, Hashes: h.Hashes}
}

// prompt is a family's 8 KiB system prompt (8 blocks) and a short question.
func prompt(family, question int) string {
	return strings.Repeat(fmt.Sprintf("system prompt %d. ", family), 600)[:8192] + fmt.Sprintf(" question %d", question)
}

// longPrompt is a family's 8 KiB system prompt and a 2 KiB question: 10
// blocks, 8 of them shared with the family.
func longPrompt(family, question int) string {
	return prompt(family, 0)[:8192] + strings.Repeat(fmt.Sprintf("question %d. ", question), 200)[:2048]
}

type picker interface {
	Pick(*routing.Request, *discovery.Set) routing.Decision
}

// Every peer sends a repeated prefix back where it went, while idle.
func TestPeersFollowTheirCache(t *testing.T) {
	shuffled := NewTokenLoad(1024, 1760, 1)
	shuffled.ShuffleTies = true
	for _, tc := range []struct {
		name string
		p    picker
	}{
		{name: "sglang cache_aware", p: NewCacheAware()},
		{name: "gie blend", p: NewBlend(1024, 1)},
		{name: "llm-d token-load", p: NewTokenLoad(1024, 1760, 1)},
		{name: "llm-d token-load, shuffled ties", p: shuffled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := testSet(t, 4)
			first := tc.p.Pick(request(prompt(1, 0)), set)
			for q := 1; q < 10; q++ {
				if d := tc.p.Pick(request(prompt(1, q)), set); d.Endpoint != first.Endpoint {
					t.Fatalf("question %d went to %s, the prefix is on %s", q, d.Endpoint, first.Endpoint)
				}
			}
		})
	}
}

// New prefixes at low load spread over the whole fleet: ties are not
// broken by Set order (the old llm-d port put 64 groups on 5 of 8 pods).
func TestNewGroupsCoverTheFleet(t *testing.T) {
	shuffled := NewTokenLoad(1024, 1760, 7)
	shuffled.ShuffleTies = true
	for _, tc := range []struct {
		name string
		p    picker
		even bool // exactly 8 groups per endpoint
	}{
		{name: "llm-d token-load", p: NewTokenLoad(1024, 1760, 7), even: true},
		{name: "llm-d token-load, shuffled ties", p: shuffled},
		{name: "gie blend", p: NewBlend(1024, 7)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := testSet(t, 8)
			per := map[*discovery.Endpoint]int{}
			for g := 0; g < 64; g++ {
				per[tc.p.Pick(request(prompt(g, 0)), set).Endpoint]++
			}
			if len(per) != 8 {
				t.Fatalf("64 groups on %d of 8 endpoints: %v", len(per), per)
			}
			for e, n := range per {
				if tc.even && n != 8 {
					t.Fatalf("%s got %d groups, want 8 (round-robin ties): %v", e, n, per)
				}
			}
		})
	}
}

// The max-score picker's counter rotates through the tied endpoints in Set
// order; shuffled ties replay with the same seed.
func TestTokenLoadTieBreaks(t *testing.T) {
	set := testSet(t, 4)
	p := NewTokenLoad(1024, 1760, 1)
	for g := 0; g < 8; g++ {
		if d := p.Pick(request(prompt(g, 0)), set); d.Endpoint != set.Mixed[g%4] {
			t.Fatalf("group %d went to %s, want %s", g, d.Endpoint, set.Mixed[g%4])
		}
	}
	draw := func() []*discovery.Endpoint {
		p := NewTokenLoad(1024, 1760, 42)
		p.ShuffleTies = true
		var out []*discovery.Endpoint
		for g := 0; g < 16; g++ {
			out = append(out, p.Pick(request(prompt(g, 0)), set).Endpoint)
		}
		return out
	}
	a, b := draw(), draw()
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("seeded draws differ at %d: %v vs %v", i, a, b)
		}
	}
}

// The prefix-cache-affinity filter: sticky at a score of 0.8, all kept
// with no sticky endpoint or past the 18 s TTFT penalty (in-flight
// uncached tokens at 19,000 tokens/s).
func TestTokenLoadFilter(t *testing.T) {
	for _, tc := range []struct {
		name       string
		cached     int   // blocks of the 10-block request the first endpoint holds
		ahead      int64 // pending prefill tokens on the first endpoint
		wantFirst  bool
		wantReason string
	}{
		{name: "nothing cached", cached: 0, wantReason: ReasonNoMatch},
		// Not sticky, but the scorer still counts the 768 tokens left to compute.
		{name: "score 0.7 is not sticky", cached: 7, wantFirst: true, wantReason: ReasonNoMatch},
		{name: "score 0.8 is sticky", cached: 8, wantFirst: true, wantReason: ReasonSticky},
		{name: "sticky at 17 s of queued prefill", cached: 10, ahead: 17 * 19_000, wantFirst: true, wantReason: ReasonSticky},
		{name: "the gate opens at 19 s", cached: 10, ahead: 19 * 19_000, wantReason: ReasonLoadOverride},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := testSet(t, 2)
			p := NewTokenLoad(1024, 1760, 1)
			p.turn = 1 // an idle tie would go to the second endpoint
			r := request(longPrompt(1, 1))
			first := set.Mixed[0]
			p.idx.Record(first.ID, r.Hashes[:tc.cached])
			l := first.Acquire(int(tc.ahead))
			defer l.Release()
			d := p.Pick(r, set)
			if d.Reason != tc.wantReason || (d.Endpoint == first) != tc.wantFirst {
				t.Fatalf("went to the first endpoint: %v (%s), want %v (%s)", d.Endpoint == first, d.Reason, tc.wantFirst, tc.wantReason)
			}
		})
	}
}

// When the gate opens every endpoint is scored, sticky or not, by its
// in-flight uncached tokens plus the request's own uncached tokens: a
// partly warm endpoint beats the one with the shortest queue.
func TestTokenLoadGateKeepsEveryEndpoint(t *testing.T) {
	set := testSet(t, 3)
	p := NewTokenLoad(1024, 1760, 1)
	r := request(longPrompt(1, 1)) // 10 blocks, 2,560 tokens
	hot, cold, warm := set.Mixed[0], set.Mixed[1], set.Mixed[2]
	p.idx.Record(hot.ID, r.Hashes)
	p.idx.Record(warm.ID, r.Hashes[:7]) // 0.7: not sticky; 768 tokens to compute
	leases := []discovery.Lease{hot.Acquire(400_000), cold.Acquire(100), warm.Acquire(1_000)}
	defer release(leases)
	// cold: 100 + 2,560; warm: 1,000 + 768.
	d := p.Pick(r, set)
	if d.Reason != ReasonLoadOverride || d.Endpoint != warm || d.MatchedBlocks != 7 || d.Prefill != r.PromptTokens-7*256 {
		t.Fatalf("%+v, want the warm endpoint after the gate opened", d)
	}
}

// Among sticky endpoints the scorer counts the request's own uncached
// tokens: the endpoint holding more of the prompt wins at equal load, and
// loses once its queue outweighs the difference.
func TestTokenLoadCountsOwnUncachedTokens(t *testing.T) {
	set := testSet(t, 2)
	p := NewTokenLoad(1024, 1760, 1)
	r := request(longPrompt(1, 1))
	all, most := set.Mixed[0], set.Mixed[1]
	p.idx.Record(all.ID, r.Hashes)
	p.idx.Record(most.ID, r.Hashes[:8]) // sticky too; 512 more tokens to compute
	if d := p.Pick(r, set); d.Endpoint != all || d.Reason != ReasonSticky || d.Prefill != 0 {
		t.Fatalf("idle: %+v", d)
	}
	l := all.Acquire(600)
	defer l.Release()
	if d := p.Pick(r, set); d.Endpoint != most || d.Reason != ReasonSticky || d.Prefill != 512 {
		t.Fatalf("600 tokens queued on the full match: %+v", d)
	}
}

func TestCacheAwareBalancesWhenImbalanced(t *testing.T) {
	set := testSet(t, 2)
	p := NewCacheAware()
	first := p.Pick(request(prompt(1, 0)), set)
	leases := occupy(first.Endpoint, 100) // max−min 100 > 64 and 100 > 0×1.5
	defer release(leases)
	if d := p.Pick(request(prompt(1, 1)), set); d.Endpoint == first.Endpoint || d.Reason != ReasonBalance {
		t.Fatalf("imbalanced: %+v", d)
	}
	release(leases[:50]) // 50 ≤ 64: back to the cache
	if d := p.Pick(request(prompt(1, 2)), set); d.Reason != ReasonCacheHit {
		t.Fatalf("balanced: %+v", d)
	}
}

// A prefix every worker holds goes to a worker fixed per prefix, not to the
// first in Set order: SGLang takes the first tenant of the tree node.
func TestCacheAwareTiesFollowTheNode(t *testing.T) {
	set := testSet(t, 4)
	p := NewCacheAware()
	per := map[*discovery.Endpoint]int{}
	for g := 0; g < 32; g++ {
		r := request(prompt(g, 0))
		for _, e := range set.Mixed {
			p.idx.Record(e.ID, r.Hashes)
		}
		d := p.Pick(r, set)
		if d.Reason != ReasonCacheHit {
			t.Fatalf("group %d: %+v", g, d)
		}
		if again := p.Pick(request(prompt(g, 1)), set); again.Endpoint != d.Endpoint {
			t.Fatalf("group %d moved from %s to %s", g, d.Endpoint, again.Endpoint)
		}
		per[d.Endpoint]++
	}
	if len(per) < 3 {
		t.Fatalf("32 shared prefixes on %d of 4 workers: %v", len(per), per)
	}
}

// The classic blend reads the engines' scraped queues and KV usage: a full
// prefix match (3) outweighs the longest queue (0 of 2), not a nearly full
// KV cache as well.
func TestBlendTradesPrefixForQueueAndKV(t *testing.T) {
	set := testSet(t, 2)
	p := NewBlend(1024, 1)
	first := p.Pick(request(prompt(1, 0)), set).Endpoint
	other := set.Mixed[0]
	if other == first {
		other = set.Mixed[1]
	}
	other.SetEngine(&discovery.EngineStats{})
	// Cached: 3 + 2×0 + 2×1 = 5; idle but cold: 0 + 2 + 2 = 4.
	first.SetEngine(&discovery.EngineStats{Waiting: 10})
	if d := p.Pick(request(prompt(1, 1)), set); d.Endpoint != first {
		t.Fatalf("full prefix match lost to the queue: %+v", d)
	}
	// Cached: 3 + 0 + 2×0.1 = 3.2 < 4.
	first.SetEngine(&discovery.EngineStats{Waiting: 10, KVUsage: 0.9})
	if d := p.Pick(request(prompt(1, 2)), set); d.Endpoint != other {
		t.Fatalf("a long queue and a full KV cache kept the request: %+v", d)
	}
}

// GIE's prefix scorer looks at the first 4,096 tokens only (256 blocks of
// 16): 16 blocks of 1 KiB.
func TestBlendMatchesTheFirst4096Tokens(t *testing.T) {
	set := testSet(t, 2)
	p := NewBlend(1024, 1)
	head := strings.Repeat("a shared head. ", 2000)[:16<<10]
	first := p.Pick(request(head+strings.Repeat("tail one. ", 1000)), set)
	r := request(head + strings.Repeat("tail two. ", 1000))
	d := p.Pick(r, set)
	if d.Endpoint != first.Endpoint || d.MatchedBlocks != 16 || d.Prefill != r.PromptTokens-16*256 {
		t.Fatalf("%+v: want the 16 head blocks matched in full on %s", d, first.Endpoint)
	}
}

// GIE's and llm-d's indexes size each pod's LRU from its scraped KV
// capacity (autoTune): two blocks' worth keeps two blocks of a prompt.
func TestIndexesFollowTheScrapedCapacity(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    picker
	}{
		{name: "gie blend", p: NewBlend(1024, 1)},
		{name: "llm-d token-load", p: NewTokenLoad(1024, 1760, 1)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := testSet(t, 2)
			for _, e := range set.Mixed {
				e.SetEngine(&discovery.EngineStats{KVCapacityTokens: 2 * 256})
			}
			first := tc.p.Pick(request(prompt(1, 0)), set)
			if d := tc.p.Pick(request(prompt(1, 1)), set); d.Endpoint != first.Endpoint || d.MatchedBlocks != 2 {
				t.Fatalf("%+v: want 2 of 8 blocks left on %s", d, first.Endpoint)
			}
		})
	}
}

// The peers are safe for concurrent use (run with -race).
func TestPeersConcurrentPicks(t *testing.T) {
	for _, p := range []picker{NewCacheAware(), NewBlend(1024, 1), NewTokenLoad(1024, 1760, 1)} {
		set := testSet(t, 4)
		var wg sync.WaitGroup
		for w := 0; w < 4; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; i < 50; i++ {
					d := p.Pick(request(prompt(i%8, w)), set)
					l := d.Endpoint.Acquire(d.Prefill)
					l.Release()
				}
			}()
		}
		wg.Wait()
	}
}

// occupy claims e for n requests, as the proxy's leases would.
func occupy(e *discovery.Endpoint, n int) []discovery.Lease {
	ls := make([]discovery.Lease, n)
	for i := range ls {
		ls[i] = e.Acquire(0)
	}
	return ls
}

func release(ls []discovery.Lease) {
	for i := range ls {
		ls[i].Release()
	}
}
