package scenario_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/report"
	"github.com/kvroute/kvroute/bench/scenario"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/bench/workload"
)

// A tiny shared-prefix comparison of every policy, end to end: the runs,
// and the files bench/report writes from them.
func TestRunScenarioEndToEnd(t *testing.T) {
	sc := scenario.Scenario{
		Name: "tiny-shared-prefix", Description: "test", Pods: 2,
		Sim:        sim.Config{TimeScale: 50, NumGPUBlocks: 256, Seed: 1},
		WorkingSet: 4 * 256,
		Workload: workload.Config{Kind: workload.KindSharedPrefix, Seed: 4, Groups: 4, PromptsPerGroup: 4,
			SystemTokens: 256, QuestionTokens: 32, OutputTokens: 16},
		Load: load.Load{Stages: []load.Stage{{Rate: 10, Requests: 8}, {Rate: 20, Requests: 8}}},
		SLO:  load.SLO{TTFT: 2000},
	}
	var log strings.Builder
	rep, err := scenario.Run(context.Background(), sc, scenario.RunOptions{Log: &log})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	files, err := report.Write(dir, rep)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) != len(scenario.Policies()) {
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
	for _, name := range []string{report.FileTable, report.FileResults, report.FileTTFTCDF, report.FileThroughput, report.FileTTFTRate, "raw-round-robin.json"} {
		st, err := os.Stat(filepath.Join(dir, name))
		if err != nil || st.Size() == 0 {
			t.Errorf("%s not written (%v); wrote %v", name, err, files)
		}
	}
	table, _ := os.ReadFile(filepath.Join(dir, report.FileTable))
	for _, p := range scenario.Policies() {
		if !strings.Contains(string(table), "| "+p.Name+" |") {
			t.Errorf("table has no row for %s:\n%s", p.Name, table)
		}
	}
	var back struct {
		Runs []struct {
			Label   string
			Summary load.Summary
		}
		IdealHitRate float64 `json:"ideal_hit_rate"`
	}
	b, _ := os.ReadFile(filepath.Join(dir, report.FileResults))
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if len(back.Runs) != len(rep.Runs) || back.Runs[0].Summary.Completed != 16 || back.IdealHitRate <= 0 {
		t.Fatalf("results.json does not round-trip: %+v", back)
	}
	var raw []load.RequestResult
	b, _ = os.ReadFile(filepath.Join(dir, "raw-round-robin.json"))
	if err := json.Unmarshal(b, &raw); err != nil || len(raw) != 16 {
		t.Fatalf("raw records: %d, %v", len(raw), err)
	}
}

