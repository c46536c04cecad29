package scenario

import (
	"fmt"

	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/bench/workload"
)

// The pressure scenarios size the prefix working set at 1, 2 and 4 times
// the fleet's KV, where the other scenarios keep it inside kvShare (70%)
// of it: production caches are full. Each pod's KV is small beside the
// working set but large beside one request (a few dozen prompts fit), so
// that a full cache costs evictions, not admissions. Their reference for a
// finite cache is FixedAffinity, measured in the same run beside the
// infinite-cache ideal: every group cached on one pod, groups spread
// evenly.

// PressureNames lists the pressure scenarios in run order.
func PressureNames() []string {
	return []string{SharedPrefixPressure1, SharedPrefixPressure2, SharedPrefixPressure4,
		MultiTurnPressure1, MultiTurnPressure2, MultiTurnPressure4}
}

// pressurePods is the pressure scenarios' fleet size unless the preset
// sets one: four pods, as in the external-engine run of issue #24 that
// found the collapse, so that 4× stays a few thousand requests.
const pressurePods = 4

// pressureBlocks is each pod's KV in the shared-prefix pressure scenarios:
// 256 blocks of 16 = 4,096 tokens, nine of their 448-token prompts.
const pressureBlocks = 256

// pressurePolicies are the policies a pressure scenario compares: the
// load-only anchor, kvroute's, and the fixed-affinity reference.
var pressurePolicies = []string{LeastRequest, "prefix", FixedAffinity}

// pressure returns the pressure scenarios for p, fitted to its profile.
func pressure(p Preset) []Scenario {
	var out []Scenario
	for _, x := range []int{1, 2, 4} {
		out = append(out, fit(p, sharedPrefixPressure(p, x)), fit(p, multiTurnPressure(p, x)))
	}
	return out
}

func (p Preset) pressurePods() int {
	if p.Pods > 0 {
		return p.Pods
	}
	return pressurePods
}

// sharedPrefixPressure is shared-prefix with short prefixes (384 tokens,
// a 64-token question, 32 out; 12 prompts per group as in #24's run) and
// as many groups as fill x times the fleet's KV, rows shuffled: a group's
// prompts arrive spread over the whole run, so its prefix must survive
// every other group's traffic in between. Open loop at 32 req/s, about
// half of h100-8b's cold capacity on four pods (PodCapacity: ≈ 16 req/s
// per pod), so that what differs is the cache, not saturation.
func sharedPrefixPressure(p Preset, x int) Scenario {
	pods := p.pressurePods()
	cfg := sim.Config{Seed: p.Seed, TimeScale: 1, NumGPUBlocks: pressureBlocks}
	if p.TimeScale > 0 {
		cfg.TimeScale = p.TimeScale
	}
	kv := pods * pressureBlocks * sim.DefaultConfig().BlockSize
	const system = 384
	w := workload.Config{Kind: workload.KindSharedPrefix, Seed: p.Seed, Groups: (x*kv + system/2) / system,
		PromptsPerGroup: 12, SystemTokens: system, QuestionTokens: 64, OutputTokens: 32}
	return Scenario{
		Name: []string{1: SharedPrefixPressure1, 2: SharedPrefixPressure2, 4: SharedPrefixPressure4}[x],
		Description: fmt.Sprintf("Shared-prefix whose prefixes fill %d× the fleet's KV (%d groups of 384 tokens, 12 prompts each, shuffled): "+
			"the cache is full and evicts; fixed affinity (group g to pod g mod n) is the reference.", x, w.Groups),
		Pods: pods, Sim: cfg, WorkingSet: sharedPrefixWorkingSet(w),
		Workload: w, Load: load.Load{Rate: 32}, Seed: p.Seed, SLO: load.SLO{TTFT: 2000, TPOT: 100},
		Policies: pressurePolicies,
	}
}

// multiTurnPressure is multi-turn with shorter conversations (4–6 turns
// of the default lengths after the 500-token common prefix) and 48
// clients, the pods' KV cut so that the clients' histories fill x times
// the fleet's: at 4× a pod still holds two of the longest requests at
// once. 144 conversations, 720 requests.
func multiTurnPressure(p Preset, x int) Scenario {
	pods := p.pressurePods()
	mt := workload.Config{Kind: workload.KindMultiTurn, Seed: p.Seed, Conversations: 144, TurnsMin: 4, TurnsMax: 6}.Defaults()
	const conc = 48
	ws := conc * (mt.PrefixTokens + (mt.TurnsMin+mt.TurnsMax)/2*((mt.UserMin+mt.UserMax)/2+(mt.AnswerMin+mt.AnswerMax)/2))
	block := sim.DefaultConfig().BlockSize
	cfg := sim.Config{Seed: p.Seed, TimeScale: 1, NumGPUBlocks: (ws/(x*pods) + block - 1) / block}
	if p.TimeScale > 0 {
		cfg.TimeScale = p.TimeScale
	}
	return Scenario{
		Name: []string{1: MultiTurnPressure1, 2: MultiTurnPressure2, 4: MultiTurnPressure4}[x],
		Description: fmt.Sprintf("Multi-turn conversations (4–6 turns, 48 clients) whose histories fill %d× the fleet's KV: "+
			"fixed affinity (conversation c to pod c mod n) is the reference.", x),
		Pods: pods, Sim: cfg, WorkingSet: ws, API: workload.APIChat,
		Workload: mt, Load: load.Load{Arrival: load.ArrivalClosed, Concurrency: conc}, Seed: p.Seed,
		SLO: load.SLO{TTFT: 2000, TPOT: 100}, Policies: pressurePolicies,
	}
}

// tiersCPUShare is the CPU tier's size in the tiers scenario, in GPU KVs:
// with the working set at twice the GPU's, GPU + CPU hold it once and a
// half.
const tiersCPUShare = 2

// sharedPrefixTiers is shared-prefix-pressure-2x on pods with a CPU tier
// (vLLM's offloading) of tiersCPUShare × their GPU KV: evicted prefixes
// stay on CPU and load back at PCIe speed, for a router that knows they are
// there. It compares kvroute's engine truth with tiers (prefix-events)
// and without (prefix-events-gpu-only), the learned index, llm-d's precise
// scorer, least-request and fixed affinity. bench/sim only: the llm-d
// simulator has no CPU tier.
func sharedPrefixTiers(p Preset) Scenario {
	sc := sharedPrefixPressure(p, 2)
	sc.Name = SharedPrefixTiers
	sc.Sim.CPUBlocks = tiersCPUShare * sc.Sim.NumGPUBlocks
	sc.Description = fmt.Sprintf("Shared-prefix whose prefixes fill 2× the fleet's GPU KV (%d groups of 384 tokens, 12 prompts each, shuffled) "+
		"on pods with a CPU tier of %d× their GPU KV: the working set fits GPU + CPU; kvsim only.", sc.Workload.Groups, tiersCPUShare)
	sc.Policies = []string{LeastRequest, "prefix", PrefixEventsGPUOnly, PrefixEvents, LLMDPrecise, FixedAffinity}
	return sc
}
