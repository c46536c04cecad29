package scenario

import (
	"math"
	"reflect"
	"slices"
	"testing"

	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/routing"
)

// The capacity model, worked by hand for shared-prefix on h100-8b with the
// default fleet's KV (1,463 blocks = 23,408 tokens per pod): a request is
// 2,176 prompt tokens → 256; b = min(256, 23,408 ÷ 2,432) = 9 sequences;
// a decode step of 9 × (2,176 + 128) context tokens is 0.3 ms + (15.0 GB +
// 20,736 × 128 KiB) / 2.3 TB/s = 8.00 ms; the prefill adds 13 ms + 2,176 /
// 20k = 121.8 ms; so 1 / (0.1218 + 256 × 8.00 ms / 9) = 2.86 requests/s.
func TestPodCapacityArithmetic(t *testing.T) {
	cfg := sim.DefaultConfig()
	step := 0.0003 + (15.0e9+9*2304*131072)/2.3e12
	want := 1 / (0.013 + 2176.0/20000 + 256*step/9)
	if got := PodCapacity(cfg, 2176, 256, 23408); math.Abs(got/want-1) > 1e-6 || math.Abs(got-2.862) > 0.001 {
		t.Fatalf("PodCapacity = %.4f, want %.4f (≈ 2.862)", got, want)
	}
	// slow-large: max_num_seqs 8 binds before the KV does.
	var slow sim.Config
	if err := slow.ApplyProfile(sim.ProfileSlowLarge); err != nil {
		t.Fatal(err)
	}
	if err := slow.Validate(); err != nil {
		t.Fatal(err)
	}
	step = 0.0027 + (139e9+8*2304*327680)/5.6e12
	want = 1 / (0.050 + 2176.0/2200 + 256*step/8)
	if got := PodCapacity(slow, 2176, 256, 23408); math.Abs(got/want-1) > 1e-6 {
		t.Fatalf("slow-large PodCapacity = %.4f, want %.4f", got, want)
	}
	// A prompt over max_num_batched_tokens pays P0 once per chunk.
	one, two := PodCapacity(cfg, 8192, 1, 1<<20), PodCapacity(cfg, 8193, 1, 1<<20)
	if d := 1/two - 1/one; d < 0.013 || d > 0.0131 {
		t.Fatalf("a second chunk costs %.5f s, want P0 + 1/R ≈ 0.01305 s", d)
	}
}

