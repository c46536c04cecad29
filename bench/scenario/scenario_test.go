package scenario

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/bench/leakcheck"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/bench/workload"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

// Every built-in scenario, default and full, on every profile, must
// describe a valid run: a workload that builds, a load that validates, pods
// whose KV holds the largest request (and no more than the profile's
// hardware holds), and the sizing rule (working set ≈ 70% of the fleet's
// KV, more than twice one pod's).
func TestPresets(t *testing.T) {
	trace := filepath.Join(t.TempDir(), "trace.jsonl")
	line := `{"timestamp": 0, "input_length": 40000, "output_length": 3000, "hash_ids": [` +
		strings.TrimSuffix(strings.Repeat("1, ", 79), ", ") + `]}` + "\n"
	if err := os.WriteFile(trace, []byte(line), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, prof := range sim.ProfileNames() {
		for _, full := range []bool{false, true} {
			p := Preset{Full: full, TracePath: trace, Seed: 1, Profile: prof}
			scs := Builtin(p)
			if len(scs) != len(Names())-1 {
				t.Fatalf("full=%v: %d scenarios, want every name but overhead", full, len(scs))
			}
			d, _ := Lookup(p, Demo)
			for _, sc := range append(scs, d) {
				t.Run(fmt.Sprintf("%s/%s/full=%v", prof, sc.Name, full), func(t *testing.T) { checkPreset(t, sc, prof) })
			}
		}
	}
}

// checkPreset checks one built-in scenario on profile prof.
func checkPreset(t *testing.T, sc Scenario, prof string) {
	pods, share := DefaultPods, kvShare
	if x := pressureOf(sc.Name); x > 0 {
		pods, share = pressurePods, float64(x)
	}
	if sc.Pods != pods || sc.Profile != prof || sc.Sizing == nil {
		t.Fatalf("%d pods, profile %q, sizing %v", sc.Pods, sc.Profile, sc.Sizing)
	}
	if err := sc.Load.Validate(); err != nil {
		t.Fatal(err)
	}
	cfgs, err := sc.PodConfigs()
	if err != nil {
		t.Fatal(err)
	}
	c := sc.Workload.Defaults()
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	largest := c.SystemTokens + c.QuestionTokens + c.InputTokens + c.OutputTokens + 16
	switch c.Kind {
	case workload.KindMultiTurn:
		largest = c.PrefixTokens + c.TurnsMax*(c.UserMax+c.AnswerMax+16)
	case workload.KindTrace:
		largest = c.TraceMaxInput + c.TraceMaxOutput
	}
	profile, _ := sim.LookupProfile(prof)
	for i, cfg := range cfgs {
		if kv := cfg.NumGPUBlocks * cfg.BlockSize; kv < 2*largest || largest+1 > cfg.MaxModelLen && c.Kind != workload.KindMultiTurn {
			t.Fatalf("pod %d KV %d tokens for requests up to %d tokens (max model len %d)", i, kv, largest, cfg.MaxModelLen)
		}
		if cfg.NumGPUBlocks > profile.Engine(i).NumGPUBlocks || cfg.Model != cfgs[0].Model {
			t.Fatalf("pod %d: %d KV blocks (hardware: %d), model %s", i, cfg.NumGPUBlocks, profile.Engine(i).NumGPUBlocks, cfg.Model)
		}
	}
	if sc.WorkingSet > 0 {
		sc.describeFleet()
		got := sc.Fleet.WorkingSetShare
		if got < share-0.05*share || got > share+0.05*share || got*float64(sc.Pods) < 2 {
			t.Fatalf("working set is %.2f of the fleet's KV (want %.2f), %.1f× one pod's", got, share, got*float64(sc.Pods))
		}
	}
}

// pressureOf returns a pressure scenario's working set ÷ the fleet's KV,
// 0 for the others.
func pressureOf(name string) int {
	for i, n := range PressureNames() {
		if n == name {
			return []int{1, 2, 4}[i%3]
		}
	}
	return 0
}

func TestLookup(t *testing.T) {
	p := Preset{Seed: 1}
	for _, tc := range []struct {
		name string
		ok   bool
	}{
		{name: Demo, ok: true},
		{name: SharedPrefix, ok: true},
		{name: HotPrefix, ok: true},
		{name: Trace}, // no trace file
		{name: Overhead},
		{name: "nope"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sc, ok := Lookup(p, tc.name)
			if ok != tc.ok || ok && sc.Name != tc.name {
				t.Fatalf("Lookup(%q) = %q, %v; want ok %v", tc.name, sc.Name, ok, tc.ok)
			}
		})
	}
	t.Run("demo policies", func(t *testing.T) {
		sc, _ := Lookup(p, Demo)
		pols, err := SelectPolicies(sc.Policies)
		if err != nil || len(pols) != 4 || pols[0].Name != Baseline {
			t.Fatalf("demo policies %v: %d, %v", sc.Policies, len(pols), err)
		}
	})
}
