package scenario_test

import (
	"context"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/scenario"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/bench/workload"
)

// A rolling update of three gossiping replicas under load: each replaced
// in turn, no request fails, and each new replica, having pulled its
// peers' state before it was ready, routes every group its peers had
// placed as warm from its first request (no cold decision); the same
// replicas without the update give the same span's reference.
func TestRollingUpdate(t *testing.T) {
	sc := scenario.Scenario{
		Name: "tiny-rolling", Pods: 2, Seed: 2,
		Sim: sim.Config{TimeScale: 10, NumGPUBlocks: 512, Seed: 1},
		Workload: workload.Config{Kind: workload.KindSharedPrefix, Seed: 2, Groups: 4, PromptsPerGroup: 18,
			SystemTokens: 256, QuestionTokens: 16, OutputTokens: 8},
		// 72 requests at 8 a second of wall time: the rollout runs
		// between the 24th and the 48th.
		Load:     load.Load{Arrival: load.ArrivalConstant, Rate: 0.8},
		Policies: []string{scenario.PrefixGossip + "-rolling", scenario.PrefixGossip},
	}
	var log strings.Builder
	rep, err := scenario.Run(context.Background(), sc, scenario.RunOptions{Log: &log})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rep.Runs {
		if r.Summary.Completed != 72 || r.Summary.Failed != 0 {
			t.Fatalf("%s: completed %d, failed %d %v", r.Label, r.Summary.Completed, r.Summary.Failed, r.Summary.Errors)
		}
	}
	ro := rep.Rollouts[sc.Policies[0]]
	if ro == nil || ro.Replaced != 3 || len(ro.ReadyMs) != 3 || len(ro.New) != 3 {
		t.Fatalf("rollout %+v\n%s", ro, log.String())
	}
	if ro.During.Requests == 0 || ro.Before.Requests == 0 || ro.EndS <= ro.StartS || ro.Steady == nil || ro.Steady.Requests == 0 {
		t.Errorf("windows %+v %+v, steady %+v", ro.Before, ro.During, ro.Steady)
	}
	for i, w := range ro.New {
		if w.Requests == 0 || w.Cold != 0 || w.CachedRate == 0 || w.PeersRequests == 0 {
			t.Errorf("new replica %d: %+v\n%s", i, w, log.String())
		}
	}
	if !strings.Contains(log.String(), "rolling update of 3 replicas") {
		t.Errorf("log without the rollout:\n%s", log.String())
	}
}
