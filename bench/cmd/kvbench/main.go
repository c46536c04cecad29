// Command kvbench measures LLM serving the way vLLM's `bench serve` does
// (TTFT, ITL, TPOT, E2E latency, throughput, goodput, engine prefix-cache
// hit rate), with seeded shared-prefix, multi-turn, random, hot-prefix and
// Mooncake-trace workloads.
//
// Two modes:
//
//	kvbench --scenario demo                    # two-minute shared-prefix run of four policies
//	kvbench --scenario shared-prefix           # simulated fleet behind an in-process kvroute, per policy
//	kvbench --scenario all --trace FILE        # every scenario, results under bench/results/
//	kvbench --base-url http://kvroute:8000 --pod-urls http://pod-a:8000,http://pod-b:8000 \
//	        --workload shared-prefix --rate 8  # any OpenAI-compatible server, e.g. real vLLM
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvroute/kvroute/app"
	"github.com/kvroute/kvroute/bench/llmd"
	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/report"
	"github.com/kvroute/kvroute/bench/scenario"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/bench/workload"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr, isTerminal(os.Stderr)); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "kvbench:", err)
		os.Exit(1)
	}
}

// isTerminal reports whether f is a character device (a terminal), so the
// progress line may redraw itself with carriage returns.
func isTerminal(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// options are kvbench's flags.
type options struct {
	// Scenario mode.
	scenarios []string
	engines   []string
	llmdBin   string
	local     localFlags
	localRate float64
	rounds    int
	profiles  []string
	policies  []string
	full      bool
	pods      int
	timeScale float64
	out       string
	trace     string

	// Direct mode.
	baseURL   string
	podURLs   []string
	model     string
	api       string
	workload  workload.Config
	turns     string
	userLen   string
	answerLen string
	arrival   string
	rate      string
	load      load.Load
	stages    string
	duration  time.Duration
	sloTTFT   time.Duration
	sloTPOT   time.Duration
	sloE2EL   time.Duration
	timeout   time.Duration
	jsonOut   string
	rawOut    string

	// Both.
	seed       uint64
	quiet      bool
	serve      string
	cpuProfile string
}

func newFlags(o *options) *app.Flags {
	f := app.NewFlags("kvbench", usageHeader)
	g := f.Group
	sc, tgt, wl, ld, out := g("Scenarios (simulated fleet behind an in-process kvroute)"), g("Target (direct mode)"),
		g("Workload (direct mode; lengths in tokens)"), g("Load (direct mode)"), g("Output and misc")

	sc.StringSliceVar(&o.scenarios, "scenario", nil, "scenarios to run: "+strings.Join(scenario.Names(), ", ")+", all of them, demo (a short shared-prefix run of four policies), "+
		scenario.SharedPrefixTiers+" (pressure 2x on pods with a CPU KV tier: engine truth with and without tiers; kvsim only), "+
		strings.Join(scenario.PDNames(), ", ")+" (aggregated vs disaggregated fleets), or matrix ("+
		strings.Join(scenario.MatrixScenarios(), ", ")+" on every profile, one table), or local ("+strings.Join(scenario.LocalNames(), ", ")+
		": sized for --engine "+scenario.EngineOllama+" and "+scenario.EngineLlamaCpp+"); default shared-prefix without --base-url ("+scenario.LocalSharedPrefix4+" on real servers)")
	sc.StringSliceVar(&o.profiles, "profile", nil, "engine profiles to run the scenarios on: "+strings.Join(sim.ProfileNames(), ", ")+
		" (default "+sim.DefaultProfile+"; the matrix's: "+strings.Join(scenario.MatrixProfiles(), ", ")+"); loads are fitted to each; results of "+
		sim.DefaultProfile+" under --out/<scenario>, of the others under --out/<profile>/<scenario>")
	sc.StringSliceVar(&o.engines, "engine", nil, "engines the pods run: "+strings.Join(scenario.Engines(), ", ")+
		" (default "+scenario.EngineKVSim+"; "+scenario.EngineLLMD+" is the public llm-d inference simulator, one process per pod, its flags derived from the profile; "+
		scenario.EngineOllama+" and "+scenario.EngineLlamaCpp+" are real servers with the tiny model on CPU, for the local scenarios only); results of "+
		scenario.EngineLLMD+" under --out/"+scenario.EngineLLMD+"/…, of the real servers under --out/<engine>[-<flags>]/…")
	sc.StringVar(&o.llmdBin, "llmd-binary", "", "the llm-d simulator's binary (default $"+llmd.EnvBinary+", else bin/"+llmd.BinaryName+" decompressed from ../shared/engines)")
	sc.IntVar(&o.local.numParallel, "ollama-num-parallel", 0, "engine ollama: OLLAMA_NUM_PARALLEL, sequences at once and cache slots per server (0: Ollama's default, 1)")
	sc.IntVar(&o.local.slots, "llamacpp-np", 0, "engine llamacpp: llama-server's -np, slots per server (0: its default, auto: 4 over one unified KV)")
	sc.IntVar(&o.local.cacheRAM, "llamacpp-cache-ram", -1, "engine llamacpp: llama-server's --cache-ram, its host prompt cache in MiB (-1: its default, 8192; 0: none)")
	sc.BoolVar(&o.local.metrics, "llamacpp-metrics", false, "engine llamacpp: llama-server's --metrics (its /metrics, which kvroute's scraper reads)")
	sc.Float64Var(&o.localRate, "local-rate", 0, "local scenarios: offered rate in requests/s, open Poisson loop (0: 5)")
	sc.IntVar(&o.rounds, "rounds", 1, "run every policy this many times, round r with seed --seed+r and the policies in reverse order every other round; the tables pool the rounds and add each round's TTFT ratios and their median")
	sc.StringSliceVar(&o.policies, "policies", nil, "policies to compare (default all: "+strings.Join(policyNames(), ", ")+"; the demo, near-identical and lora their own; the matrix "+
		strings.Join(matrixPolicyNames(), ", ")+"); opt in: "+strings.Join(names(scenario.OptInPolicies()), ", ")+
		" ("+scenario.PrefixEvents+"* and "+scenario.LLMDPrecise+" fed by the pods' KV events; on "+scenario.EngineLLMD+" passed on to each replica by a fan-out, as the simulator publishes to one address)")
	sc.BoolVar(&o.full, "full", false, "published sizes (SGLang/llm-d/vLLM presets) instead of the few-minute defaults")
	sc.IntVar(&o.pods, "pods", 0, "simulated pods per fleet (0: 8)")
	sc.Float64Var(&o.timeScale, "time-scale", 0, "simulated time runs this many times faster than real time (0: each scenario's; direct mode: the target kvsim's --time-scale, so latencies are reported in modelled time)")
	sc.StringVar(&o.out, "out", "bench/results", "directory for scenario results (one subdirectory per scenario)")
	sc.StringVar(&o.trace, "trace", "", "Mooncake JSONL trace for the trace scenario and --workload trace")

	tgt.StringVar(&o.baseURL, "base-url", "", "OpenAI-compatible base URL to drive (kvroute, a pod, vLLM); selects direct mode")
	tgt.StringSliceVar(&o.podURLs, "pod-urls", nil, "engine base URLs whose /metrics give the prefix-cache hit rate (vllm:prefix_cache_hits/queries)")
	tgt.StringVar(&o.model, "model", "", "model name (default: the first of GET /v1/models)")
	tgt.StringVar(&o.api, "api", "completions", "completions or chat")
	tgt.DurationVar(&o.timeout, "timeout", 30*time.Minute, "limit per request, send to end of stream")

	w := &o.workload
	wl.StringVar(&w.Kind, "workload", workload.KindSharedPrefix, "workload: "+strings.Join(workload.Kinds(), ", "))
	wl.IntVar(&w.Groups, "groups", 0, "shared-prefix, near-identical: prefix groups (default 64)")
	wl.IntVar(&w.PromptsPerGroup, "prompts-per-group", 0, "shared-prefix, near-identical: prompts per group (default 16)")
	wl.IntVar(&w.SystemTokens, "system-len", 0, "shared-prefix, hot-prefix, near-identical: system prompt length (default 2048)")
	wl.IntVar(&w.QuestionTokens, "question-len", 0, "shared-prefix, hot-prefix, near-identical: question length (default 128)")
	wl.IntVar(&w.OutputTokens, "output-len", 0, "shared-prefix, hot-prefix, near-identical, random: output length (default 256; random 128)")
	wl.Float64Var(&w.VariantShare, "variant-share", 0, "near-identical: share of requests whose system prompt is rendered near-identically (CRLF, trailing blanks, a BOM, doubled spaces; default 0.5)")
	wl.IntVar(&w.Adapters, "adapters", 0, "shared-prefix, near-identical, random: send each request to one of N LoRA adapters named adapter-0 … adapter-N-1 (a group's requests to one; the server must serve them)")
	wl.IntVar(&w.InputTokens, "input-len", 0, "random: prompt length (default 1024)")
	wl.IntVar(&w.Requests, "num-prompts", 0, "random, hot-prefix: distinct prompts (default 1024)")
	wl.IntVar(&w.Conversations, "conversations", 0, "multi-turn: conversations (default 64)")
	wl.IntVar(&w.PrefixTokens, "prefix-len", 0, "multi-turn: common prefix of all conversations (default 500)")
	wl.StringVar(&o.turns, "turns", "", "multi-turn: turns per conversation, min-max (default 12-18)")
	wl.StringVar(&o.userLen, "user-len", "", "multi-turn: user turn length, min-max (default 120-160)")
	wl.StringVar(&o.answerLen, "answer-len", "", "multi-turn: answer length, min-max (default 80-120)")
	wl.IntVar(&w.TraceLimit, "trace-limit", 0, "trace: replay only the first N requests (0: all)")
	wl.Float64Var(&w.TraceSpeedup, "trace-speedup", 1, "trace: divide timestamps by this")
	wl.IntVar(&w.TraceMaxInput, "trace-max-input", 0, "trace: cut longer prompts to this many tokens (0: no limit)")
	wl.IntVar(&w.TraceMaxOutput, "trace-max-output", 0, "trace: cap output lengths (0: no limit)")

	ld.StringVar(&o.arrival, "arrival", "poisson", "poisson (gamma with --burstiness), constant, closed (fixed concurrency) or trace (timestamps)")
	ld.StringVar(&o.rate, "rate", "inf", "requests/s of an open loop, or inf (everything at once)")
	ld.Float64Var(&o.load.Burstiness, "burstiness", 1, "gamma shape of the gaps: 1 Poisson, < 1 burstier")
	ld.IntVar(&o.load.Concurrency, "concurrency", 0, "closed loop: requests kept in flight")
	ld.IntVar(&o.load.MaxConcurrency, "max-concurrency", 0, "open loop: cap on requests in flight (0: none)")
	ld.StringVar(&o.stages, "stages", "", "rising-rate stages rate:requests,… (e.g. 4:200,8:200,16:200); each follows the last at once, its throughput measured over its own window")
	ld.IntVar(&o.load.Requests, "requests", 0, "requests to send (0: the workload once; single-turn workloads repeat)")
	ld.DurationVar(&o.duration, "duration", 0, "stop sending after this long (0: no limit)")
	ld.DurationVar(&o.sloTTFT, "slo-ttft", 0, "goodput objective on TTFT (0: none)")
	ld.DurationVar(&o.sloTPOT, "slo-tpot", 0, "goodput objective on TPOT")
	ld.DurationVar(&o.sloE2EL, "slo-e2el", 0, "goodput objective on E2E latency")

	out.Uint64Var(&o.seed, "seed", 1, "seed of workloads and arrivals")
	out.StringVar(&o.jsonOut, "json", "", "direct mode: write the result (summary, stages, engine, CPU) as JSON here")
	out.StringVar(&o.rawOut, "raw", "", "direct mode: write per-request records as JSON here")
	out.BoolVar(&o.quiet, "quiet", false, "no progress line even on a terminal")
	out.StringVar(&o.serve, "serve-instant", "", "serve the overhead scenario's instant backend on this address until interrupted (for wrk)")
	out.StringVar(&o.cpuProfile, "cpu-profile", "", "write a Go CPU profile of the whole run here")

	return f
}

func policyNames() []string { return names(scenario.Policies()) }

func matrixPolicyNames() []string { return names(scenario.MatrixPolicies()) }

func names(ps []scenario.Policy) []string {
	n := make([]string, len(ps))
	for i, p := range ps {
		n[i] = p.Name
	}
	return n
}

const usageHeader = `kvbench: load generator and routing-policy benchmark for kvroute.

Usage:
  kvbench [--scenario NAME,...] [--full]          simulated 8-pod fleet behind kvroute, one run per policy
  kvbench --scenario NAME,... --profile P,...       the same on other engine profiles (e.g. slow-large)
  kvbench --scenario matrix                         the matrix's workloads × four profiles, one table
  kvbench --scenario NAME,... --engine kvsim,llm-d  the same on the llm-d inference simulator too
  kvbench --scenario local --engine ollama,llamacpp real servers on CPU (4 by default), one run per policy
  kvbench --base-url URL [--pod-urls URL,...] ...   drive any OpenAI-compatible server (kvroute, vLLM)
  kvbench --serve-instant 127.0.0.1:8200           the overhead scenario's instant backend, for wrk
`

// run is kvbench's body: it parses args and runs the mode they select.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, tty bool) error {
	o := &options{}
	if err := newFlags(o).Parse(args, stdout); err != nil {
		return err
	}
	if _, err := scenario.PrefixParams(); err != nil {
		return err
	}
	if o.cpuProfile != "" {
		f, err := os.Create(o.cpuProfile)
		if err != nil {
			return err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			f.Close()
			return err
		}
		defer func() { pprof.StopCPUProfile(); f.Close() }()
	}
	var progress io.Writer
	if tty && !o.quiet {
		progress = stderr
	}
	switch {
	case o.serve != "":
		return serveInstant(ctx, o.serve, stdout)
	case o.baseURL != "":
		if len(o.scenarios) > 0 {
			return errors.New("--scenario and --base-url exclude each other")
		}
		return direct(ctx, o, stdout, progress)
	default:
		return scenarios(ctx, o, stdout, stderr, progress)
	}
}

