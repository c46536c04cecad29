// Package report renders kvbench's results for people: a scenario's
// Markdown tables (per policy and per rate stage), its charts (TTFT CDF,
// throughput and p90 TTFT against the offered rate), the files a scenario
// leaves behind (table.md, results.json, raw per-request records), the
// overhead table, the policy matrix across engine profiles, and a vLLM
// `bench serve`-style summary of a single run.
package report

import (
	"bufio"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/scenario"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/bench/workload"
)

// Output file names inside a scenario's directory.
const (
	FileTable      = "table.md"
	FileResults    = "results.json"
	FileTTFTCDF    = "ttft-cdf.png"
	FileThroughput = "throughput-vs-rate.png"
	FileTTFTRate   = "ttft-p90-vs-rate.png"
	// raw-<policy>.json holds per-request records (not committed).
	rawPrefix = "raw-"
)

// Write writes rep under dir (created if needed): the Markdown table,
// results.json (everything but per-request records), raw-<policy>.json per
// policy (one request per line), and the charts. It returns the paths
// written.
func Write(dir string, rep *scenario.Report) ([]string, error) {
	files, err := writeTableAndResults(dir, Markdown(rep), rep)
	if err != nil {
		return files, err
	}
	for _, r := range rep.Runs {
		p := filepath.Join(dir, rawPrefix+fileSafe(r.Label)+".json")
		if err := writeRaw(p, r.Requests); err != nil {
			return files, err
		}
		files = append(files, p)
	}
	charts, err := writeCharts(dir, rep)
	return append(files, charts...), err
}

// writeTableAndResults writes table (Markdown) to table.md and v as
// indented JSON to results.json under dir (created if needed); it returns
// the paths written.
func writeTableAndResults(dir, table string, v any) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	t := filepath.Join(dir, FileTable)
	if err := os.WriteFile(t, []byte(table), 0o644); err != nil {
		return nil, err
	}
	r := filepath.Join(dir, FileResults)
	return []string{t, r}, WriteJSON(r, v, true)
}

// WriteJSON writes v as JSON to path, indented when indent is set, with a
// final newline.
func WriteJSON(path string, v any, indent bool) error {
	var b []byte
	var err error
	if indent {
		b, err = json.MarshalIndent(v, "", "  ")
	} else {
		b, err = json.Marshal(v)
	}
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// writeRaw writes records as a JSON array, one record per line.
func writeRaw(path string, rs []load.RequestResult) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	w.WriteString("[")
	for i := range rs {
		if i > 0 {
			w.WriteString(",")
		}
		w.WriteString("\n")
		b, err := json.Marshal(&rs[i])
		if err != nil {
			f.Close()
			return err
		}
		w.Write(b)
	}
	w.WriteString("\n]\n")
	if err := w.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func fileSafe(s string) string {
	return strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.' {
			return r
		}
		return '_'
	}, s)
}

// Markdown renders rep: a heading, a line on the setup, the policy
// table, and a per-stage table when the load had stages.
func Markdown(rep *scenario.Report) string {
	var b strings.Builder
	sc := &rep.Scenario
	fmt.Fprintf(&b, "### %s\n\n", sc.Name)
	if sc.Description != "" {
		fmt.Fprintf(&b, "%s\n\n", sc.Description)
	}
	f := sc.Fleet
	if f.Local != nil {
		b.WriteString(localMarkdown(rep))
		b.WriteString(RoundsTable(rep))
		return b.String()
	}
	fmt.Fprintf(&b, "%d simulated pods (%s, %d KV blocks × %d tokens = %s tokens per pod",
		sc.Pods, costModel(sc), f.NumGPUBlocks, f.BlockSize, thousands(f.KVTokensPerPod))
	if f.WorkingSetShare > 0 {
		fmt.Fprintf(&b, "; prefix working set %s tokens = %.0f%% of the fleet's KV, %.1f× one pod's",
			thousands(sc.WorkingSet), 100*f.WorkingSetShare, f.WorkingSetShare*float64(sc.Pods))
	}
	fmt.Fprintf(&b, "), time scale %g. Workload: %s. Load: %s. Ideal hit rate (infinite cache): %s.\n\n",
		f.TimeScale, describeWorkload(sc.Workload, sc.API), describeLoad(sc.Load), pct(rep.IdealHitRate))
	if z := sc.Sizing; z != nil && z.Factor != 1 {
		fmt.Fprintf(&b, "Load fitted to the profile: rates × %.2g (its pods' modelled capacity, %.2f requests/s each against h100-8b's %.2f), request counts × %.2g, time scale × %.3g.\n\n",
			z.Factor, z.PodCapacity, z.ReferenceCapacity, z.Requests, z.TimeScale)
	}
	if l := f.LLMD; l != nil {
		fmt.Fprintf(&b, "The pods ran the llm-d inference simulator (one process each) with the profile's costs: "+
			"max-num-seqs %d, prefill %s + %s per uncached token, %s per output token alone, time factor under load %.2f (wall time).\n\n",
			l.MaxNumSeqs, l.PrefillOverhead.Round(10*time.Microsecond), l.PrefillPerToken, l.InterTokenLatency.Round(10*time.Microsecond), max(1, l.TimeFactorUnderLoad))
	}
	if slo := sc.SLO; !slo.IsZero() {
		fmt.Fprintf(&b, "Goodput counts requests/s meeting %s.\n\n", describeSLO(slo))
	}
	b.WriteString(PolicyTable(rep.Runs))
	if ref := referenceLine(rep.Runs); ref != "" {
		fmt.Fprintf(&b, "\n%s\n", ref)
	}
	if cpu := cpuLine(rep.Runs); cpu != "" {
		fmt.Fprintf(&b, "\n%s\n", cpu)
	}
	if nm := nearMissLine(rep); nm != "" {
		fmt.Fprintf(&b, "\n%s\n", nm)
	}
	if st := StageTable(rep.Runs); st != "" {
		fmt.Fprintf(&b, "\nBy stage (offered rate in requests/s):\n\n%s", st)
	}
	b.WriteString(RoundsTable(rep))
	return b.String()
}

