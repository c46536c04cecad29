package report

import (
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/kvroute/kvroute/bench/load"
)

// summaryWidth is the width of WriteServeSummary's rules, as in vLLM's
// `bench serve` output.
const summaryWidth = 50

// WriteServeSummary writes a vLLM `bench serve`-style summary of r, a run
// of a workload of the given kind, to w.
func WriteServeSummary(w io.Writer, r *load.Result, kind string) {
	s := r.Summary
	line := func(k string, v any) { fmt.Fprintf(w, "%-40s %v\n", k+":", v) }
	f2 := func(v float64) string { return strconv.FormatFloat(v, 'f', 2, 64) }
	fmt.Fprintln(w, center("Serving Benchmark Result", "="))
	line("Workload", fmt.Sprintf("%s (%s API), %d requests", kind, r.API, s.Requests))
	line("Successful requests", s.Completed)
	line("Failed requests", s.Failed)
	for k, n := range s.Errors {
		line("  "+k, n)
	}
	line("Benchmark duration (s)", f2(s.Duration))
	line("Total input tokens", s.PromptTokens)
	line("Total generated tokens", s.OutputTokens)
	line("Request throughput (req/s)", f2(s.RequestThroughput))
	line("Output token throughput (tok/s)", f2(s.OutputThroughput))
	line("Input token throughput (tok/s)", f2(s.InputThroughput))
	if !s.SLO.IsZero() {
		line("Request goodput (req/s)", f2(s.Goodput))
	}
	for _, d := range []struct {
		name string
		d    load.Dist
	}{{"Time to First Token", s.TTFT}, {"Time per Output Token (excl. 1st token)", s.TPOT},
		{"Inter-token Latency", s.ITL}, {"End-to-end Latency", s.E2EL}} {
		fmt.Fprintln(w, center(d.name, "-"))
		for _, p := range []struct {
			k string
			v float64
		}{{"Mean", d.d.Mean}, {"P50", d.d.P50}, {"P90", d.d.P90}, {"P99", d.d.P99}} {
			line(fmt.Sprintf("%s %s (ms)", p.k, strings.Split(d.name, " (")[0]), f2(p.v))
		}
	}
	fmt.Fprintln(w, center("Prefix cache", "-"))
	line("Ideal hit rate (infinite cache)", pct(r.IdealHitRate))
	if s.CachedTokens > 0 {
		line("Cached tokens reported (usage)", pct(s.CachedRate))
	}
	if r.Engine != nil {
		line("Engine hit rate (Δhits/Δqueries)", fmt.Sprintf("%s over %d pods", pct(r.Engine.HitRate), r.Engine.Pods))
	} else if r.EngineErr != "" {
		line("Engine hit rate", r.EngineErr)
	}
	for _, st := range r.Stages {
		hit := ""
		if st.Engine != nil {
			hit = ", hit " + pct(st.Engine.HitRate)
		}
		line(fmt.Sprintf("Stage %s req/s", st.Rate), fmt.Sprintf("%s req/s, %s tok/s, p90 TTFT %s ms%s",
			f2(st.Summary.RequestThroughput), f2(st.Summary.OutputThroughput), f2(st.Summary.TTFT.P90), hit))
	}
	if r.CPU.MachineIdle >= 0 {
		line("Machine CPU idle", fmt.Sprintf("%s (min %s), kvbench %.2f cores", pct(r.CPU.MachineIdle), pct(r.CPU.MachineIdleMin), r.CPU.ProcessCores))
	}
	fmt.Fprintln(w, strings.Repeat("=", summaryWidth))
}

// center pads " s " with fill on both sides to summaryWidth.
func center(s, fill string) string {
	s = " " + s + " "
	pad := max(0, summaryWidth-len(s))
	return strings.Repeat(fill, pad/2) + s + strings.Repeat(fill, pad-pad/2)
}
