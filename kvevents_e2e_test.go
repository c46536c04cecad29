package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/app"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/routing"
)

// kvEventsBackends returns the fleet's URLs, each with its pod's KV-event
// publisher port (#kv-events=PORT: the pods share 127.0.0.1).
func kvEventsBackends(t *testing.T, fleet *sim.Fleet) []string {
	t.Helper()
	var out []string
	for i := range fleet.Len() {
		_, port, err := net.SplitHostPort(fleet.Pod(i).KVEventsAddr())
		if err != nil {
			t.Fatalf("pod %d publishes no KV events: %v", i, err)
		}
		out = append(out, fleet.URL(i)+"#kv-events="+port)
	}
	return out
}

// startEventsRig starts pods simulated pods of 256 KV blocks (4,096
// tokens) each, with a CPU tier of cpuBlocks (0: none), publishing their
// KV events, and kvroute dialing them, scraping every 100 ms.
func startEventsRig(t *testing.T, pods, cpuBlocks int) (*sim.Fleet, *faultRig, sim.Config) {
	t.Helper()
	faultLeakCheck(t)
	cfg := faultSimConfig()
	cfg.KVEventsPort = -1
	cfg.NumGPUBlocks = 256
	cfg.CPUBlocks = cpuBlocks
	fleet := startFaultFleet(t, pods, cfg)
	r := startFaultRig(t, kvEventsBackends(t, fleet), cfg.Model, func(c *app.Config) {
		c.ScrapeInterval = 100 * time.Millisecond
	})
	return fleet, r, cfg
}

// postDirect sends a one-token completion of prompt straight to the pod at
// url, as a client bypassing kvroute would.
func postDirect(t *testing.T, url, model, prompt string) {
	t.Helper()
	resp, err := http.Post(url+"/v1/completions", "application/json", bytes.NewReader([]byte(faultBody(model, prompt, 1, false))))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
}