// RoundsTable renders, when the report pooled several rounds, each
// round's TTFT mean and p90 of every policy as a ratio to the reference
// run of that round (fixed affinity, else the first policy), and the
// median of those ratios; "" for a single round.
func RoundsTable(rep *scenario.Report) string {
	if len(rep.Rounds) < 2 || len(rep.Runs) == 0 {
		return ""
	}
	ref := rep.Runs[0].Label
	if run(rep.Runs, scenario.FixedAffinity) != nil {
		ref = scenario.FixedAffinity
	}
	var labels []string
	for _, r := range rep.Runs {
		if r.Label != ref {
			labels = append(labels, r.Label)
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\nThe tables above pool %d rounds, each with its own seed, the policies in reverse order every other round. "+
		"TTFT mean / p90 of each round as a ratio to %s's in the same round; the last column, the most cores any policy's run of the round "+
		"found busy outside the benchmark:\n\n| round (seed) | %s | other processes |\n|---|%s---:|\n",
		len(rep.Rounds), ref, strings.Join(labels, " | "), strings.Repeat("---:|", len(labels)))
	means, p90s := make([][]float64, len(labels)), make([][]float64, len(labels))
	for i, rd := range rep.Rounds {
		base := roundRun(rd, ref)
		fmt.Fprintf(&b, "| %d (%d) |", i+1, rd.Seed)
		for j, l := range labels {
			r := roundRun(rd, l)
			if base == nil || r == nil || base.TTFTMean == 0 || base.TTFTP90 == 0 {
				b.WriteString(" – |")
				continue
			}
			m, p := r.TTFTMean/base.TTFTMean, r.TTFTP90/base.TTFTP90
			means[j], p90s[j] = append(means[j], m), append(p90s[j], p)
			fmt.Fprintf(&b, " %.2f× / %.2f× |", m, p)
		}
		b.WriteString(outsideCell(rd))
		b.WriteString("\n")
	}
	b.WriteString("| median |")
	for j := range labels {
		if len(means[j]) == 0 {
			b.WriteString(" – |")
			continue
		}
		fmt.Fprintf(&b, " %.2f× / %.2f× |", median(means[j]), median(p90s[j]))
	}
	b.WriteString(" |\n")
	return b.String()
}

// outsideCell is a round's most cores busy outside the benchmark during
// any of its runs, "–" where unknown.
func outsideCell(rd scenario.Round) string {
	most := -1.0
	for _, r := range rd.Runs {
		if r.Outside != nil {
			most = max(most, *r.Outside)
		}
	}
	if most < 0 {
		return " – |"
	}
	return fmt.Sprintf(" %.2f |", most)
}

// roundRun returns label's figures in rd, nil if it did not run.
func roundRun(rd scenario.Round, label string) *scenario.RoundRun {
	for i := range rd.Runs {
		if rd.Runs[i].Label == label {
			return &rd.Runs[i]
		}
	}
	return nil
}

// median is the middle of xs (the mean of the two middle ones for an even
// count); xs is sorted in place.
func median(xs []float64) float64 {
	slices.Sort(xs)
	n := len(xs)
	if n%2 == 1 {
		return xs[n/2]
	}
	return (xs[n/2-1] + xs[n/2]) / 2
}

// localMarkdown renders a scenario on real local servers: the setup, the
// reference table (TTFT mean and p90 against fixed affinity, failures)
// and the full policy table.
func localMarkdown(rep *scenario.Report) string {
	var b strings.Builder
	sc := &rep.Scenario
	fmt.Fprintf(&b, "%d real servers (%s; model %s, one thread each) behind kvroute with its default flags. Workload: %s. Load: %s. "+
		"Ideal hit rate (infinite cache): %s.\n\n", sc.Pods, sc.Fleet.Local, sc.Fleet.Model,
		describeWorkload(sc.Workload, sc.API), describeLoad(sc.Load), pct(rep.IdealHitRate))
	b.WriteString(ReferenceTable(rep.Runs))
	b.WriteString("\n")
	b.WriteString(PolicyTable(rep.Runs))
	if cpu := cpuLine(rep.Runs); cpu != "" {
		fmt.Fprintf(&b, "\n%s\n", cpu)
	}
	return b.String()
}

// ReferenceTable renders one row per run: TTFT mean and p90, each also as
// a ratio to the fixed-affinity client's run (the finite-cache reference;
// "–" without it), the cached share of prompt tokens the engines reported
// (prompt_tokens_details.cached_tokens; "–" when none did, as Ollama
// v0.24) and the failed requests.
func ReferenceTable(runs []*load.Result) string {
	ref := run(runs, scenario.FixedAffinity)
	ratio := func(v, base float64) string {
		if ref == nil || base == 0 {
			return "–"
		}
		return fmt.Sprintf("%.2f×", v/base)
	}
	var b strings.Builder
	b.WriteString("| policy | requests | TTFT mean | TTFT p90 | mean vs " + scenario.FixedAffinity + " | p90 vs " + scenario.FixedAffinity +
		" | cached tokens (reported) | failed |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range runs {
		s := &r.Summary
		var mean, p90 float64
		if ref != nil {
			mean, p90 = ref.Summary.TTFT.Mean, ref.Summary.TTFT.P90
		}
		cached := "–"
		if s.CachedTokens > 0 {
			cached = pct(s.CachedRate)
		}
		fmt.Fprintf(&b, "| %s | %d | %s | %s | %s | %s | %s | %s |\n", r.Label, s.Requests, ms(s.TTFT.Mean), ms(s.TTFT.P90),
			ratio(s.TTFT.Mean, mean), ratio(s.TTFT.P90, p90), cached, errorsCell(s))
	}
	return b.String()
}

// run returns the last of runs labelled label, nil if none.
func run(runs []*load.Result, label string) *load.Result {
	var found *load.Result
	for _, r := range runs {
		if r.Label == label {
			found = r
		}
	}
	return found
}

// referenceLine compares every other run with the fixed-affinity client's
// (the finite-cache reference): engine hit rate and TTFT mean, each as a
// ratio ("" without that run).
func referenceLine(runs []*load.Result) string {
	ref := run(runs, scenario.FixedAffinity)
	if ref == nil || ref.Engine == nil || ref.Engine.HitRate == 0 || ref.Summary.TTFT.Mean == 0 {
		return ""
	}
	var parts []string
	for _, r := range runs {
		if r == ref || r.Engine == nil {
			continue
		}
		parts = append(parts, fmt.Sprintf("%s hit rate %.2f×, TTFT mean %.2f× (%.0f ms)", r.Label,
			r.Engine.HitRate/ref.Engine.HitRate, r.Summary.TTFT.Mean/ref.Summary.TTFT.Mean, r.Summary.TTFT.Mean))
	}
	return fmt.Sprintf("Against %s (hit rate %s, TTFT mean %.0f ms): %s.", scenario.FixedAffinity, pct(ref.Engine.HitRate),
		ref.Summary.TTFT.Mean, strings.Join(parts, "; "))
}

// nearMissLine compares, per policy, kvroute's near-identical prompt count
// with the workload's truth ("" when no run has either).
func nearMissLine(rep *scenario.Report) string {
	var parts []string
	for _, r := range rep.Runs {
		if nm, ok := rep.NearMisses[r.Label]; ok {
			parts = append(parts, fmt.Sprintf("%s %s (sent %s)", r.Label, thousands(nm.Counted), thousands(nm.Truth)))
		}
	}
	if parts == nil {
		return ""
	}
	return "Near-identical prompts counted by kvroute (`kvroute_prompt_near_misses_total`) against those sent " +
		"(requests whose system prompt, as forwarded, is rendered otherwise than their group's first): " + strings.Join(parts, ", ") + "."
}

// costModel names the pods' cost model: the model's for the default
// profile (as before profiles), else the profile and its hardware.
func costModel(sc *scenario.Scenario) string {
	p, err := sim.LookupProfile(sc.Profile)
	if sc.Profile == "" || sc.Profile == sim.DefaultProfile || err != nil {
		return sc.Fleet.Model + " cost model"
	}
	return fmt.Sprintf("profile %s: %s", p.Name, p.About)
}

// PolicyTable renders one row per run: throughputs, TTFT and ITL
// percentiles, engine hit rate, errors, and the throughput and p90 TTFT
// ratios to the baseline run (round-robin) when present.
func PolicyTable(runs []*load.Result) string {
	var b strings.Builder
	b.WriteString("| policy | req/s | goodput | output tok/s | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p99 | engine hit rate | errors | throughput vs RR | p90 TTFT vs RR |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	var base *load.Result
	for _, r := range runs {
		if r.Label == scenario.Baseline {
			base = r
		}
	}
	for _, r := range runs {
		s := &r.Summary
		hit := "–"
		if r.Engine != nil {
			hit = pct(r.Engine.HitRate)
		}
		tput, ttft := "–", "–"
		if base != nil && base.Summary.OutputThroughput > 0 {
			tput = fmt.Sprintf("%.2f×", s.OutputThroughput/base.Summary.OutputThroughput)
		}
		if base != nil && base.Summary.TTFT.P90 > 0 {
			ttft = fmt.Sprintf("%.2f×", s.TTFT.P90/base.Summary.TTFT.P90)
		}
		good := "–"
		if !s.SLO.IsZero() {
			good = fmt.Sprintf("%.2f", s.Goodput)
		}
		fmt.Fprintf(&b, "| %s | %.2f | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n",
			r.Label, s.RequestThroughput, good, thousands(int(math.Round(s.OutputThroughput))),
			ms(s.TTFT.P50), ms(s.TTFT.P90), ms(s.TTFT.P99), ms(s.ITL.P50), ms(s.ITL.P99),
			hit, errorsCell(s), tput, ttft)
	}
	return b.String()
}

// StageTable renders per-stage rows (policy × offered rate); "" when the
// runs had no stages.
func StageTable(runs []*load.Result) string {
	has := false
	for _, r := range runs {
		has = has || len(r.Stages) > 0
	}
	if !has {
		return ""
	}
	var b strings.Builder
	b.WriteString("| policy | offered | req/s | output tok/s | TTFT p50 | TTFT p90 | TTFT p99 | engine hit rate | errors |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range runs {
		for _, st := range r.Stages {
			s := &st.Summary
			hit := "–"
			if st.Engine != nil {
				hit = pct(st.Engine.HitRate)
			}
			fmt.Fprintf(&b, "| %s | %s | %.2f | %s | %s | %s | %s | %s | %s |\n",
				r.Label, st.Rate, s.RequestThroughput, thousands(int(math.Round(s.OutputThroughput))),
				ms(s.TTFT.P50), ms(s.TTFT.P90), ms(s.TTFT.P99), hit, errorsCell(s))
		}
	}
	return b.String()
}

// cpuLine reports the machine's idle CPU over the runs.
func cpuLine(runs []*load.Result) string {
	var parts []string
	for _, r := range runs {
		c := r.CPU
		if c.MachineIdle < 0 {
			continue
		}
		out := ""
		if c.Outside >= 0 {
			out = fmt.Sprintf(", other processes %.2f cores, max %.2f", c.Outside, c.OutsideMax)
		}
		parts = append(parts, fmt.Sprintf("%s %.0f%% (min %.0f%%, kvbench process %.2f cores%s)",
			r.Label, 100*c.MachineIdle, 100*c.MachineIdleMin, c.ProcessCores, out))
	}
	if len(parts) == 0 {
		return ""
	}
	return fmt.Sprintf("Machine CPU idle during each run (%d cores; other processes: cores busy outside kvbench and the engines it started, "+
		"which the run measured too): %s.", runs[0].CPU.Cores, strings.Join(parts, "; "))
}

func errorsCell(s *load.Summary) string {
	if s.Failed == 0 {
		return "0"
	}
	keys := make([]string, 0, len(s.Errors))
	for k := range s.Errors {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s %d", k, s.Errors[k])
	}
	return fmt.Sprintf("%d (%s)", s.Failed, strings.Join(parts, ", "))
}

// ms formats milliseconds: "850 ms", "12.3 s"; "–" for none.
func ms(v float64) string {
	switch {
	case v == 0 || math.IsNaN(v):
		return "–"
	case v < 10:
		return fmt.Sprintf("%.1f ms", v)
	case v < 1000:
		return fmt.Sprintf("%.0f ms", v)
	case v < 10000:
		return fmt.Sprintf("%.2f s", v/1000)
	}
	return fmt.Sprintf("%.1f s", v/1000)
}

// pct formats a fraction as a percentage; "–" for NaN.
func pct(v float64) string {
	if math.IsNaN(v) {
		return "–"
	}
	return fmt.Sprintf("%.1f%%", 100*v)
}

// thousands formats n with comma separators.
func thousands(n int) string {
	s := fmt.Sprint(n)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

func describeWorkload(c workload.Config, api workload.API) string {
	var s string
	switch c.Kind {
	case workload.KindSharedPrefix:
		s = fmt.Sprintf("shared-prefix, %d groups × %d prompts, system %d + question %d tokens, output %d",
			c.Groups, c.PromptsPerGroup, c.SystemTokens, c.QuestionTokens, c.OutputTokens)
	case workload.KindNearIdentical:
		s = fmt.Sprintf("near-identical, %d groups × %d prompts, system %d (in lines) + question %d tokens, output %d, %.0f%% of system prompts rendered near-identically",
			c.Groups, c.PromptsPerGroup, c.SystemTokens, c.QuestionTokens, c.OutputTokens, 100*c.VariantShare)
	case workload.KindHotPrefix:
		s = fmt.Sprintf("hot-prefix, %d requests sharing one %d-token system prompt, question %d, output %d",
			c.Requests, c.SystemTokens, c.QuestionTokens, c.OutputTokens)
	case workload.KindRandom:
		s = fmt.Sprintf("random, %d requests, %d in / %d out, nothing shared", c.Requests, c.InputTokens, c.OutputTokens)
	case workload.KindMultiTurn:
		s = fmt.Sprintf("multi-turn, %d conversations of %d–%d turns, common prefix %d, user %d–%d, answers %d–%d tokens",
			c.Conversations, c.TurnsMin, c.TurnsMax, c.PrefixTokens, c.UserMin, c.UserMax, c.AnswerMin, c.AnswerMax)
	case workload.KindTrace:
		s = fmt.Sprintf("Mooncake trace %s", filepath.Base(c.TracePath))
		if c.TraceLimit > 0 {
			s += fmt.Sprintf(", first %d requests", c.TraceLimit)
		}
		if c.TraceSpeedup != 1 {
			s += fmt.Sprintf(", %g× speed", c.TraceSpeedup)
		}
		if c.TraceMaxInput > 0 {
			s += fmt.Sprintf(", prompts cut at %d tokens", c.TraceMaxInput)
		}
		if c.TraceMaxOutput > 0 {
			s += fmt.Sprintf(", outputs cut at %d", c.TraceMaxOutput)
		}
	default:
		s = c.Kind
	}
	return s + ", " + api.String() + " API, seed " + fmt.Sprint(c.Seed)
}

func describeSLO(s load.SLO) string {
	var parts []string
	for _, p := range []struct {
		name string
		v    float64
	}{{"TTFT", s.TTFT}, {"TPOT", s.TPOT}, {"E2E latency", s.E2EL}} {
		if p.v > 0 {
			parts = append(parts, fmt.Sprintf("%s ≤ %s", p.name, ms(p.v)))
		}
	}
	return strings.Join(parts, " and ")
}

func describeLoad(l load.Load) string {
	var s string
	switch {
	case l.Arrival == load.ArrivalClosed:
		s = fmt.Sprintf("closed loop, %d concurrent", l.Concurrency)
	case l.Arrival == load.ArrivalTrace:
		s = "trace timestamps"
	case len(l.Stages) > 0:
		parts := make([]string, len(l.Stages))
		for i, st := range l.Stages {
			parts[i] = fmt.Sprintf("%s/s×%d", st.Rate, st.Requests)
		}
		s = fmt.Sprintf("%s stages %s", l.Arrival, strings.Join(parts, ", "))
	default:
		s = fmt.Sprintf("%s at %s req/s", l.Arrival, l.Rate)
	}
	if l.Burstiness != 0 && l.Burstiness != 1 {
		s += fmt.Sprintf(", burstiness %g", l.Burstiness)
	}
	if l.MaxConcurrency > 0 {
		s += fmt.Sprintf(", at most %d in flight", l.MaxConcurrency)
	}
	if l.Requests > 0 {
		s += fmt.Sprintf(", %d requests", l.Requests)
	}
	if l.Duration > 0 {
		s += fmt.Sprintf(", %s", l.Duration)
	}
	return s
}
