package app

import (
	"bufio"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/bench/sim"
)

// engineHits returns the prefix-cache hit and queried tokens of the
// fleet's engines (their own counters).
func engineHits(t *testing.T, fleet *sim.Fleet) (hits, queries float64) {
	t.Helper()
	for i := range len(fleet.URLs()) {
		mfs, err := fleet.Pod(i).Registry().Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				switch mf.GetName() {
				case "vllm:prefix_cache_hits_total":
					hits += m.GetCounter().GetValue()
				case "vllm:prefix_cache_queries_total":
					queries += m.GetCounter().GetValue()
				}
			}
		}
	}
	return hits, queries
}

// Four engines that each keep one prompt cached (one sequence slot, a KV
// cache for one prompt) and report usage without cached tokens, as stock
// Ollama servers do, behind the router with default flags; four prompt groups in
// random order, one request at a time. The router learns from the times
// to first token which answers were served warm and that each engine keeps
// one prompt, and gives each group an engine of its own: the engines serve
// nearly every prompt of the last half from cache. Each group gets its
// engine from its first request on (homes.placeAlone): over the whole run
// the engines miss about as often as they would for a client sending group g
// to engine g. (Homed by load factor alone, two of four groups share an
// engine as often as not, and each of their requests evicts the other's
// prompt; placed by rendezvous alone, they did so until the router had
// learned what the engines keep.)
func TestRouterLearnsEnginesThatKeepOnePrompt(t *testing.T) {
	cfg := sim.DefaultConfig()
	cfg.NumGPUBlocks = 70 // 1,120 tokens: one prompt of ~1,040, and nothing of the one before
	cfg.MaxNumSeqs = 1
	cfg.PrefillTokensPerSec = 20000 // a cold prompt ≈ 50 ms, a warm one a few
	cfg.NoCachedTokens = true
	fleet := startSimFleet(t, 4, cfg)
	rc := DefaultConfig()
	rc.Backends, rc.AccessLog = fleet.URLs(), false
	rt, url := startRouter(t, rc)

	rng := rand.New(rand.NewPCG(3, 4))
	send := func(group, i int) {
		prompt := strings.Repeat(fmt.Sprintf("Group %d keeps its own long instructions here. ", group), 90) + fmt.Sprintf("Question %d?", i)
		body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":4,"stream":true,"stream_options":{"include_usage":true}}`, cfg.Model, prompt)
		resp, err := testClient.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	const n = 160
	var h0, q0 float64
	misses := 0 // requests the engine served less than half from cache
	for i := range n {
		hb, qb := engineHits(t, fleet)
		if i == n/2 {
			h0, q0 = hb, qb
		}
		send(rng.IntN(4), i)
		if ha, qa := engineHits(t, fleet); 2*(ha-hb) < qa-qb {
			misses++
		}
	}
	h1, q1 := engineHits(t, fleet)
	rate := (h1 - h0) / (q1 - q0)
	t.Logf("engine hit rate over the last %d requests: %.2f; %d of %d requests missed", n/2, rate, misses, n)
	for _, e := range rt.Pool.Load().Endpoints {
		t.Logf("%s: %d requests, keeps %d prompts (0: unknown)", e.URL, e.Requests(), rt.Prefix.Kept(e.ID))
	}
	// Every request the engines run is this router's: it is alone. (A
	// scrape answered while a request ended once read as another client's
	// request, and the router, taking itself for one of several, moved
	// its homes: 6 or 7 misses in a third of runs.)
	if f := rt.Prefix.Foreign(); f != 0 {
		t.Errorf("learned share of other clients' requests %.3f, want 0", f)
	}
	if rate < 0.85 {
		t.Errorf("engine hit rate %.2f over the last %d requests, want ≥ 0.85 (each group on an engine of its own)", rate, n/2)
	}
	// A client sending group g to engine g misses 4 times, once per group;
	// so does a router that gives each new group an engine of its own.
	if misses > 5 {
		t.Errorf("%d of %d requests missed, want at most 5 (one per group, and one to spare)", misses, n)
	}
}
