package scenario

import (
	"fmt"
	"math"
	"time"

	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/localengine"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/bench/workload"
)

// Preset tunes the built-in scenarios.
type Preset struct {
	// Full selects sizes close to the published benchmarks (SGLang's
	// bench_serving, llm-d-benchmark's presets, vLLM's benchmarks) instead
	// of the few-minute default set.
	Full bool
	// Pods overrides the fleet size (0: 8).
	Pods int
	// TimeScale overrides the simulators' time scale (0: the scenario's).
	TimeScale float64
	// TracePath is the Mooncake trace of the trace scenario ("" leaves the
	// scenario out).
	TracePath string
	// Seed seeds workloads and arrivals.
	Seed uint64
	// Profile names the pods' engine profile (sim.Profiles); "" is
	// sim.DefaultProfile, h100-8b, for which the scenarios were written.
	// On another the loads are fitted to it (see SizeFor).
	Profile string
	// Engine names the pods' engine (Engines; "" is EngineKVSim). The
	// loads are fitted to the profile, not to the engine: the llm-d pods
	// are given the profile's costs (LLMDSettings). The local scenarios
	// (LocalNames) are not fitted: they are sized for real servers on CPU.
	Engine string
	// Local are the real local servers' flags (EngineOllama,
	// EngineLlamaCpp; its Engine is taken from Engine): the local
	// scenarios run with them.
	Local localengine.Settings
	// LocalRate overrides the local scenarios' offered rate, requests/s
	// (0: localRate, 5).
	LocalRate float64
}

// DefaultPods is the default fleet size.
const DefaultPods = 8

// kvShare is the prefix working set's share of the fleet's KV capacity the
// default scenarios are sized to, as in llm-d-benchmark's shared-prefix
// preset (≈ 73%): more than one pod's cache, less than the fleet's, so a router
// that keeps each prefix on one pod keeps it cached and one that spreads
// prefixes evicts them.
const kvShare = 0.7

// Scenario names.
const (
	SharedPrefix  = "shared-prefix"
	MultiTurn     = "multi-turn"
	Random        = "random"
	HotPrefix     = "hot-prefix"
	NearIdentical = "near-identical"
	LoRA          = "lora"
	Trace         = "trace"
	Overhead      = "overhead"
	// The pressure scenarios: shared-prefix and multi-turn whose prefix
	// working set is 1, 2 and 4 times the fleet's KV (pressure.go).
	SharedPrefixPressure1 = "shared-prefix-pressure-1x"
	SharedPrefixPressure2 = "shared-prefix-pressure-2x"
	SharedPrefixPressure4 = "shared-prefix-pressure-4x"
	MultiTurnPressure1    = "multi-turn-pressure-1x"
	MultiTurnPressure2    = "multi-turn-pressure-2x"
	MultiTurnPressure4    = "multi-turn-pressure-4x"
	// SharedPrefixTiers is shared-prefix-pressure-2x on pods with a CPU
	// tier twice their GPU KV: the working set fits GPU + CPU, not GPU
	// (pressure.go). Not part of Names: kvsim only.
	SharedPrefixTiers = "shared-prefix-tiers-2x"
	// Demo is a short shared-prefix comparison of four policies (see
	// Lookup); it is not part of Names.
	Demo = "demo"
	// The local scenarios, sized for real servers on CPU (LocalNames);
	// not part of Names.
	LocalSharedPrefix4        = "local-shared-prefix-4"
	LocalSharedPrefix8        = "local-shared-prefix-8"
	LocalSharedPrefix16       = "local-shared-prefix-16"
	LocalSharedPrefixPressure = "local-shared-prefix-pressure"
	LocalMultiTurn            = "local-multi-turn"
)

// Names lists every scenario of a full benchmark run in run order (overhead
// last); the demo is not among them.
func Names() []string {
	return append([]string{SharedPrefix, MultiTurn, Random, HotPrefix, NearIdentical, LoRA, Trace},
		append(PressureNames(), Overhead)...)
}

