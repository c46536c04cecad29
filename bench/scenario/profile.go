package scenario

import (
	"fmt"
	"math"
	"strconv"

	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/bench/workload"
)

// minSingleRateRequests is the fewest requests a single-rate load (random,
// hot-prefix) is cut to on a slow profile, so that its p90 TTFT measures
// the steady state: every pod's first request of a shared prefix is cold
// (on 8 pods, 8 cold prefills), and with 96 requests those alone are 8% of
// the run, so a policy with two more cold requests than another lost the
// p90 to a cliff (warm 150 ms, cold 1 s on slow-large). With 200 they are
// 4%. On slow-large hot-prefix runs 40 s.
const minSingleRateRequests = 200

// Sizing records how a scenario's load was fitted to its engine profile
// (sim.Profiles). The built-in loads were written for h100-8b; on another
// profile the same workload, fleet size and KV sizing run at a load fitted
// to what the profile's pods sustain:
//
//	capacity = 1 / (prefill + out · step(b) / b)   requests/s per pod
//	prefill  = P0 + prompt/R   (a step's cost beyond a decode step's, per chunk)
//	b        = min(max_num_seqs, KV tokens per pod ÷ (prompt + out))
//	step(b)  = StepCost(0, b · (prompt + out/2))   (a decode step of b sequences)
//
// for the workload's mean request (prompt tokens all computed: no cache),
// averaged over the fleet's pods (see PodCapacity). The factor f is that
// capacity ÷ h100-8b's, rounded to two significant digits. Rates are
// multiplied by f, so every profile sees its load at the same share of its
// capacity as h100-8b does, below and above saturation alike. On a slower
// profile (f < 1) request counts are multiplied by f too, so stages last as
// many seconds as on h100-8b, and time runs at real speed: the router then
// sees the engine's true speed on its own clock, which is what a policy
// that learns the engine's speed must face. On a faster one (f > 1) request
// counts stay and the time scale is divided by f: the machine streams as
// many tokens per wall second as on h100-8b (two cores cannot stream f
// times more), each stage lasting as long in wall time.
type Sizing struct {
	Profile string `json:"profile"`
	// PodCapacity is the requests/s one pod of the profile sustains on the
	// workload's mean request (the model above), averaged over the fleet;
	// ReferenceCapacity is h100-8b's.
	PodCapacity       float64 `json:"pod_capacity_rps"`
	ReferenceCapacity float64 `json:"reference_capacity_rps"`
	// Factor multiplies request rates: PodCapacity ÷ ReferenceCapacity, to
	// two significant digits.
	Factor float64 `json:"factor"`
	// Requests multiplies request counts: min(1, Factor).
	Requests float64 `json:"requests_factor"`
	// TimeScale multiplies the time scale: min(1, 1/Factor).
	TimeScale float64 `json:"time_scale_factor"`
}

// MatrixProfiles lists the profiles of the matrix (see Matrix): the
// default, a slow large model, a fast small one and a fleet of two GPU
// generations (a100-8b appears as half of mixed).
func MatrixProfiles() []string {
	return []string{sim.ProfileH100_8B, sim.ProfileSlowLarge, sim.ProfileFastSmall, sim.ProfileMixed}
}

// PodCapacity returns the requests/s one pod configured as cfg (defaults
// filled) sustains on requests of prompt tokens, all computed, and output
// tokens, with kvTokens of KV: the capacity model of Sizing. A purely
// analytic figure (no simulation): it sets loads, it is not a result.
func PodCapacity(cfg sim.Config, prompt, output, kvTokens int) float64 {
	perSeq := max(1, prompt+output)
	b := min(cfg.MaxNumSeqs, max(1, kvTokens/perSeq))
	step := cfg.StepCost(0, b*(prompt+output/2))
	var prefill float64
	for left := prompt; left > 0; left -= cfg.MaxNumBatchedTokens {
		chunk := min(left, cfg.MaxNumBatchedTokens)
		prefill += (cfg.StepCost(chunk, 0) - cfg.StepCost(0, 0)).Seconds()
	}
	return 1 / (prefill + float64(output)*step.Seconds()/float64(b))
}

// meanRequest returns a workload's mean prompt and output lengths in
// tokens. A trace's lengths are not known before it is read; it is sized
// by shared-prefix's request (2,176 → 256).
func meanRequest(c workload.Config) (prompt, output int) {
	c = c.Defaults()
	switch c.Kind {
	case workload.KindSharedPrefix, workload.KindHotPrefix, workload.KindNearIdentical:
		return c.SystemTokens + c.QuestionTokens, c.OutputTokens
	case workload.KindRandom:
		return c.InputTokens, c.OutputTokens
	case workload.KindMultiTurn:
		// Turn k of T resends the prefix, k user turns and k-1 answers;
		// the mean over k = 1..T.
		turns := float64(c.TurnsMin+c.TurnsMax) / 2
		user, answer := float64(c.UserMin+c.UserMax)/2, float64(c.AnswerMin+c.AnswerMax)/2
		return c.PrefixTokens + int((turns+1)/2*user+(turns-1)/2*answer), int(answer)
	}
	ref := workload.Config{Kind: workload.KindSharedPrefix}.Defaults()
	return ref.SystemTokens + ref.QuestionTokens, ref.OutputTokens
}

