package scenario

import (
	"context"
	"testing"

	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/bench/workload"
)

// The policies fed by the engines' KV events, and replicas with and
// without them, on a tiny kvsim fleet: every request completes, and each
// policy with events was fed the pods' events.
func TestEventsPolicies(t *testing.T) {
	sc := Scenario{
		Name: "tiny-events", Pods: 2,
		Sim: sim.Config{TimeScale: 50, NumGPUBlocks: 256, Seed: 1},
		Workload: workload.Config{Kind: workload.KindSharedPrefix, Seed: 4, Groups: 4, PromptsPerGroup: 4,
			SystemTokens: 256, QuestionTokens: 32, OutputTokens: 16},
		Load: load.Load{Stages: []load.Stage{{Rate: 20, Requests: 16}}},
	}
	sc.describeFleet()
	wl, err := sc.Workload.Build()
	if err != nil {
		t.Fatal(err)
	}
	pols, err := SelectPolicies([]string{"prefix-3-replicas", PrefixEvents, PrefixEvents + "-3-replicas", LLMDPrecise})
	if err != nil || len(pols) != 4 {
		t.Fatalf("policies %v: %v", pols, err)
	}
	for _, p := range pols {
		res, seen, err := runPolicy(context.Background(), sc, wl, p, RunOptions{})
		if err != nil {
			t.Fatalf("%s: %v", p.Name, err)
		}
		if res.Summary.Completed != 16 || res.Summary.Failed != 0 {
			t.Errorf("%s: completed %d, failed %d %v", p.Name, res.Summary.Completed, res.Summary.Failed, res.Summary.Errors)
		}
		if p.Events && seen.kvBatches == 0 {
			t.Errorf("%s: the policy was fed no KV-event batches", p.Name)
		}
		t.Logf("%s: %d KV-event batches; %s", p.Name, seen.kvBatches, seen.index)
	}
}

// The tiers scenario: the pressure-2x workload on pods with a CPU tier of
// twice their GPU KV, the tier-blind and tier-aware engine truth among its
// policies, and kvsim only.
func TestTiersScenario(t *testing.T) {
	sc, ok := Lookup(Preset{Seed: 1}, SharedPrefixTiers)
	if !ok {
		t.Fatal("no tiers scenario")
	}
	cfgs, err := sc.PodConfigs()
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range cfgs {
		if c.CPUBlocks != tiersCPUShare*c.NumGPUBlocks || c.CPUBlocks == 0 {
			t.Fatalf("pod %d: %d CPU blocks for %d GPU blocks", i, c.CPUBlocks, c.NumGPUBlocks)
		}
	}
	if _, err := SelectPolicies(sc.Policies); err != nil {
		t.Fatal(err)
	}
	sc.Engine = EngineLLMD
	p, _ := SelectPolicies([]string{PrefixEvents})
	if _, _, err := runPolicy(context.Background(), sc, nil, p[0], RunOptions{}); err == nil {
		t.Fatal("the tiers scenario ran on the llm-d simulator, which has no CPU tier")
	}
}