// Lookup returns the policy comparison called name for p: one of Builtin(p),
// the demo or a PD scenario (PDNames). It reports false for overhead (see RunOverhead), for the
// trace scenario without a trace, and for unknown names.
func Lookup(p Preset, name string) (Scenario, bool) {
	if name == Demo {
		return fit(p, demo(p)), true
	}
	if sc, ok := pdScenario(p, name); ok {
		return fit(p, sc), true
	}
	if name == SharedPrefixTiers {
		return fit(p, sharedPrefixTiers(p)), true
	}
	if sc, ok := localScenario(p, name); ok {
		return sc, true
	}
	for _, sc := range Builtin(p) {
		if sc.Name == name {
			return sc, true
		}
	}
	return Scenario{}, false
}

// Builtin returns the built-in policy comparisons for p, those of Names
// but overhead (see RunOverhead). The default sizes keep the prefix working
// set at ≈ 70% of the fleet's KV and more than twice one pod's by shrinking
// the pods' KV, not by growing the workload. On a profile other than
// h100-8b the loads are fitted to it (see SizeFor); the workloads' shapes
// and the KV sizing stay.
func Builtin(p Preset) []Scenario {
	out := []Scenario{sharedPrefix(p), multiTurn(p), random(p), hotPrefix(p), nearIdentical(p), lora(p)}
	if p.TracePath != "" {
		out = append(out, trace(p))
	}
	out = append(out, pressure(p)...)
	for i := range out {
		out[i] = fit(p, out[i])
	}
	return out
}

// profile returns the engine profile p asks for.
func (p Preset) profile() string {
	if p.Profile == "" {
		return sim.DefaultProfile
	}
	return p.Profile
}

// pods returns the fleet size p asks for.
func (p Preset) pods() int {
	if p.Pods <= 0 {
		return DefaultPods
	}
	return p.Pods
}

// simConfig is the pods' configuration: the profile's cost model (Scenario.
// Profile fills the engine fields left zero here; h100-8b is the bench/sim
// defaults) with KV capacity shrunk so that workingSet tokens are kvShare
// of the fleet's, and time running timeScale× faster.
func simConfig(p Preset, pods, workingSet int, timeScale float64) sim.Config {
	cfg := sim.Config{Seed: p.Seed, TimeScale: timeScale}
	if p.TimeScale > 0 {
		cfg.TimeScale = p.TimeScale
	}
	if workingSet > 0 {
		block := sim.DefaultConfig().BlockSize
		cfg.NumGPUBlocks = int(math.Ceil(float64(workingSet) / kvShare / float64(pods) / float64(block)))
	}
	return cfg
}

// sharedPrefixWorkload is SGLang's generated-shared-prefix at its defaults
// (64 × 16, 2,048 + 128 → 256); --full uses llm-d-benchmark's preset
// (workload/profiles/inference-perf/guide_precise-prefix-cache-routing_1:
// 150 groups × 5, 6,000 + 1,200 → 1,000). The random and hot-prefix
// scenarios run on the fleet sized for its working set.
func sharedPrefixWorkload(p Preset) workload.Config {
	if p.Full {
		return workload.Config{Kind: workload.KindSharedPrefix, Seed: p.Seed, Groups: 150, PromptsPerGroup: 5,
			SystemTokens: 6000, QuestionTokens: 1200, OutputTokens: 1000}
	}
	return workload.Config{Kind: workload.KindSharedPrefix, Seed: p.Seed}.Defaults()
}

// sharedPrefixWorkingSet is the prefix working set of c, in tokens.
func sharedPrefixWorkingSet(c workload.Config) int { return c.Groups * c.SystemTokens }