// fleetCapacity is PodCapacity averaged over pods pods of the profile
// called name, each with base's explicit settings.
func fleetCapacity(name string, pods int, base sim.Config, prompt, output int) (float64, error) {
	p, err := sim.LookupProfile(name)
	if err != nil {
		return 0, err
	}
	var sum float64
	for _, cfg := range p.Configs(pods, base) {
		if err := cfg.Validate(); err != nil {
			return 0, err
		}
		sum += PodCapacity(cfg, prompt, output, cfg.NumGPUBlocks*cfg.BlockSize)
	}
	return sum / float64(pods), nil
}

// SizeFor returns how sc (built for h100-8b) is fitted to the profile
// called name: its capacity factor from the model of Sizing, at sc's fleet
// size and KV.
func SizeFor(name string, sc Scenario) (Sizing, error) {
	prompt, output := meanRequest(sc.Workload)
	c, err := fleetCapacity(name, sc.Pods, sc.Sim, prompt, output)
	if err != nil {
		return Sizing{}, err
	}
	ref, err := fleetCapacity(sim.DefaultProfile, sc.Pods, sc.Sim, prompt, output)
	if err != nil {
		return Sizing{}, err
	}
	f := roundSig(c/ref, 2)
	return Sizing{Profile: name, PodCapacity: c, ReferenceCapacity: ref, Factor: f,
		Requests: min(1, f), TimeScale: min(1, 1/f)}, nil
}

// fit returns sc, built for h100-8b, on p's profile: sized by SizeFor and
// scaled as Sizing says. An unknown profile is
// recorded as is; Run then fails on it.
func fit(p Preset, sc Scenario) Scenario {
	name := p.profile()
	sc.Profile, sc.Engine = name, p.Engine
	s, err := SizeFor(name, sc)
	if err != nil {
		return sc
	}
	sc.Sizing = &s
	l := &sc.Load
	l.Rate = scaleRate(l.Rate, s.Factor)
	l.Requests = scaleCount(l.Requests, s.Requests)
	l.Stages = append([]load.Stage(nil), l.Stages...)
	for i := range l.Stages {
		l.Stages[i].Rate = scaleRate(l.Stages[i].Rate, s.Factor)
		l.Stages[i].Requests = max(1, scaleCount(l.Stages[i].Requests, s.Requests))
	}
	w := &sc.Workload
	switch w.Kind {
	case workload.KindRandom, workload.KindHotPrefix:
		// One rate, so its p90 must come from enough requests.
		n := w.Defaults().Requests
		w.Requests = max(min(n, minSingleRateRequests), scaleCount(n, s.Requests))
	case workload.KindMultiTurn:
		// Fewer conversations, never fewer than the clients running them
		// (the KV was sized to that many histories).
		w.Conversations = max(l.Concurrency, scaleCount(w.Defaults().Conversations, s.Requests))
	case workload.KindTrace:
		w.TraceSpeedup = roundSig(w.Defaults().TraceSpeedup*s.Factor, 3)
		w.TraceLimit = scaleCount(w.TraceLimit, s.Requests)
	}
	if ts := sc.Sim.TimeScale; p.TimeScale <= 0 {
		if ts == 0 {
			ts = 1
		}
		sc.Sim.TimeScale = roundSig(ts*s.TimeScale, 3)
	}
	return sc
}

// scaleRate multiplies a finite rate by f (three significant digits).
func scaleRate(r load.Rate, f float64) load.Rate {
	if r == 0 || math.IsInf(float64(r), 0) {
		return r
	}
	return load.Rate(roundSig(float64(r)*f, 3))
}

// scaleCount multiplies a count by f, rounding; 0 stays 0.
func scaleCount(n int, f float64) int {
	if n == 0 {
		return 0
	}
	return max(1, int(math.Round(float64(n)*f)))
}

// roundSig rounds v to digits significant digits.
func roundSig(v float64, digits int) float64 {
	r, err := strconv.ParseFloat(strconv.FormatFloat(v, 'g', digits, 64), 64)
	if err != nil {
		return v
	}
	return r
}

// PodConfigs returns the configs of sc's pods: sc.Sim for each, with its
// zero engine fields filled from the profile's engines (sim.Profile.Configs)
// when sc.Profile is set, and Seed sc.Sim.Seed+i; defaults filled.
func (sc *Scenario) PodConfigs() ([]sim.Config, error) {
	var cfgs []sim.Config
	if sc.Profile == "" {
		cfgs = make([]sim.Config, sc.Pods)
		for i := range cfgs {
			cfgs[i] = sc.Sim
			cfgs[i].Seed = sc.Sim.Seed + uint64(i)
		}
	} else {
		p, err := sim.LookupProfile(sc.Profile)
		if err != nil {
			return nil, fmt.Errorf("%w: scenario %s: %w", ErrConfig, sc.Name, err)
		}
		cfgs = p.Configs(sc.Pods, sc.Sim)
	}
	for i := range cfgs {
		if err := cfgs[i].Validate(); err != nil {
			return nil, fmt.Errorf("scenario %s, pod %d: %w", sc.Name, i, err)
		}
	}
	return cfgs, nil
}
