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
