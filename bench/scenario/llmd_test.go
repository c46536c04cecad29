package scenario_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/bench/llmd"
	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/report"
	"github.com/kvroute/kvroute/bench/scenario"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/bench/workload"
)

// requireLLMD skips where the external engine is absent (a user's clone:
// the simulator lives in the workplace's ../shared/engines).
func requireLLMD(t *testing.T) {
	t.Helper()
	if _, err := llmd.Binary(""); errors.Is(err, llmd.ErrNoBinary) {
		t.Skipf("external engine absent: %v", err)
	} else if err != nil {
		t.Fatal(err)
	}
}

// A scenario on the external engine end to end: llm-d simulator processes
// started by the harness behind an in-process kvroute (and, for the
// fixed-affinity reference, no router), a working set twice the fleet's
// KV. Every request completes, the engines' counters are read, the
// reference keeps each group on one pod, and the report says which engine
// ran with what settings.
func TestRunScenarioOnLLMD(t *testing.T) {
	requireLLMD(t)
	sc := scenario.Scenario{
		Name: "tiny-pressure", Pods: 2, Engine: scenario.EngineLLMD,
		Sim:        sim.Config{TimeScale: 10, NumGPUBlocks: 64, Seed: 1},
		WorkingSet: 16 * 128,
		Workload: workload.Config{Kind: workload.KindSharedPrefix, Seed: 3, Groups: 16, PromptsPerGroup: 4,
			SystemTokens: 128, QuestionTokens: 16, OutputTokens: 4},
		Load:     load.Load{Rate: 40},
		Policies: []string{scenario.LeastRequest, "prefix", scenario.FixedAffinity},
	}
	rep, err := scenario.Run(context.Background(), sc, scenario.RunOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) != 3 || rep.Scenario.Fleet.LLMD == nil || rep.Scenario.Fleet.LLMD.KVBlocks != 64 {
		t.Fatalf("%d runs, llm-d settings %+v", len(rep.Runs), rep.Scenario.Fleet.LLMD)
	}
	hit := map[string]float64{}
	for _, r := range rep.Runs {
		if r.Summary.Completed != 64 || r.Summary.Failed != 0 || r.Engine == nil || r.Engine.PrefixQueries == 0 {
			t.Fatalf("%s: completed %d, failed %d %v, engine %+v", r.Label, r.Summary.Completed, r.Summary.Failed, r.Summary.Errors, r.Engine)
		}
		hit[r.Label] = r.Engine.HitRate
	}
	if hit[scenario.FixedAffinity] <= 0 {
		t.Errorf("fixed affinity hit nothing: %v", hit)
	}
	if md := report.Markdown(rep); !strings.Contains(md, "llm-d") || !strings.Contains(md, "| "+scenario.FixedAffinity+" |") {
		t.Errorf("the table does not name the engine or the reference:\n%s", md)
	}
	t.Logf("hit rates %v", hit)
}