// sharedPrefix is SGLang's generated-shared-prefix in Poisson stages of
// rising rate.
func sharedPrefix(p Preset) Scenario {
	pods, sp := p.pods(), sharedPrefixWorkload(p)
	// Eight seconds per stage, 1,856 requests in all; round-robin's knee is
	// near 26 req/s on this fleet, the prefix policy's near 48, so the last
	// stages measure throughput at saturation.
	stages := []load.Stage{{Rate: 8, Requests: 64}, {Rate: 16, Requests: 128}, {Rate: 24, Requests: 192},
		{Rate: 32, Requests: 256}, {Rate: 40, Requests: 320}, {Rate: 48, Requests: 384}, {Rate: 64, Requests: 512}}
	scale := 1.0
	if p.Full {
		// 20 s per stage, llm-d's 3 → 60 req/s. A quarter of real time
		// keeps the wall token rate of the saturated stages near the
		// default set's.
		stages = []load.Stage{{Rate: 3, Requests: 60}, {Rate: 10, Requests: 200}, {Rate: 20, Requests: 400},
			{Rate: 30, Requests: 600}, {Rate: 40, Requests: 800}, {Rate: 50, Requests: 1000}, {Rate: 60, Requests: 1200}}
		scale = 0.25
	}
	ws := sharedPrefixWorkingSet(sp)
	return Scenario{
		Name: SharedPrefix,
		Description: "Groups of requests share a long system prompt (SGLang generated-shared-prefix); " +
			"the rate rises stage by stage. A cache-aware router should keep each group on one pod.",
		Pods: pods, Sim: simConfig(p, pods, ws, scale), WorkingSet: ws,
		Workload: sp, Load: load.Load{Stages: stages}, Seed: p.Seed, SLO: load.SLO{TTFT: 2000, TPOT: 100},
	}
}

// demo is the shared-prefix scenario cut to about two minutes on two
// cores: four policies (the baseline, the best load-only policy, kvroute's
// and the strongest peer's) and three stages of four seconds, at 16 req/s
// (where round-robin saturates on this fleet, ≈ 17 req/s), 32 and 48 (where
// the prefix policy still gains, ≈ 30 req/s). The groups are halved so each
// still gets a dozen requests, and the pods' KV with them. Preset.Full does
// not apply.
func demo(p Preset) Scenario {
	pods := p.pods()
	sp := workload.Config{Kind: workload.KindSharedPrefix, Seed: p.Seed, Groups: 32}.Defaults()
	ws := sharedPrefixWorkingSet(sp)
	return Scenario{
		Name: Demo,
		Description: "A short shared-prefix run (SGLang generated-shared-prefix, rising rate): " +
			"the baseline, a load-only policy, kvroute's prefix policy and SGLang's cache-aware router.",
		Pods: pods, Sim: simConfig(p, pods, ws, 1), WorkingSet: ws,
		Workload: sp, Seed: p.Seed, SLO: load.SLO{TTFT: 2000, TPOT: 100},
		Load:     load.Load{Stages: []load.Stage{{Rate: 16, Requests: 64}, {Rate: 32, Requests: 128}, {Rate: 48, Requests: 192}}},
		Policies: []string{Baseline, "least-request", "prefix", "sglang-cache-aware"},
	}
}

// multiTurn is vLLM's multi-turn shape: conversations resend their growing
// history; each of Concurrency clients runs one conversation at a time.
func multiTurn(p Preset) Scenario {
	pods := p.pods()
	mt := workload.Config{Kind: workload.KindMultiTurn, Seed: p.Seed, Conversations: 48}.Defaults()
	conc := 24
	if p.Full {
		mt.Conversations, conc = 256, 64
	}
	ws := conc * (mt.PrefixTokens + (mt.TurnsMin+mt.TurnsMax)/2*((mt.UserMin+mt.UserMax)/2+(mt.AnswerMin+mt.AnswerMax)/2))
	return Scenario{
		Name: MultiTurn,
		Description: "Chat conversations of 12–18 turns resend their history (vLLM multi-turn); " +
			"a closed loop of clients, each running one conversation at a time.",
		Pods: pods, Sim: simConfig(p, pods, ws, 1), WorkingSet: ws, API: workload.APIChat,
		Workload: mt, Load: load.Load{Arrival: load.ArrivalClosed, Concurrency: conc}, Seed: p.Seed, SLO: load.SLO{TTFT: 2000, TPOT: 100},
	}
}

