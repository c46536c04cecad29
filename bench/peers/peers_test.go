package peers

import (
	"fmt"
	"strings"
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

func prompt(family, question int) string {
	return strings.Repeat(fmt.Sprintf("system prompt %d. ", family), 600)[:8192] + fmt.Sprintf(" question %d", question)
}

type picker interface {
	Pick(*routing.Request, *discovery.Set) routing.Decision
}

// Every peer sends a repeated prefix back where it went, while idle.
func TestPeersFollowTheirCache(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    picker
	}{
		{name: "sglang cache_aware", p: NewCacheAware()},
		{name: "gie blend", p: NewBlend(1)},
		{name: "llm-d sticky", p: NewSticky(1024, 1760)},
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

func TestBlendTradesPrefixForQueue(t *testing.T) {
	set := testSet(t, 2)
	p := NewBlend(1)
	first := p.Pick(request(prompt(1, 0)), set)
	// Cached but most loaded: 3×1 + 2×0 = 3; idle but cold: 0 + 2×1 = 2.
	// A full prefix match outweighs any queue imbalance in the classic blend.
	defer release(occupy(first.Endpoint, 10))
	if d := p.Pick(request(prompt(1, 1)), set); d.Endpoint != first.Endpoint {
		t.Fatalf("full prefix match lost to the queue: %+v", d)
	}
}

func TestStickyDropsStickinessPastThePenalty(t *testing.T) {
	set := testSet(t, 2)
	p := NewSticky(1024, 1760)
	first := p.Pick(request(prompt(1, 0)), set)
	l := first.Endpoint.Acquire(20000 * 19) // 19 s of prefill queued
	defer l.Release()
	if d := p.Pick(request(prompt(1, 1)), set); d.Endpoint == first.Endpoint || d.Reason != ReasonUnsticky {
		t.Fatalf("past the penalty: %+v", d)
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
