package report

import (
	"strings"
	"testing"

	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/scenario"
)

// The local scenarios' table gives TTFT mean and p90 with their ratios to
// fixed affinity, and the failures.
func TestReferenceTable(t *testing.T) {
	run := func(label string, mean, p90 float64, failed int) *load.Result {
		return &load.Result{Label: label, Summary: load.Summary{Requests: 100, Failed: failed,
			Errors: map[string]int{"http_502": failed}, TTFT: load.Dist{Mean: mean, P90: p90}}}
	}
	got := ReferenceTable([]*load.Result{run("round-robin", 300, 600, 2), run(scenario.FixedAffinity, 100, 200, 0)})
	for _, want := range []string{"| TTFT mean | TTFT p90 | mean vs fixed-affinity | p90 vs fixed-affinity |",
		"| round-robin | 100 | 300 ms | 600 ms | 3.00× | 3.00× | – | 2 (http_502 2) |",
		"| fixed-affinity | 100 | 100 ms | 200 ms | 1.00× | 1.00× | – | 0 |"} {
		if !strings.Contains(got, want) {
			t.Errorf("table lacks %q:\n%s", want, got)
		}
	}
}

// The rounds table gives each round's ratios to fixed affinity and the
// most cores any of its runs found busy outside the benchmark ("–" where
// unknown), so that a round another job disturbed shows.
func TestRoundsTableShowsOtherProcesses(t *testing.T) {
	busy := 0.8
	rr := func(label string, mean, p90 float64, outside *float64) scenario.RoundRun {
		return scenario.RoundRun{Label: label, Requests: 100, TTFTMean: mean, TTFTP90: p90, Outside: outside}
	}
	quiet := 0.01
	rep := &scenario.Report{Runs: []*load.Result{{Label: "prefix"}, {Label: scenario.FixedAffinity}},
		Rounds: []scenario.Round{
			{Seed: 1, Runs: []scenario.RoundRun{rr("prefix", 30, 40, &busy), rr(scenario.FixedAffinity, 20, 20, &quiet)}},
			{Seed: 2, Runs: []scenario.RoundRun{rr("prefix", 20, 20, nil), rr(scenario.FixedAffinity, 20, 20, nil)}},
		}}
	got := RoundsTable(rep)
	for _, want := range []string{"| round (seed) | prefix | other processes |", "| 1 (1) | 1.50× / 2.00× | 0.80 |",
		"| 2 (2) | 1.00× / 1.00× | – |", "| median | 1.25× / 1.50× | |"} {
		if !strings.Contains(got, want) {
			t.Errorf("table lacks %q:\n%s", want, got)
		}
	}
}