// random shares nothing: the no-regression case, on the shared-prefix
// fleet.
func random(p Preset) Scenario {
	pods := p.pods()
	rnd := workload.Config{Kind: workload.KindRandom, Seed: p.Seed, Requests: 384}.Defaults()
	rate := load.Rate(32)
	if p.Full {
		rnd.Requests, rate = 4096, 40
	}
	return Scenario{
		Name:        Random,
		Description: "Every prompt is unique (1,024 in / 128 out): nothing to reuse, so no policy should lose here.",
		Pods:        pods, Sim: simConfig(p, pods, sharedPrefixWorkingSet(sharedPrefixWorkload(p)), 1),
		Workload: rnd, Load: load.Load{Rate: rate}, Seed: p.Seed, SLO: load.SLO{TTFT: 2000, TPOT: 100},
	}
}

// hotPrefix sends one system prompt with all traffic: pure affinity would
// pin the whole fleet's load on one pod. It runs on the shared-prefix fleet.
func hotPrefix(p Preset) Scenario {
	pods := p.pods()
	hp := workload.Config{Kind: workload.KindHotPrefix, Seed: p.Seed, Requests: 336}.Defaults()
	rate, scale := load.Rate(28), 1.0
	if p.Full {
		hp.Requests, rate, scale = 4096, 40, 0.5
	}
	return Scenario{
		Name:        HotPrefix,
		Description: "One system prompt for every request: the saturation case, where affinity must give way to load.",
		Pods:        pods, Sim: simConfig(p, pods, sharedPrefixWorkingSet(sharedPrefixWorkload(p)), scale),
		Workload: hp, Load: load.Load{Rate: rate}, Seed: p.Seed, SLO: load.SLO{TTFT: 2000, TPOT: 100},
	}
}

// nearIdentical is shared-prefix at its defaults with half of the
// requests' system prompts rendered near-identically (workload.Variants),
// on the shared-prefix fleet (KV sized for the prompts as written), at
// three rates up to the prefix policy's knee there. It compares the prefix
// policy with and without --normalize-prompts, round-robin the anchor,
// and reports kvroute's near-miss count beside the truth. Preset.Full does
// not apply: no published benchmark has this shape.
func nearIdentical(p Preset) Scenario {
	pods := p.pods()
	ni := workload.Config{Kind: workload.KindNearIdentical, Seed: p.Seed}.Defaults()
	ws := sharedPrefixWorkingSet(ni)
	return Scenario{
		Name: NearIdentical,
		Description: "Shared-prefix whose system prompts half of the requests render near-identically " +
			"(CRLF line endings, a blank before line ends, a byte-order mark, doubled spaces): the engine caches each rendering apart. " +
			"kvroute counts them; --normalize-prompts rewrites all but the doubled spaces.",
		Pods: pods, Sim: simConfig(p, pods, ws, 1), WorkingSet: ws,
		Workload: ni, Seed: p.Seed, SLO: load.SLO{TTFT: 2000, TPOT: 100},
		Load:     load.Load{Stages: []load.Stage{{Rate: 16, Requests: 128}, {Rate: 32, Requests: 256}, {Rate: 48, Requests: 384}}},
		Policies: []string{Baseline, "prefix", PrefixNormalized},
	}
}

// loraAdapters is how many LoRA adapters the lora scenario's pods serve.
const loraAdapters = 8

// lora is shared-prefix at its defaults with each prefix group's requests
// naming one of 8 LoRA adapters (group mod 8: a tenant's fine-tune behind
// its system prompts), every adapter loaded on every pod, and each pod
// running requests of one adapter at a time (vLLM's default --max-loras
// 1): a request for another waits for the slot however free the batch.
// Three rates below the shared-prefix knee, since the slots cut capacity.
// Preset.Full does not apply.
func lora(p Preset) Scenario {
	pods := p.pods()
	w := workload.Config{Kind: workload.KindSharedPrefix, Seed: p.Seed, Adapters: loraAdapters}.Defaults()
	ws := sharedPrefixWorkingSet(w)
	cfg := simConfig(p, pods, ws, 1)
	for i := range loraAdapters {
		cfg.LoRAs = append(cfg.LoRAs, workload.AdapterName(i))
	}
	return Scenario{
		Name: LoRA,
		Description: "Shared-prefix whose groups each name one of 8 LoRA adapters, loaded on every pod; " +
			"a pod runs one adapter's requests at a time (vLLM's default --max-loras 1), so a request for another waits for the slot.",
		Pods: pods, Sim: cfg, WorkingSet: ws,
		Workload: w, Seed: p.Seed, SLO: load.SLO{TTFT: 2000, TPOT: 100},
		Load:     load.Load{Stages: []load.Stage{{Rate: 4, Requests: 64}, {Rate: 8, Requests: 128}, {Rate: 16, Requests: 256}}},
		Policies: []string{Baseline, "least-request", "prefix"},
	}
}

