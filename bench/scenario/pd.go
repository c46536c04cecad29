package scenario

import (
	"math"

	"github.com/kvroute/kvroute/app"
	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/bench/workload"
)

// Prefill/decode disaggregation scenarios: one fleet of pods, the same
// cost model per pod (the same GPUs), laid out aggregated (every pod mixed)
// or split into a prefill and a decode pool, always behind kvroute's
// prefix policy; kvroute runs the prefill legs itself (vLLM protocol).

// PD scenario names (kvbench --scenario; not part of Names: make bench-pd).
const (
	PDLongPrompt = "pd-long-prompt"
	PDLongOutput = "pd-long-output"
	PDSelective  = "pd-selective"
)

// PDNames lists the PD scenarios.
func PDNames() []string { return []string{PDLongPrompt, PDLongOutput, PDSelective} }

// PDLayouts are the fleet layouts the PD scenarios compare. Names assume
// the default 8 pods; on another fleet the shares hold.
func PDLayouts() []Policy {
	always := func(c *app.Config) { c.PDMinUncachedTokens = 1 }
	return []Policy{
		{Name: "aggregated", Router: "prefix", About: "8 mixed pods: prefill and decode share each GPU"},
		{Name: "pd-4p4d", Router: "prefix", PrefillShare: 0.5, About: "4 prefill + 4 decode pods, selective PD (default threshold)"},
		{Name: "pd-2p6d", Router: "prefix", PrefillShare: 0.25, About: "2 prefill + 6 decode pods, selective PD"},
		{Name: "pd-4p4d-always", Router: "prefix", PrefillShare: 0.5, Configure: always,
			About: "4 prefill + 4 decode pods, every request with a prefill leg (--pd-min-uncached-tokens 1)"},
	}
}

// prefillPods returns how many of n pods p makes prefill pods (0:
// aggregated; at least one pod of each role otherwise).
func (p Policy) prefillPods(n int) int {
	if p.PrefillShare <= 0 || n < 2 {
		return 0
	}
	return min(n-1, max(1, int(math.Round(p.PrefillShare*float64(n)))))
}

// layOut gives cfgs the roles p's layout asks for: prefill pods first.
func (p Policy) layOut(cfgs []sim.Config) {
	n := p.prefillPods(len(cfgs))
	if n == 0 {
		return
	}
	for i := range cfgs {
		cfgs[i].Role = sim.RoleDecode
		if i < n {
			cfgs[i].Role = sim.RolePrefill
		}
	}
}

// pdScenario returns the PD scenario called name.
func pdScenario(p Preset, name string) (Scenario, bool) {
	pods := p.pods()
	layouts := []string{"aggregated", "pd-4p4d", "pd-2p6d", "pd-4p4d-always"}
	slo := load.SLO{TTFT: 2000, TPOT: 100}
	switch name {
	case PDLongPrompt:
		wl := workload.Config{Kind: workload.KindRandom, Seed: p.Seed, Requests: 384, InputTokens: 4096, OutputTokens: 64}
		return Scenario{
			Name: name, Description: "Long new prompts, short answers (4,096 in / 64 out, nothing shared): prefill-heavy, the case disaggregation is for.",
			Pods: pods, Sim: simConfig(p, pods, 0, 1), Workload: wl, Seed: p.Seed, SLO: slo, Policies: layouts,
			Load: load.Load{Stages: []load.Stage{{Rate: 8, Requests: 64}, {Rate: 16, Requests: 128}, {Rate: 24, Requests: 192}}},
		}, true
	case PDLongOutput:
		wl := workload.Config{Kind: workload.KindRandom, Seed: p.Seed, Requests: 288, InputTokens: 256, OutputTokens: 1024}
		return Scenario{
			Name: name, Description: "Short prompts, long answers (256 in / 1,024 out): decode-heavy, where a prefill pool idles.",
			Pods: pods, Sim: simConfig(p, pods, 0, 2), Workload: wl, Seed: p.Seed, SLO: slo, Policies: layouts,
			Load: load.Load{Stages: []load.Stage{{Rate: 8, Requests: 64}, {Rate: 16, Requests: 96}, {Rate: 32, Requests: 128}}},
		}, true
	case PDSelective:
		sp := sharedPrefixWorkload(p)
		ws := sharedPrefixWorkingSet(sp)
		return Scenario{
			Name: name, Description: "Shared-prefix (SGLang generated-shared-prefix): most prompt tokens are cached on the decode pods, so selective PD sends few requests through a prefill pod and always-PD sends all.",
			Pods: pods, Sim: simConfig(p, pods, ws, 1), WorkingSet: ws, Workload: sp, Seed: p.Seed, SLO: slo, Policies: layouts,
			Load: load.Load{Stages: []load.Stage{{Rate: 8, Requests: 64}, {Rate: 16, Requests: 128}, {Rate: 24, Requests: 192}, {Rate: 32, Requests: 256}}},
		}, true
	}
	return Scenario{}, false
}
