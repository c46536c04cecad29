package routing

import (
	"testing"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/prefix"
)

func pdSet(t *testing.T) *discovery.Set {
	t.Helper()
	var pool discovery.Pool
	var eps []*discovery.Endpoint
	for _, e := range []struct {
		url  string
		role discovery.Role
	}{{"10.0.1.1:8000", discovery.RolePrefill}, {"10.0.0.1:8000", discovery.RoleMixed}, {"10.0.2.1:8000", discovery.RoleDecode},
		{"10.0.1.2:8000", discovery.RolePrefill}, {"10.0.2.2:8000", discovery.RoleDecode}} {
		ep, err := discovery.NewEndpoint(e.url, e.role)
		if err != nil {
			t.Fatal(err)
		}
		eps = append(eps, ep)
	}
	return pool.Publish(eps)
}

func TestPDThreshold(t *testing.T) {
	set := pdSet(t)
	e := set.Decode[0]
	d := PDDecider{Params: DefaultPrefixParams}
	if got := d.Threshold(e); got != 200 {
		t.Errorf("priors: threshold %d, want 20,000 tokens/s × 10 ms = 200", got)
	}
	d.BlockTokens = func() int { return 256 }
	if got := d.Threshold(e); got != 328 {
		t.Errorf("with a 256-token index block: threshold %d, want 200 + half a block", got)
	}
	d.BlockTokens = func() int { return 1024 }
	if got := d.Threshold(e); got != 1024 {
		t.Errorf("with a 1024-token index block: threshold %d, want the block", got)
	}
	d.BlockTokens = func() int { return 256 }
	e.SetCosts(&discovery.Costs{PrefillTokensPerSec: 10000, PendingTokensPerSec: 10000, DecodeStepSec: 0.05})
	if got := d.Threshold(e); got != 628 {
		t.Errorf("learned 10,000 tokens/s and a 50 ms step: threshold %d, want 500 + half a block", got)
	}
	d.Params = func() PrefixParams {
		p := DefaultPrefixParams()
		p.Pinned = []string{PinPrefillRate, PinDecodeCost}
		return p
	}
	if got := d.Threshold(e); got != 328 {
		t.Errorf("pinned priors: threshold %d, want 328", got)
	}
	d.MinUncachedTokens = 1000
	if split, th := d.Split(Decision{Endpoint: e, Prefill: 999}); split || th != 1000 {
		t.Errorf("flag 1000, 999 uncached: split %v at %d", split, th)
	}
	if split, _ := d.Split(Decision{Endpoint: e, Prefill: 1000}); !split {
		t.Error("flag 1000, 1000 uncached: not split")
	}
}

// Every policy picks a request's endpoint among those that answer clients
// (mixed and decode), and a prefill leg's among the prefill pool; the
// prefix policy homes a prefix apart in each.
func TestPoliciesPickWithinTheRequestsGroup(t *testing.T) {
	set := pdSet(t)
	for name, mk := range Policies() {
		p := mk(PolicyConfig{BlockBytes: testBlock, Index: prefix.IndexConfig{BlocksPerEndpoint: 100_000}, Prefix: DefaultPrefixParams()})
		for i := range 20 {
			r := request(system(i, 4*testBlock))
			d := p.Pick(r, set)
			if d.Endpoint == nil || d.Endpoint.Role == discovery.RolePrefill {
				t.Fatalf("%s: request picked %v", name, d.Endpoint)
			}
			r.Prefill = true
			pd := p.Pick(r, set)
			if pd.Endpoint == nil || pd.Endpoint.Role != discovery.RolePrefill {
				t.Fatalf("%s: prefill leg picked %v", name, pd.Endpoint)
			}
			if name == "prefix" && pd.PrefixKey == d.PrefixKey {
				t.Fatalf("prefix: the prefill pool shares the serving pool's key %x", d.PrefixKey)
			}
		}
	}
}
