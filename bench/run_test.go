package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/bench/sim"
)

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
	w := build(t, WorkloadConfig{Kind: KindRandom, Seed: 2, Requests: 40, InputTokens: 3000, OutputTokens: 8})
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
	w := build(t, WorkloadConfig{Kind: KindMultiTurn, Seed: 2, Conversations: 4, TurnsMin: 3, TurnsMax: 4,
		PrefixTokens: 100, UserMin: 20, UserMax: 30, AnswerMin: 10, AnswerMax: 12})
	res, err := Run(context.Background(), Config{
		BaseURL: fleet.URL(0), PodURLs: fleet.URLs(), API: APIChat, Workload: w,
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

func TestRunScenarioEndToEnd(t *testing.T) {
	sc := Scenario{
		Name: "tiny-shared-prefix", Description: "test", Pods: 2,
		Sim:        sim.Config{TimeScale: 50, NumGPUBlocks: 256, Seed: 1},
		WorkingSet: 4 * 256,
		Workload: WorkloadConfig{Kind: KindSharedPrefix, Seed: 4, Groups: 4, PromptsPerGroup: 4,
			SystemTokens: 256, QuestionTokens: 32, OutputTokens: 16},
		Load: Load{Stages: []Stage{{Rate: 10, Requests: 8}, {Rate: 20, Requests: 8}}},
		SLO:  SLO{TTFT: 2000},
	}
	var log strings.Builder
	rep, err := RunScenario(context.Background(), sc, RunOptions{Log: &log})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	files, err := WriteReport(dir, rep)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) != len(Policies()) {
		t.Fatalf("%d runs, want one per policy", len(rep.Runs))
	}
	for _, r := range rep.Runs {
		if r.Summary.Completed != 16 || r.Summary.Failed != 0 {
			t.Errorf("%s: completed %d, failed %d %v", r.Label, r.Summary.Completed, r.Summary.Failed, r.Summary.Errors)
		}
		if len(r.Stages) != 2 || r.Engine == nil || r.Engine.PrefixQueries == 0 {
			t.Errorf("%s: %d stages, engine %+v", r.Label, len(r.Stages), r.Engine)
		}
	}
	for _, name := range []string{FileTable, FileResults, FileTTFTCDF, FileThroughput, FileTTFTRate, "raw-round-robin.json"} {
		st, err := os.Stat(filepath.Join(dir, name))
		if err != nil || st.Size() == 0 {
			t.Errorf("%s not written (%v); wrote %v", name, err, files)
		}
	}
	table, _ := os.ReadFile(filepath.Join(dir, FileTable))
	for _, p := range Policies() {
		if !strings.Contains(string(table), "| "+p.Name+" |") {
			t.Errorf("table has no row for %s:\n%s", p.Name, table)
		}
	}
	var back struct {
		Runs []struct {
			Label   string
			Summary Summary
		}
		IdealHitRate float64 `json:"ideal_hit_rate"`
	}
	b, _ := os.ReadFile(filepath.Join(dir, FileResults))
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if len(back.Runs) != len(rep.Runs) || back.Runs[0].Summary.Completed != 16 || back.IdealHitRate <= 0 {
		t.Fatalf("results.json does not round-trip: %+v", back)
	}
	var raw []RequestResult
	b, _ = os.ReadFile(filepath.Join(dir, "raw-round-robin.json"))
	if err := json.Unmarshal(b, &raw); err != nil || len(raw) != 16 {
		t.Fatalf("raw records: %d, %v", len(raw), err)
	}
}

// Every built-in scenario, default and full, must describe a valid run: a
// workload that builds, a load that validates, pods whose KV holds the
// largest request, and the sizing rule (working set ≈ 70% of the fleet's
// KV, more than twice one pod's).
func TestPresets(t *testing.T) {
	trace := filepath.Join(t.TempDir(), "trace.jsonl")
	line := `{"timestamp": 0, "input_length": 40000, "output_length": 3000, "hash_ids": [` +
		strings.TrimSuffix(strings.Repeat("1, ", 79), ", ") + `]}` + "\n"
	if err := os.WriteFile(trace, []byte(line), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, full := range []bool{false, true} {
		scs := Scenarios(Preset{Full: full, TracePath: trace, Seed: 1})
		if len(scs) != len(ScenarioNames())-1 {
			t.Fatalf("full=%v: %d scenarios, want every name but overhead", full, len(scs))
		}
		for _, sc := range scs {
			t.Run(fmt.Sprintf("%s/full=%v", sc.Name, full), func(t *testing.T) {
				if sc.Pods != DefaultPods {
					t.Fatalf("%d pods", sc.Pods)
				}
				if err := sc.Load.Validate(); err != nil {
					t.Fatal(err)
				}
				cfg := sc.Sim
				if err := cfg.Validate(); err != nil {
					t.Fatal(err)
				}
				c := sc.Workload.Defaults()
				if err := c.Validate(); err != nil {
					t.Fatal(err)
				}
				largest := c.SystemTokens + c.QuestionTokens + c.InputTokens + c.OutputTokens + 16
				switch c.Kind {
				case KindMultiTurn:
					largest = c.PrefixTokens + c.TurnsMax*(c.UserMax+c.AnswerMax+16)
				case KindTrace:
					largest = c.TraceMaxInput + c.TraceMaxOutput
				}
				if kv := cfg.NumGPUBlocks * cfg.BlockSize; kv < 2*largest || largest+1 > cfg.MaxModelLen && c.Kind != KindMultiTurn {
					t.Fatalf("pod KV %d tokens for requests up to %d tokens (max model len %d)", kv, largest, cfg.MaxModelLen)
				}
				if sc.WorkingSet > 0 {
					sc.describeFleet()
					share := sc.Fleet.WorkingSetShare
					if share < 0.65 || share > 0.75 || share*float64(sc.Pods) < 2 {
						t.Fatalf("working set is %.2f of the fleet's KV, %.1f× one pod's", share, share*float64(sc.Pods))
					}
				}
			})
		}
	}
}
