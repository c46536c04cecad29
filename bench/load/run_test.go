package load

import (
	"context"
	"math"
	"testing"

	"github.com/kvroute/kvroute/bench/leakcheck"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/bench/workload"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

// startFleet starts n simulated pods for the test's lifetime.
func startFleet(t *testing.T, n int, cfg sim.Config) *sim.Fleet {
	t.Helper()
	f, err := sim.StartFleet(n, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := f.Close(); err != nil {
			t.Error(err)
		}
	})
	return f
}

// The generator's TTFT, measured at the client, must match the engine's own
// vllm:time_to_first_token_seconds histogram within that histogram's bucket
// width: the client adds only loopback and HTTP time.
func TestRunMatchesEngineTTFT(t *testing.T) {
	const scale = 4
	fleet := startFleet(t, 1, sim.Config{TimeScale: scale, Seed: 1})
	url := fleet.URL(0)
	before, err := ScrapeEngines(context.Background(), nil, []string{url})
	if err != nil {
		t.Fatal(err)
	}
	// 3,000-token prompts cost ≈ 170 ms of modelled prefill: TTFTs land
	// in the 0.1–0.25 s and 0.25–0.5 s buckets.
	w, err := workload.Config{Kind: workload.KindRandom, Seed: 2, Requests: 40, InputTokens: 3000, OutputTokens: 8}.Build()
	if err != nil {
		t.Fatal(err)
	}
	res, err := Run(context.Background(), Config{
		BaseURL: url, PodURLs: []string{url}, Model: sim.DefaultConfig().Model, Workload: w,
		Load: Load{Rate: 8}, TimeScale: scale, Seed: 3, Label: "direct",
	})
	if err != nil {
		t.Fatal(err)
	}
	s := res.Summary
	if s.Completed != 40 || s.Failed != 0 {
		t.Fatalf("completed %d, failed %d %v", s.Completed, s.Failed, s.Errors)
	}
	if s.OutputTokens != 40*8 || s.PromptTokens != 40*3000 {
		t.Fatalf("tokens %d out, %d in", s.OutputTokens, s.PromptTokens)
	}
	if res.Engine == nil || res.Engine.PrefixQueries != 40*3000 || res.Engine.HitRate != 0 {
		t.Fatalf("engine stats %+v (random prompts share nothing)", res.Engine)
	}
	after, err := ScrapeEngines(context.Background(), nil, []string{url})
	if err != nil {
		t.Fatal(err)
	}
	h := after.TTFT.Sub(before.TTFT)
	if h.Count != 40 {
		t.Fatalf("engine histogram counted %v requests", h.Count)
	}
	var ttfts []float64
	for _, r := range res.Requests {
		ttfts = append(ttfts, r.TTFT)
	}
	d := NewDist(ttfts)
	for _, tc := range []struct {
		name   string
		q      float64
		client float64 // seconds
	}{
		{name: "p50", q: 0.5, client: d.P50 / 1e3},
		{name: "p90", q: 0.9, client: d.P90 / 1e3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eng, lo, hi := h.Quantile(tc.q)
			if math.IsNaN(eng) || math.Abs(tc.client-eng) > hi-lo {
				t.Fatalf("client %s TTFT %.4f s, engine histogram %.4f s (bucket %.3f–%.3f s)", tc.name, tc.client, eng, lo, hi)
			}
		})
	}
}

func TestRunMultiTurnClosedLoop(t *testing.T) {
	fleet := startFleet(t, 1, sim.Config{TimeScale: 100, Seed: 1})
	w, err := workload.Config{Kind: workload.KindMultiTurn, Seed: 2, Conversations: 4, TurnsMin: 3, TurnsMax: 4,
		PrefixTokens: 100, UserMin: 20, UserMax: 30, AnswerMin: 10, AnswerMax: 12}.Build()
	if err != nil {
		t.Fatal(err)
	}
	res, err := Run(context.Background(), Config{
		BaseURL: fleet.URL(0), PodURLs: fleet.URLs(), API: workload.APIChat, Workload: w,
		Load: Load{Arrival: ArrivalClosed, Concurrency: 2}, TimeScale: 100,
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Summary.Completed != w.Requests() || res.Summary.Failed != 0 {
		t.Fatalf("completed %d of %d: %v", res.Summary.Completed, w.Requests(), res.Summary.Errors)
	}
	// Every later turn resent its history: the engine found most of it.
	if res.Engine.HitRate < 0.5 || res.Summary.CachedRate < 0.5 {
		t.Fatalf("engine hit rate %.2f, reported cached %.2f: history not reused", res.Engine.HitRate, res.Summary.CachedRate)
	}
	last := map[int]int{}
	for _, r := range res.Requests {
		if prev, ok := last[r.Session]; ok && r.Turn != prev+1 {
			t.Fatalf("session %d: turn %d after %d", r.Session, r.Turn, prev)
		}
		last[r.Session] = r.Turn
	}
}