// The near-identical comparison end to end: kvroute's detector counts
// exactly the requests sent with their group's system prompt rendered
// otherwise than its first, with and without --normalize-prompts (which
// leaves only the doubled spaces), the rewrite raises the engines' hit
// rate, and the table says so.
func TestNearIdenticalScenario(t *testing.T) {
	sc := scenario.Scenario{
		Name: "tiny-near-identical", Pods: 2,
		Sim: sim.Config{TimeScale: 5, NumGPUBlocks: 512, Seed: 1},
		Workload: workload.Config{Kind: workload.KindNearIdentical, Seed: 5, Groups: 4, PromptsPerGroup: 10,
			SystemTokens: 512, QuestionTokens: 32, OutputTokens: 8},
		// Evenly spaced sends, 8 ms apart in wall time: the detector sees
		// requests in send order.
		Load:     load.Load{Arrival: load.ArrivalConstant, Rate: 25},
		Policies: []string{"prefix", scenario.PrefixNormalized},
	}
	rep, err := scenario.Run(context.Background(), sc, scenario.RunOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) != 2 {
		t.Fatalf("%d runs", len(rep.Runs))
	}
	wl, _ := sc.Workload.Build()
	as, norm := rep.NearMisses["prefix"], rep.NearMisses[scenario.PrefixNormalized]
	if as.Truth != wl.NearIdentical(40, false) || norm.Truth != wl.NearIdentical(40, true) || norm.Truth >= as.Truth || norm.Truth == 0 {
		t.Fatalf("truths %d and %d, want the workload's (%d, %d), fewer once normalised, not none",
			as.Truth, norm.Truth, wl.NearIdentical(40, false), wl.NearIdentical(40, true))
	}
	if as.Counted != as.Truth || norm.Counted != norm.Truth {
		t.Errorf("kvroute counted %d (sent %d) as written and %d (sent %d) normalised", as.Counted, as.Truth, norm.Counted, norm.Truth)
	}
	for _, r := range rep.Runs {
		if r.Summary.Completed != 40 || r.Engine == nil {
			t.Fatalf("%s: completed %d, errors %v", r.Label, r.Summary.Completed, r.Summary.Errors)
		}
	}
	t.Logf("near misses %+v %+v, hit rates %.3f %.3f", as, norm, rep.Runs[0].Engine.HitRate, rep.Runs[1].Engine.HitRate)
	if h0, h1 := rep.Runs[0].Engine.HitRate, rep.Runs[1].Engine.HitRate; h1 <= h0 {
		t.Errorf("engine hit rate %.3f as written, %.3f normalised: the rewrite did not help", h0, h1)
	}
	if md := report.Markdown(rep); !strings.Contains(md, "kvroute_prompt_near_misses_total") {
		t.Errorf("table has no near-miss line:\n%s", md)
	}
}

// Rounds end to end: two rounds of two policies on bench/sim, each round
// with its own seed and the policies' order reversed in the second; the
// pooled runs hold both rounds' requests and engine counters, each
// round's figures are kept, and the table gives each round's ratios and
// their median.
func TestRounds(t *testing.T) {
	sc := scenario.Scenario{
		Name: "tiny-rounds", Pods: 2, Seed: 3,
		Sim: sim.Config{TimeScale: 5, NumGPUBlocks: 512, Seed: 1},
		Workload: workload.Config{Kind: workload.KindSharedPrefix, Seed: 3, Groups: 4, PromptsPerGroup: 5,
			SystemTokens: 256, QuestionTokens: 16, OutputTokens: 8},
		Load:     load.Load{Arrival: load.ArrivalConstant, Rate: 40},
		Policies: []string{scenario.FixedAffinity, "prefix"},
	}
	var log strings.Builder
	rep, err := scenario.Run(context.Background(), sc, scenario.RunOptions{Rounds: 2, Log: &log})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) != 2 || len(rep.Rounds) != 2 {
		t.Fatalf("%d pooled runs, %d rounds", len(rep.Runs), len(rep.Rounds))
	}
	if r0, r1 := rep.Rounds[0], rep.Rounds[1]; r0.Seed != 3 || r1.Seed != 4 ||
		r0.Runs[0].Label != rep.Runs[0].Label || r1.Runs[0].Label != rep.Runs[1].Label {
		t.Fatalf("rounds %+v", rep.Rounds)
	}
	for i, r := range rep.Runs {
		per := rep.Rounds[0].Runs[i].Requests + rep.Rounds[1].Runs[1-i].Requests
		if r.Summary.Completed != 40 || per != 40 || r.Engine == nil || r.Engine.PrefixQueries == 0 {
			t.Fatalf("%s: completed %d (rounds' %d), engine %+v", r.Label, r.Summary.Completed, per, r.Engine)
		}
		for j := 1; j < len(r.Requests); j++ {
			if r.Requests[j].Start < r.Requests[j-1].Start {
				t.Fatalf("%s: request %d starts before the one sent before it", r.Label, j)
			}
		}
	}
	if !strings.Contains(log.String(), "(seed 4)") {
		t.Errorf("log names no second seed:\n%s", log.String())
	}
	md := report.Markdown(rep)
	if !strings.Contains(md, "pool 2 rounds") || !strings.Contains(md, "| 2 (4) |") || !strings.Contains(md, "| median |") {
		t.Errorf("table without the rounds:\n%s", md)
	}
}