// trace replays the Mooncake trace at p.TracePath (real arrival times and
// prefix structure).
func trace(p Preset) Scenario {
	pods := p.pods()
	tr := workload.Config{Kind: workload.KindTrace, Seed: p.Seed, TracePath: p.TracePath,
		TraceLimit: 300, TraceSpeedup: 4, TraceMaxInput: 8192, TraceMaxOutput: 512}
	cfg := simConfig(p, pods, 0, 1)
	cfg.NumGPUBlocks = 4096 // 64k tokens per pod: a few long prompts at a time
	if p.Full {
		tr.TraceLimit, tr.TraceSpeedup, tr.TraceMaxInput, tr.TraceMaxOutput = 3000, 1, 30000, 2000
		cfg.NumGPUBlocks = 8192 // prompts up to 30k tokens
	}
	return Scenario{
		Name:        Trace,
		Description: "Replay of Moonshot AI's Mooncake conversation trace: real arrival times, prompt lengths and prefix reuse (text synthesised per 512-token hash id).",
		Pods:        pods, Sim: cfg,
		Workload: tr, Load: load.Load{Arrival: load.ArrivalTrace}, Seed: p.Seed,
		SLO: load.SLO{TTFT: 5000, TPOT: 100}, Timeout: 30 * time.Minute,
	}
}

// The local scenarios run real servers with real CPU compute (EngineOllama,
// EngineLlamaCpp: the tiny model of bench/localengine, one thread each,
// four servers sharing two cores by default) behind a fresh kvroute with
// its default flags, against fixed affinity. Their prefixes are about
// 1,000 of the model's tokens (640 of the workload's words: the tiny
// model's byte-level BPE makes about 1.57 tokens of one), a cold prefill
// of 150 ms on Ollama and 65 ms on llama.cpp, about a tenth of that
// cached, so that where a prompt lands shows in TTFT. Outputs are 32
// tokens (the model never stops before max_tokens). Each policy sends
// about 100 requests in an open Poisson loop at localRate: about 20 s.
// They are not fitted to a profile and run on bench/sim or llm-d at the
// default engine's costs only as a check of the harness.

// LocalNames lists the local scenarios in run order.
func LocalNames() []string {
	return []string{LocalSharedPrefix4, LocalSharedPrefix8, LocalSharedPrefix16, LocalSharedPrefixPressure, LocalMultiTurn}
}

// localPods is the local scenarios' fleet unless the preset sets one:
// four single-threaded servers on a two-core machine.
const localPods = 4

// localRate is the local scenarios' offered rate, requests/s: cold, 5
// prefills of 150 ms a second (Ollama's, as shared/engines measured them)
// keep four servers about 40% busy on two cores, so that queueing stays a
// consequence of the routing (a policy that sends a group where its prefix
// is not pays a cold prefill), not of an overloaded machine. Where a cold
// prefill takes longer (300 ms on llama.cpp and 440 ms on Ollama were
// measured on a slower two-core machine), a policy that misses saturates
// the cores at 5 req/s: lower it with Preset.LocalRate (kvbench
// --local-rate).
const localRate = 5

// The local scenarios' request shape in the workload's words (about 1.57
// of the tiny model's tokens each) and output tokens.
const (
	localSystem   = 640
	localQuestion = 32
	localOutput   = 32
)

