package proxy

import (
	"fmt"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// The engine's cached_tokens, read from the stream as it passes, is compared
// with the router's estimate; when the engine evicted earlier than the index
// modelled, the endpoint's modelled capacity shrinks.
func TestLearnsFromEngineCachedTokens(t *testing.T) {
	cfg := sim.DefaultConfig()
	cfg.TimeScale = 100
	cfg.NumGPUBlocks = 40 // 640 tokens: room for one 600-token prompt only
	fleet := startSimFleet(t, 1, cfg)
	idx := prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: 1000})
	policy := routing.NewPrefix(idx, 1024, routing.DefaultPrefixParams())
	h := startProxy(t, policy, Options{Learner: policy}, fleet.URLs()...)

	send := func(family int, stream bool) {
		prompt := strings.Repeat(fmt.Sprintf("family %d says hello to the cache. ", family), 80)[:2400]
		body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":4}`, cfg.Model, prompt)
		if stream {
			body = fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":4,"stream":true,"stream_options":{"include_usage":true}}`, cfg.Model, prompt)
		}
		resp := post(t, h.url+"/v1/completions", body)
		if got := readAll(t, resp); resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, got)
		}
		h.waitIdle(t)
	}
	outcome := func(o string) float64 {
		return counterValue(t, h.reg, "kvroute_prefix_estimates_total", map[string]string{"outcome": o})
	}
	send(1, true)  // cold: estimate 0, engine 0
	send(1, false) // warm: both agree
	if outcome("exact") != 2 || outcome("over") != 0 {
		t.Fatalf("estimates: exact %v over %v", outcome("exact"), outcome("over"))
	}
	if e, g := counterValue(t, h.reg, "kvroute_prefix_engine_cached_tokens_total", nil), counterValue(t, h.reg, "kvroute_prefix_estimated_cached_tokens_total", nil); e == 0 || g == 0 {
		t.Fatalf("engine %v estimated %v cached tokens", e, g)
	}
	send(2, true) // evicts family 1 in the engine, not in the index
	send(1, true) // the index claims family 1; the engine recomputes it
	if outcome("over") != 1 {
		t.Fatalf("over-estimates %v", outcome("over"))
	}
	ep := h.pool.Load().Endpoints[0]
	if eff := idx.Correct(ep.ID, false); eff >= 1000 {
		t.Fatalf("effective capacity %d: not lowered by the over-estimate", eff)
	}
}
