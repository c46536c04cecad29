package bench

import (
	"math"
	"time"

	"github.com/kvroute/kvroute/bench/sim"
)

// Preset tunes the built-in scenarios.
type Preset struct {
	// Full selects sizes close to the published benchmarks (REFERENCE §5)
	// instead of the few-minute default set.
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
}

// DefaultPods is the default fleet size.
const DefaultPods = 8

// kvShare is the prefix working set's share of the fleet's KV capacity the
// default scenarios are sized to, as in llm-d's shared-prefix benchmark
// (≈ 73%): more than one pod's cache, less than the fleet's, so a router
// that keeps each prefix on one pod keeps it cached and one that spreads
// prefixes evicts them.
const kvShare = 0.7

// Scenario names.
const (
	ScenarioSharedPrefix = "shared-prefix"
	ScenarioMultiTurn    = "multi-turn"
	ScenarioRandom       = "random"
	ScenarioHotPrefix    = "hot-prefix"
	ScenarioTrace        = "trace"
	ScenarioOverhead     = "overhead"
)

// ScenarioNames lists every scenario in run order (overhead last).
func ScenarioNames() []string {
	return []string{ScenarioSharedPrefix, ScenarioMultiTurn, ScenarioRandom, ScenarioHotPrefix, ScenarioTrace, ScenarioOverhead}
}

// simConfig is the pods' configuration: the Llama-3.1-8B-on-H100 cost model
// (bench/sim defaults) with KV capacity shrunk so that workingSet tokens
// are kvShare of the fleet's, and time running timeScale× faster.
func simConfig(p Preset, pods, workingSet int, timeScale float64) sim.Config {
	cfg := sim.DefaultConfig()
	cfg.Seed = p.Seed
	cfg.TimeScale = timeScale
	if p.TimeScale > 0 {
		cfg.TimeScale = p.TimeScale
	}
	if workingSet > 0 {
		cfg.NumGPUBlocks = int(math.Ceil(float64(workingSet) / kvShare / float64(pods) / float64(cfg.BlockSize)))
	}
	return cfg
}

