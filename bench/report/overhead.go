package report

import (
	"fmt"
	"math"
	"strings"

	"github.com/kvroute/kvroute/bench/scenario"
)

// MarkdownOverhead renders the overhead table.
func MarkdownOverhead(rep *scenario.OverheadReport) string {
	var b strings.Builder
	b.WriteString("### overhead\n\n")
	fmt.Fprintf(&b, "Closed loop against an instant fasthttp backend (a fixed %d-chunk streamed completion), direct and through kvroute (%s), %s per measurement, %d-token prompts; E2E latency at the client.\n\n",
		rep.Config.OutputTokens, rep.Policy, rep.Config.Duration, rep.Config.PromptTokens)
	b.WriteString("| connections | direct req/s | via kvroute req/s | throughput ratio | direct p50 / p90 / p99 | via kvroute p50 / p90 / p99 | added p50 / p90 / p99 | errors |\n")
	b.WriteString("|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	us := func(v float64) string { // v in ms
		if math.Abs(v) < 1 {
			return fmt.Sprintf("%.0f µs", v*1e3)
		}
		return fmt.Sprintf("%.2f ms", v)
	}
	for _, r := range rep.Rows {
		d, v := r.Direct, r.Via
		fmt.Fprintf(&b, "| %d | %s | %s | %.2f | %s / %s / %s | %s / %s / %s | %s / %s / %s | %d / %d |\n",
			r.Concurrency, thousands(int(d.RequestThroughput)), thousands(int(v.RequestThroughput)), r.ThroughputRatio,
			us(d.E2EL.P50), us(d.E2EL.P90), us(d.E2EL.P99), us(v.E2EL.P50), us(v.E2EL.P90), us(v.E2EL.P99),
			us(r.AddedP50), us(r.AddedP90), us(r.AddedP99), d.Failed, v.Failed)
	}
	for _, r := range rep.Rows {
		if r.CPUVia.MachineIdle >= 0 {
			fmt.Fprintf(&b, "\nAt %d connections the machine was %.0f%% idle direct and %.0f%% through kvroute (%d cores; generator, kvroute and backend share them).",
				r.Concurrency, 100*r.CPUDirect.MachineIdle, 100*r.CPUVia.MachineIdle, r.CPUVia.Cores)
		}
	}
	b.WriteString("\n")
	return b.String()
}

// WriteOverhead writes table.md and results.json under dir (created if
// needed) and returns the paths written.
func WriteOverhead(dir string, rep *scenario.OverheadReport) ([]string, error) {
	return writeTableAndResults(dir, MarkdownOverhead(rep), rep)
}