// overhead runs the overhead scenario, writes its files under dir and
// prints its table.
func overhead(ctx context.Context, o *options, dir string, stdout, stderr io.Writer) ([]string, error) {
	cfg := scenario.OverheadConfig{Seed: o.seed}
	if o.full {
		cfg.Duration, cfg.Concurrency = 20*time.Second, []int{1, 32, 64}
	}
	fmt.Fprintf(stderr, "overhead: instant backend, direct vs through kvroute\n")
	rep, err := scenario.RunOverhead(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("overhead: %w", err)
	}
	files, err := report.WriteOverhead(dir, rep)
	if err != nil {
		return files, err
	}
	fmt.Fprintf(stdout, "\n%s", report.MarkdownOverhead(rep))
	return files, nil
}

// printFiles says where a scenario's results and charts are.
func printFiles(stdout io.Writer, dir string, files []string) {
	var charts []string
	for _, f := range files {
		if strings.HasSuffix(f, ".png") {
			charts = append(charts, f)
		}
	}
	fmt.Fprintf(stdout, "\nResults in %s", dir)
	if len(charts) > 0 {
		fmt.Fprintf(stdout, "; charts: %s", strings.Join(charts, ", "))
	}
	fmt.Fprintln(stdout)
}

// direct drives o.baseURL and prints a `bench serve`-style summary.
func direct(ctx context.Context, o *options, stdout, progress io.Writer) error {
	api, err := workload.ParseAPI(o.api)
	if err != nil {
		return err
	}
	w := o.workload
	w.Seed, w.TracePath = o.seed, o.trace
	for _, r := range []struct {
		flag, v string
		lo, hi  *int
	}{
		{"--turns", o.turns, &w.TurnsMin, &w.TurnsMax},
		{"--user-len", o.userLen, &w.UserMin, &w.UserMax},
		{"--answer-len", o.answerLen, &w.AnswerMin, &w.AnswerMax},
	} {
		if r.v == "" {
			continue
		}
		if *r.lo, *r.hi, err = parseRange(r.v); err != nil {
			return fmt.Errorf("%s: %w", r.flag, err)
		}
	}
	wl, err := w.Build()
	if err != nil {
		return err
	}
	l := o.load
	if l.Arrival, err = load.ParseArrival(o.arrival); err != nil {
		return err
	}
	if w.Kind == workload.KindTrace && o.arrival == "poisson" && o.stages == "" && o.rate == "inf" {
		l.Arrival = load.ArrivalTrace // a trace replays its own timestamps unless told otherwise
	}
	if l.Concurrency > 0 && o.arrival == "poisson" {
		l.Arrival = load.ArrivalClosed
	}
	if l.Rate, err = load.ParseRate(o.rate); err != nil {
		return err
	}
	if l.Stages, err = load.ParseStages(o.stages); err != nil {
		return err
	}
	l.Duration = o.duration
	model := o.model
	if model == "" {
		model = discoverModel(ctx, o.baseURL)
	}
	res, err := load.Run(ctx, load.Config{
		BaseURL: o.baseURL, PodURLs: o.podURLs, Model: model, API: api, Workload: wl, Load: l,
		SLO:       load.SLO{TTFT: ms(o.sloTTFT), TPOT: ms(o.sloTPOT), E2EL: ms(o.sloE2EL)},
		TimeScale: o.timeScale, Timeout: o.timeout, Seed: o.seed, Label: o.baseURL, Progress: progress,
	})
	if res == nil {
		return err
	}
	report.WriteServeSummary(stdout, res, wl.Config.Kind)
	if o.jsonOut != "" {
		err = errors.Join(err, report.WriteJSON(o.jsonOut, res, true))
	}
	if o.rawOut != "" {
		err = errors.Join(err, report.WriteJSON(o.rawOut, res.Requests, false))
	}
	return err
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// parseRange parses "lo-hi" or "n".
func parseRange(s string) (int, int, error) {
	a, b, ok := strings.Cut(s, "-")
	if !ok {
		b = a
	}
	lo, err1 := strconv.Atoi(strings.TrimSpace(a))
	hi, err2 := strconv.Atoi(strings.TrimSpace(b))
	if err1 != nil || err2 != nil || lo < 1 || hi < lo {
		return 0, 0, fmt.Errorf("%q: want min-max with 1 ≤ min ≤ max", s)
	}
	return lo, hi, nil
}

// discoverModel returns the first model id of GET /v1/models, or "" (the
// body then leaves "model" out).
func discoverModel(ctx context.Context, base string) string {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(base, "/")+"/v1/models", nil)
	if err != nil {
		return ""
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	var body struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if resp.StatusCode != http.StatusOK || json.NewDecoder(resp.Body).Decode(&body) != nil || len(body.Data) == 0 {
		return ""
	}
	return body.Data[0].ID
}

// serveInstant runs the instant backend until ctx ends.
func serveInstant(ctx context.Context, addr string, stdout io.Writer) error {
	b, err := scenario.StartInstantBackend(addr, 4)
	if err != nil {
		return err
	}
	fmt.Fprintln(stdout, b.URL)
	<-ctx.Done()
	return b.Close()
}