// Scenarios returns the built-in policy comparisons for p (the overhead
// scenario is separate: see RunOverhead). The default sizes keep the
// prefix working set at ≈ 70% of the fleet's KV and more than twice one
// pod's by shrinking the pods' KV, not by growing the workload.
func Scenarios(p Preset) []Scenario {
	pods := p.Pods
	if pods <= 0 {
		pods = DefaultPods
	}
	var out []Scenario

	// SGLang's generated-shared-prefix (64 × 16, 2,048 + 128 → 256) in
	// Poisson stages of rising rate; --full uses llm-d's preset
	// (150 groups × 5, 6,000 + 1,200 → 1,000, 3 → 60 req/s).
	sp := WorkloadConfig{Kind: KindSharedPrefix, Seed: p.Seed}.Defaults()
	// Eight seconds per stage, 1,856 requests in all; round-robin's knee is
	// near 26 req/s on this fleet, the prefix policy's near 48, so the last
	// stages measure throughput at saturation.
	spStages := []Stage{{8, 64}, {16, 128}, {24, 192}, {32, 256}, {40, 320}, {48, 384}, {64, 512}}
	spScale := 1.0
	if p.Full {
		// 20 s per stage. A quarter of real time keeps the wall token rate
		// of the saturated stages near the default set's.
		sp = WorkloadConfig{Kind: KindSharedPrefix, Seed: p.Seed, Groups: 150, PromptsPerGroup: 5,
			SystemTokens: 6000, QuestionTokens: 1200, OutputTokens: 1000}
		spStages = []Stage{{3, 60}, {10, 200}, {20, 400}, {30, 600}, {40, 800}, {50, 1000}, {60, 1200}}
		spScale = 0.25
	}
	ws := sp.Groups * sp.SystemTokens
	out = append(out, Scenario{
		Name: ScenarioSharedPrefix,
		Description: "Groups of requests share a long system prompt (SGLang generated-shared-prefix); " +
			"the rate rises stage by stage. A cache-aware router should keep each group on one pod.",
		Pods: pods, Sim: simConfig(p, pods, ws, spScale), WorkingSet: ws,
		Workload: sp, Load: Load{Stages: spStages}, Seed: p.Seed,
		SLO: SLO{TTFT: 2000, TPOT: 100},
	})

	// vLLM's multi-turn shape: conversations resend their growing history;
	// each of Concurrency clients runs one conversation at a time.
	mt := WorkloadConfig{Kind: KindMultiTurn, Seed: p.Seed, Conversations: 48}.Defaults()
	mtConc := 24
	if p.Full {
		mt.Conversations, mtConc = 256, 64
	}
	mtWS := mtConc * (mt.PrefixTokens + (mt.TurnsMin+mt.TurnsMax)/2*((mt.UserMin+mt.UserMax)/2+(mt.AnswerMin+mt.AnswerMax)/2))
	out = append(out, Scenario{
		Name: ScenarioMultiTurn,
		Description: "Chat conversations of 12–18 turns resend their history (vLLM multi-turn); " +
			"a closed loop of clients, each running one conversation at a time.",
		Pods: pods, Sim: simConfig(p, pods, mtWS, 1), WorkingSet: mtWS, API: APIChat,
		Workload: mt, Load: Load{Arrival: ArrivalClosed, Concurrency: mtConc}, Seed: p.Seed,
		SLO: SLO{TTFT: 2000, TPOT: 100},
	})

	// No sharing: the no-regression case, on the shared-prefix fleet.
	rnd := WorkloadConfig{Kind: KindRandom, Seed: p.Seed, Requests: 384}.Defaults()
	rndRate := Rate(32)
	if p.Full {
		rnd.Requests, rndRate = 4096, 40
	}
	out = append(out, Scenario{
		Name:        ScenarioRandom,
		Description: "Every prompt is unique (1,024 in / 128 out): nothing to reuse, so no policy should lose here.",
		Pods:        pods, Sim: simConfig(p, pods, ws, 1),
		Workload: rnd, Load: Load{Rate: rndRate}, Seed: p.Seed,
		SLO: SLO{TTFT: 2000, TPOT: 100},
	})

	// One system prompt for all traffic: pure affinity would pin the whole
	// fleet's load on one pod.
	hp := WorkloadConfig{Kind: KindHotPrefix, Seed: p.Seed, Requests: 336}.Defaults()
	hpRate, hpScale := Rate(28), 1.0
	if p.Full {
		hp.Requests, hpRate, hpScale = 4096, 40, 0.5
	}
	out = append(out, Scenario{
		Name:        ScenarioHotPrefix,
		Description: "One system prompt for every request: the saturation case, where affinity must give way to load.",
		Pods:        pods, Sim: simConfig(p, pods, ws, hpScale),
		Workload: hp, Load: Load{Rate: hpRate}, Seed: p.Seed,
		SLO: SLO{TTFT: 2000, TPOT: 100},
	})

	// Mooncake trace replay (real arrival times and prefix structure).
	if p.TracePath != "" {
		tr := WorkloadConfig{Kind: KindTrace, Seed: p.Seed, TracePath: p.TracePath,
			TraceLimit: 300, TraceSpeedup: 4, TraceMaxInput: 8192, TraceMaxOutput: 512}
		if p.Full {
			tr.TraceLimit, tr.TraceSpeedup, tr.TraceMaxInput, tr.TraceMaxOutput = 3000, 1, 30000, 2000
		}
		cfg := simConfig(p, pods, 0, 1)
		cfg.NumGPUBlocks = 4096 // 64k tokens per pod: a few long prompts at a time
		if p.Full {
			cfg.NumGPUBlocks = 8192 // prompts up to 30k tokens
		}
		out = append(out, Scenario{
			Name:        ScenarioTrace,
			Description: "Replay of Moonshot AI's Mooncake conversation trace: real arrival times, prompt lengths and prefix reuse (text synthesised per 512-token hash id).",
			Pods:        pods, Sim: cfg,
			Workload: tr, Load: Load{Arrival: ArrivalTrace}, Seed: p.Seed,
			SLO: SLO{TTFT: 5000, TPOT: 100}, Timeout: 30 * time.Minute,
		})
	}
	return out
}
