package scenario

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/localengine"
)

// TestLocalSmoke runs a local scenario cut to 10 requests on two real
// servers of each engine with the fixed-affinity client (kvroute's probes
// are not what this checks), bounded to 30 s: every request answered, to
// the fleet's servers, and, on llama.cpp, which reports them, cached tokens
// where a group's prefix was sent before.
func TestLocalSmoke(t *testing.T) {
	for _, e := range []string{EngineLlamaCpp, EngineOllama} {
		if _, err := localengine.Find(e); errors.Is(err, localengine.ErrNoBinary) {
			t.Skipf("real engine %s absent (%v): Ollama and llama-server are in the workplace's ../shared/engines, not in the repository", e, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pols, err := SelectPolicies([]string{FixedAffinity})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range []string{EngineLlamaCpp, EngineOllama} {
		t.Run(e, func(t *testing.T) {
			sc, ok := Lookup(Preset{Engine: e, Pods: 2, Seed: 1}, LocalSharedPrefix4)
			if !ok {
				t.Fatal("no " + LocalSharedPrefix4)
			}
			sc.Load.Requests = 10
			rep, err := Run(ctx, sc, RunOptions{Policies: pols})
			if err != nil {
				t.Fatal(err)
			}
			s := rep.Runs[0].Summary
			if s.Completed != 10 || s.Failed != 0 || s.TTFT.Mean <= 0 || rep.Scenario.Fleet.Model != localengine.Model {
				t.Fatalf("summary %+v, model %q", s, rep.Scenario.Fleet.Model)
			}
			if e == EngineLlamaCpp && s.CachedTokens == 0 {
				t.Errorf("llama-server reported no cached tokens: %+v", s)
			}
			t.Logf("%s: TTFT mean %.0f ms, p90 %.0f ms, cached %.0f%%", e, s.TTFT.Mean, s.TTFT.P90, 100*s.CachedRate)
		})
	}
}