// localPolicies are the policies a local scenario compares: fixed
// affinity (the reference), the ClusterIP anchor, the best load-only
// policy and kvroute's.
var localPolicies = []string{FixedAffinity, Baseline, LeastRequest, "prefix"}

// localScenario returns the local scenario called name for p; false for
// another name.
func localScenario(p Preset, name string) (Scenario, bool) {
	var sc Scenario
	switch name {
	case LocalSharedPrefix4:
		sc = localSharedPrefix(p, name, 4, 25)
	case LocalSharedPrefix8:
		sc = localSharedPrefix(p, name, 8, 12)
	case LocalSharedPrefix16:
		sc = localSharedPrefix(p, name, 16, 6)
	case LocalSharedPrefixPressure:
		sc = localSharedPrefix(p, name, 24, 4)
	case LocalMultiTurn:
		sc = localMultiTurn(p)
	default:
		return Scenario{}, false
	}
	sc.Engine, sc.Pods, sc.Seed, sc.Policies = p.Engine, localPods, p.Seed, localPolicies
	if p.Pods > 0 {
		sc.Pods = p.Pods
	}
	if IsLocal(p.Engine) {
		s := p.Local
		s.Engine = p.Engine
		sc.Local = &s
	}
	if p.LocalRate > 0 {
		sc.Load.Rate = load.Rate(p.LocalRate)
	}
	sc.Sim = sim.Config{Seed: p.Seed, TimeScale: 1}
	sc.SLO, sc.Timeout = load.SLO{TTFT: 1000}, 5*time.Minute
	return sc, true
}

// localSharedPrefix is shared-prefix on real servers: groups prefixes of
// about 1,000 tokens, perGroup prompts each (rows shuffled), a 50-token
// question, 32 out, at localRate. With 4 groups on four servers fixed
// affinity keeps one prefix per server, which even stock Ollama (one
// cached prompt per server) holds; with 8 and 16 a server alternates
// between 2 and 4 prefixes; the pressure variant's 24 groups (6 per
// server) exceed what Ollama and llama-server -np 1 --cache-ram 8 hold
// (about four 1,000-token prompts), not what llama-server's default 8 GiB
// host cache holds.
func localSharedPrefix(p Preset, name string, groups, perGroup int) Scenario {
	w := workload.Config{Kind: workload.KindSharedPrefix, Seed: p.Seed, Groups: groups, PromptsPerGroup: perGroup,
		SystemTokens: localSystem, QuestionTokens: localQuestion, OutputTokens: localOutput}
	return Scenario{
		Name: name,
		Description: fmt.Sprintf("Shared-prefix on real local servers: %d groups of a ~1,000-token prefix, %d prompts each (shuffled), "+
			"a short question, 32 tokens out, open Poisson loop; fixed affinity (group g to server g mod n) is the reference.",
			groups, perGroup),
		WorkingSet: sharedPrefixWorkingSet(w), Workload: w, Load: load.Load{Rate: localRate},
	}
}

// localMultiTurn is multi-turn on real servers: 16 conversations of 4–6
// turns after a common ~1,000-token prefix, user turns of 40–60 words,
// answers of 16–32 tokens, so that a conversation's last request is about
// 1,700 tokens; open loop at localRate (a conversation's next turn goes at
// the next arrival after its answer), about 80 requests.
func localMultiTurn(p Preset) Scenario {
	mt := workload.Config{Kind: workload.KindMultiTurn, Seed: p.Seed, Conversations: 16, PrefixTokens: localSystem,
		TurnsMin: 4, TurnsMax: 6, UserMin: 40, UserMax: 60, AnswerMin: 16, AnswerMax: 32}
	return Scenario{
		Name: LocalMultiTurn,
		Description: "Multi-turn on real local servers: 16 conversations of 4–6 turns resend their history after a common ~1,000-token prefix, " +
			"open Poisson loop; fixed affinity (conversation c to server c mod n) is the reference.",
		API: workload.APIChat, Workload: mt, Load: load.Load{Rate: localRate},
	}
}