// The factors the built-in scenarios get per profile (capacity ÷
// h100-8b's, two significant digits), and how they scale the loads.
func TestFitToProfile(t *testing.T) {
	for _, tc := range []struct {
		profile          string
		shared, random   float64
		timeScale        float64
		sharedFirstStage load.Stage
	}{
		{profile: sim.ProfileH100_8B, shared: 1, random: 1, timeScale: 1, sharedFirstStage: load.Stage{Rate: 8, Requests: 64}},
		{profile: sim.ProfileA100_8B, shared: 0.47, random: 0.43, timeScale: 1, sharedFirstStage: load.Stage{Rate: 3.76, Requests: 30}},
		{profile: sim.ProfileSlowLarge, shared: 0.18, random: 0.12, timeScale: 1, sharedFirstStage: load.Stage{Rate: 1.44, Requests: 12}},
		{profile: sim.ProfileFastSmall, shared: 2.1, random: 2.2, timeScale: 0.476, sharedFirstStage: load.Stage{Rate: 16.8, Requests: 64}},
		{profile: sim.ProfileMixed, shared: 0.74, random: 0.71, timeScale: 1, sharedFirstStage: load.Stage{Rate: 5.92, Requests: 47}},
	} {
		t.Run(tc.profile, func(t *testing.T) {
			p := Preset{Seed: 1, Profile: tc.profile}
			sp, _ := Lookup(p, SharedPrefix)
			rnd, _ := Lookup(p, Random)
			if sp.Sizing.Factor != tc.shared || rnd.Sizing.Factor != tc.random {
				t.Fatalf("factors %g (shared-prefix), %g (random); want %g, %g", sp.Sizing.Factor, rnd.Sizing.Factor, tc.shared, tc.random)
			}
			if sp.Sim.TimeScale != tc.timeScale || sp.Load.Stages[0] != tc.sharedFirstStage {
				t.Fatalf("time scale %g, first stage %+v; want %g, %+v", sp.Sim.TimeScale, sp.Load.Stages[0], tc.timeScale, tc.sharedFirstStage)
			}
			if want := load.Rate(roundSig(32*tc.random, 3)); rnd.Load.Rate != want {
				t.Fatalf("random at %v req/s, want %v", rnd.Load.Rate, want)
			}
			// The load spans the fleet's modelled capacity without a
			// cache (first stage below it) and with the prefixes cached
			// (the last stage is above twice it).
			cold := float64(sp.Pods) * sp.Sizing.PodCapacity
			if first, last := float64(sp.Load.Stages[0].Rate), float64(sp.Load.Stages[len(sp.Load.Stages)-1].Rate); first > cold/2 || last < 2*cold {
				t.Fatalf("stages %v–%v req/s for a cold capacity of %.1f", first, last, cold)
			}
			// An explicit time scale is kept.
			if sc, _ := Lookup(Preset{Seed: 1, Profile: tc.profile, TimeScale: 3}, HotPrefix); sc.Sim.TimeScale != 3 {
				t.Fatalf("explicit time scale became %g", sc.Sim.TimeScale)
			}
		})
	}
}

// On h100-8b fitting changes nothing: today's scenarios, byte for byte.
func TestFitDefaultIsIdentity(t *testing.T) {
	for _, full := range []bool{false, true} {
		p := Preset{Full: full, Seed: 1, TracePath: "trace.jsonl"}
		raw := []Scenario{sharedPrefix(p), multiTurn(p), random(p), hotPrefix(p), trace(p), demo(p)}
		for _, sc := range raw {
			got := fit(p, sc)
			if !reflect.DeepEqual(got.Load, sc.Load) || !reflect.DeepEqual(got.Sim, sc.Sim) ||
				got.Workload.Defaults() != sc.Workload.Defaults() {
				t.Errorf("full=%v %s: fitted %+v %+v, was %+v %+v", full, sc.Name, got.Load, got.Workload, sc.Load, sc.Workload)
			}
		}
	}
}

// The matrix compares the baseline, least-request, prefix and every peer,
// whatever the peers are.
func TestMatrixPolicies(t *testing.T) {
	own := routing.Policies()
	var got, peers []string
	for _, p := range MatrixPolicies() {
		got = append(got, p.Name)
	}
	for _, p := range Policies() {
		if _, ok := own[p.router()]; !ok {
			peers = append(peers, p.Name)
		}
	}
	want := append([]string{Baseline, LeastRequest, "prefix"}, peers...)
	if !slices.Equal(got, want) || len(peers) == 0 {
		t.Fatalf("MatrixPolicies() = %v, want %v", got, want)
	}
	if !slices.Contains(MatrixProfiles(), sim.ProfileMixed) || MatrixProfiles()[0] != sim.DefaultProfile {
		t.Fatalf("MatrixProfiles() = %v", MatrixProfiles())
	}
}

func TestReportOnly(t *testing.T) {
	rep := &Report{Runs: []*load.Result{{Label: "a"}, {Label: "b"}, {Label: "c"}}}
	only, all := rep.Only([]string{"c", "a"})
	if !all || len(only.Runs) != 2 || only.Runs[0].Label != "a" || len(rep.Runs) != 3 {
		t.Fatalf("Only(c, a) = %v, %v", only.Runs, all)
	}
	if _, all := rep.Only([]string{"a", "z"}); all {
		t.Fatal("Only reported a missing policy as present")
	}
}