// explainRoute asks the admin listener how it would route a completion of
// prompt: the matched blocks and cache source per endpoint URL.
func (r *faultRig) explainRoute(prompt string) map[string]routing.Term {
	r.t.Helper()
	resp, err := r.hc.Post("http://"+r.admin+"/debug/route?path=/v1/completions", "application/json",
		strings.NewReader(faultBody(r.model, prompt, 1, false)))
	if err != nil {
		r.t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct {
		Endpoints []routing.Term `json:"endpoints"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		r.t.Fatal(err)
	}
	terms := make(map[string]routing.Term)
	for _, t := range out.Endpoints {
		terms[t.Endpoint] = t
	}
	return terms
}

// TestKVEventsEngineTruth: kvroute subscribed to two simulated pods' KV
// events (vLLM's wire format) learns which pod holds a prompt from the
// engine (a store, linked through one tokenize request), and forgets it
// there when the engine clears its cache or evicts it for other clients'
// prompts, which kvroute never saw.
func TestKVEventsEngineTruth(t *testing.T) {
	fleet, r, cfg := startEventsRig(t, 2, 0)                                             // 4,096 tokens a pod: five 2 KiB prompts overflow it
	prompt := strings.Repeat("Engines announce what they cache; kvroute listens. ", 170) // 8.5 KiB: 8 index blocks
	if res := r.do(prompt, 2, false); !res.completed() {
		t.Fatalf("first request: %v", res)
	}
	// The pod that computed it announces the blocks; kvroute tokenizes the
	// prompt once and links them: that pod is warm on engine truth.
	var warm string
	defer func() {
		if warm == "" {
			for _, n := range []string{"kvroute_kv_truth_confirmed_total", "kvroute_kv_event_batches_total", "kvroute_kv_truth_links", "kvroute_kv_truth_orphan_blocks_total"} {
				t.Logf("%s %v", n, r.metric(n))
			}
			t.Logf("tokenize ok %v error %v dropped %v", r.metric("kvroute_tokenize_requests_total", "outcome=ok"), r.metric("kvroute_tokenize_requests_total", "outcome=error"), r.metric("kvroute_tokenize_requests_total", "outcome=dropped"))
			t.Logf("route %+v", r.explainRoute(prompt))
		}
	}()
	r.waitFor("the prompt confirmed by engine truth", func() bool {
		if r.metric("kvroute_kv_truth_confirmed_total") == 0 || r.metric("kvroute_tokenize_requests_total", "outcome=ok") != 1 {
			return false
		}
		for u, term := range r.explainRoute(prompt) {
			if term.MatchedBlocks >= 8 && term.CacheSource == "events" {
				warm = u
			}
		}
		return warm != ""
	})
	pod := 0
	if fleet.URL(1) == warm {
		pod = 1
	}

	// The engine empties its cache: within a second its prompt is gone
	// from kvroute's view.
	if err := fleet.Pod(pod).ResetPrefixCache(context.Background()); err != nil {
		t.Fatal(err)
	}
	cleared := time.Now()
	r.waitFor("the cleared cache seen", func() bool { return r.explainRoute(prompt)[warm].MatchedBlocks == 0 })
	if d := time.Since(cleared); d > 3*time.Second {
		t.Errorf("the cleared cache was seen after %s, want within a second", d)
	} else {
		t.Logf("cleared cache seen after %s", d.Round(time.Millisecond))
	}

	// Computed there again, then evicted by other clients' prompts sent to
	// the pod directly: the removals drop it from kvroute's view.
	direct := func(p string) { postDirect(t, fleet.URL(pod), cfg.Model, p) }
	direct(prompt)
	r.waitFor("the prompt stored again", func() bool { return r.explainRoute(prompt)[warm].MatchedBlocks >= 8 })
	for i := range 6 {
		direct(strings.Repeat(string(rune('a'+i))+"nother client's prompt fills the cache. ", 200))
	}
	r.waitFor("the evicted prompt dropped", func() bool { return r.explainRoute(prompt)[warm].MatchedBlocks < 8 })
	if r.metric("kvroute_kv_truth_dropped_total") == 0 || r.metric("kvroute_kv_events_total", "kind=removed") == 0 {
		t.Fatal("no removal counted")
	}
}

// TestKVEventsTiersCostALoad: a pod with a CPU tier (vLLM's offloading)
// keeps a prompt the GPU evicted for other clients' prompts; kvroute shows
// it still held there, as tokens to load rather than to compute, and its
// wait there is below a recompute's.
func TestKVEventsTiersCostALoad(t *testing.T) {
	fleet, r, cfg := startEventsRig(t, 1, 2048)
	prompt := strings.Repeat("Offloaded blocks load faster than they compute. ", 180) // 8.6 KiB: 8 index blocks
	if res := r.do(prompt, 2, false); !res.completed() {
		t.Fatalf("first request: %v", res)
	}
	url := fleet.URL(0)
	r.waitFor("the prompt confirmed on the GPU", func() bool {
		term := r.explainRoute(prompt)[url]
		return term.MatchedBlocks >= 8 && term.LoadedTokens == 0
	})
	onGPU := r.explainRoute(prompt)[url]
	for i := range 6 {
		postDirect(t, url, cfg.Model, strings.Repeat(string(rune('a'+i))+"nother client's prompt fills the GPU. ", 200))
	}
	r.waitFor("the prompt held on CPU only", func() bool {
		term := r.explainRoute(prompt)[url]
		return term.MatchedBlocks >= 8 && term.LoadedTokens > 0
	})
	term := r.explainRoute(prompt)[url]
	recompute := float64(term.LoadedTokens) / term.PrefillTokensPerSec
	if load := float64(term.LoadedTokens) / term.LoadTokensPerSec; !(load < recompute) {
		t.Fatalf("loading %d tokens costs %.4f s, recomputing them %.4f s", term.LoadedTokens, load, recompute)
	}
	if term.UncachedTokens != onGPU.UncachedTokens {
		t.Errorf("uncached tokens %d on CPU, %d on GPU: the CPU copy should count as cached", term.UncachedTokens, onGPU.UncachedTokens)
	}
	if r.metric("kvroute_kv_truth_blocks", "tier=cpu") == 0 {
		t.Error("no CPU block counted")
	}
}
