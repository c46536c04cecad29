package sim

import (
	"fmt"
	"time"
)

// Engine and profile names (see Profiles).
const (
	ProfileH100_8B   = "h100-8b"
	ProfileA100_8B   = "a100-8b"
	ProfileSlowLarge = "slow-large"
	ProfileFastSmall = "fast-small"
	ProfileMixed     = "mixed"
	// DefaultProfile is the profile whose engine DefaultConfig describes.
	DefaultProfile = ProfileH100_8B
)

// Engine is one pod's model and hardware: the Config fields that the cost
// model (StepCost), the KV capacity and the batch limit read. Zero fields
// leave Config's defaults (DefaultConfig's Llama-3.1-8B on one H100).
type Engine struct {
	// Name names the engine (hardware and model size), e.g. "a100-8b".
	Name string `json:"name"`
	// The Config fields of the same names.
	Model               string        `json:"model"`
	TPSize              int           `json:"tp_size"`
	NumGPUBlocks        int           `json:"num_gpu_blocks"`
	MaxNumSeqs          int           `json:"max_num_seqs"`
	StepOverhead        time.Duration `json:"step_overhead"`
	WeightBytes         float64       `json:"weight_bytes"`
	KVBytesPerToken     float64       `json:"kv_bytes_per_token"`
	MemBandwidth        float64       `json:"mem_bandwidth"`
	PrefillTokensPerSec float64       `json:"prefill_tokens_per_sec"`
	PrefillStepOverhead time.Duration `json:"prefill_step_overhead"`
}

// Fill sets every zero engine field of c from e: settings made explicitly
// (flags, a scenario's KV sizing) win over the engine's, as they win over
// the defaults.
func (e Engine) Fill(c *Config) {
	str := func(p *string, v string) {
		if *p == "" {
			*p = v
		}
	}
	num := func(p *int, v int) {
		if *p == 0 {
			*p = v
		}
	}
	f64 := func(p *float64, v float64) {
		if *p == 0 {
			*p = v
		}
	}
	dur := func(p *time.Duration, v time.Duration) {
		if *p == 0 {
			*p = v
		}
	}
	str(&c.Model, e.Model)
	num(&c.TPSize, e.TPSize)
	num(&c.NumGPUBlocks, e.NumGPUBlocks)
	num(&c.MaxNumSeqs, e.MaxNumSeqs)
	dur(&c.StepOverhead, e.StepOverhead)
	f64(&c.WeightBytes, e.WeightBytes)
	f64(&c.KVBytesPerToken, e.KVBytesPerToken)
	f64(&c.MemBandwidth, e.MemBandwidth)
	f64(&c.PrefillTokensPerSec, e.PrefillTokensPerSec)
	dur(&c.PrefillStepOverhead, e.PrefillStepOverhead)
}

// The engines of the profiles. Each derives the cost model's constants
// (docs/engines.md, "The simulator") the way the defaults do: KV bytes per token from
// the model's layers × KV heads × head dim × K and V × 2 bytes; the weight
// bytes one step reads (bf16, without the input embedding, of which a step
// gathers a few rows, unless the embedding is tied to the output layer);
// ≈ 69% of the GPUs' HBM bandwidth, as the H100 achieves; the prefill rate
// from 2 FLOP per parameter per token at the MFU the H100 reaches; a
// prefill step's fixed cost P0 ≈ 2 × the weight pass W/B, as for the
// default (13 ms ≈ 2 × 6.5 ms); and KV capacity from the memory left at
// gpu_memory_utilization 0.9.
var (
	// engineH100_8B is Llama-3.1-8B-Instruct on one H100 SXM 80 GB:
	// exactly DefaultConfig's constants (see Config's field comments).
	// Decode step at batch 1 with a 2k context 6.94 ms, at batch 64
	// 14.3 ms; a cold 2,048-token prompt 122 ms.
	engineH100_8B = Engine{Name: ProfileH100_8B, Model: "meta-llama/Llama-3.1-8B-Instruct", TPSize: 1,
		NumGPUBlocks: 28125, MaxNumSeqs: 256, StepOverhead: 300 * time.Microsecond,
		WeightBytes: 15.0e9, KVBytesPerToken: 131072, MemBandwidth: 2.3e12,
		PrefillTokensPerSec: 20000, PrefillStepOverhead: 13 * time.Millisecond}

	// engineA100_8B is the same model on one A100 SXM 80 GB, a GPU
	// generation older. Bandwidth: 69% of 2.039 TB/s ≈ 1.4 TB/s (0.61 of
	// the H100's). Prefill: 16 GFLOP per token at 32% of 312 bf16 TFLOPS
	// ≈ 6,200 tokens/s (0.31 of the H100's). P0 ≈ 2 × 15.0 GB / 1.4 TB/s
	// ≈ 21 ms. Same 80 GB, so the same 28,125 blocks. Decode step at batch
	// 1 with a 2k context 11.2 ms, at batch 64 23.3 ms; a cold 2,048-token
	// prompt 363 ms (3.0× the H100's).
	engineA100_8B = Engine{Name: ProfileA100_8B, Model: "meta-llama/Llama-3.1-8B-Instruct", TPSize: 1,
		NumGPUBlocks: 28125, MaxNumSeqs: 256, StepOverhead: 300 * time.Microsecond,
		WeightBytes: 15.0e9, KVBytesPerToken: 131072, MemBandwidth: 1.4e12,
		PrefillTokensPerSec: 6200, PrefillStepOverhead: 21 * time.Millisecond}

	// engine4xA100_70B is Llama-3.1-70B-Instruct in bf16, tensor-parallel
	// over 4 × A100 SXM 80 GB (NVLink). KV: 80 layers × 8 KV heads × 128
	// × 2 × 2 bytes = 320 KiB per token. Weights: 70.55 B parameters × 2
	// bytes = 141.1 GB less the 2.1 GB input embedding = 139 GB per step.
	// Bandwidth: 4 × 69% of 2.039 TB/s ≈ 5.6 TB/s. Step overhead: 0.3 ms
	// plus two all-reduces per layer (160 of ≈ 15 µs) = 2.7 ms. Prefill:
	// 141 GFLOP per token at 25% of 4 × 312 TFLOPS (the H100's 32% less
	// the all-reduces) ≈ 2,200 tokens/s. P0 ≈ 2 × 139 GB / 5.6 TB/s ≈
	// 50 ms. KV: 4 × 80 GB × 0.9 = 288 GB less 141 GB of weights and
	// ≈ 12 GB of activations ≈ 135 GB ≈ 411k tokens = 25,700 blocks.
	// max_num_seqs 8, a latency-bound setting: every stream keeps ≈ 28 ms
	// per token. Decode step at batch 1 with a 2k context 27.6 ms, at
	// batch 8 28.5 ms; a cold 2,048-token prompt 1.01 s.
	engine4xA100_70B = Engine{Name: "4xa100-70b", Model: "meta-llama/Llama-3.1-70B-Instruct", TPSize: 4,
		NumGPUBlocks: 25700, MaxNumSeqs: 8, StepOverhead: 2700 * time.Microsecond,
		WeightBytes: 139.0e9, KVBytesPerToken: 327680, MemBandwidth: 5.6e12,
		PrefillTokensPerSec: 2200, PrefillStepOverhead: 50 * time.Millisecond}

	// engineH100_3B is Llama-3.2-3B-Instruct on one H100 SXM 80 GB. KV: 28
	// layers × 8 KV heads × 128 × 2 × 2 bytes = 112 KiB per token.
	// Weights: 3.21 B parameters × 2 bytes = 6.43 GB, all read per step
	// (the embedding is tied to the output layer). Bandwidth as the
	// default's, 2.3 TB/s. Prefill: 6.4 GFLOP per token at 32% of 989
	// TFLOPS ≈ 49k, 50,000 tokens/s. P0 ≈ 2 × 6.43 GB / 2.3 TB/s ≈ 5.6 ms.
	// KV: 72 GB less 6.4 GB of weights and ≈ 1.6 GB of activations =
	// 64 GB ≈ 558k tokens = 34,900 blocks. Decode step at batch 1 with a 2k
	// context 3.2 ms, at batch 16 4.7 ms, at batch 64 9.6 ms; a cold
	// 2,048-token prompt 50 ms.
	engineH100_3B = Engine{Name: "h100-3b", Model: "meta-llama/Llama-3.2-3B-Instruct", TPSize: 1,
		NumGPUBlocks: 34900, MaxNumSeqs: 256, StepOverhead: 300 * time.Microsecond,
		WeightBytes: 6.43e9, KVBytesPerToken: 114688, MemBandwidth: 2.3e12,
		PrefillTokensPerSec: 50000, PrefillStepOverhead: 5600 * time.Microsecond}
)

// Profile is a named simulated fleet: pod i of a fleet of n runs
// Engines[i % len(Engines)]. Every engine of a profile serves the same
// model name, since clients send one.
type Profile struct {
	Name string `json:"name"`
	// About says what the profile stands for.
	About   string   `json:"about"`
	Engines []Engine `json:"engines"`
}

// Profiles returns every profile, the default first. Benchmarks run their
// scenarios on several so that no policy is tuned to one engine's speed.
//
//   - h100-8b: Llama-3.1-8B on one H100 (DefaultConfig), the engine the
//     defaults and the routing priors were written for.
//   - a100-8b: the same model on one A100: ≈ 0.6× the decode bandwidth,
//     ≈ 0.3× the prefill rate.
//   - slow-large: Llama-3.1-70B on 4 × A100 (TP 4): 2,200 prefill
//     tokens/s, ≈ 28 ms per output token, max_num_seqs 8.
//   - fast-small: Llama-3.2-3B on one H100: 50,000 prefill tokens/s,
//     3–5 ms per output token at batch 1–16, max_num_seqs 256.
//   - mixed: a fleet of two GPU generations serving one model, h100-8b and
//     a100-8b pods alternating.
func Profiles() []Profile {
	return []Profile{
		{Name: ProfileH100_8B, About: "Llama-3.1-8B on one H100 (the defaults)", Engines: []Engine{engineH100_8B}},
		{Name: ProfileA100_8B, About: "Llama-3.1-8B on one A100", Engines: []Engine{engineA100_8B}},
		{Name: ProfileSlowLarge, About: "Llama-3.1-70B on 4×A100 (TP 4), max_num_seqs 8", Engines: []Engine{engine4xA100_70B}},
		{Name: ProfileFastSmall, About: "Llama-3.2-3B on one H100", Engines: []Engine{engineH100_3B}},
		{Name: ProfileMixed, About: "Llama-3.1-8B, H100 and A100 pods alternating", Engines: []Engine{engineH100_8B, engineA100_8B}},
	}
}

// ProfileNames returns the names of Profiles(), in order.
func ProfileNames() []string {
	ps := Profiles()
	names := make([]string, len(ps))
	for i, p := range ps {
		names[i] = p.Name
	}
	return names
}

// LookupProfile returns the profile called name; "" is DefaultProfile.
func LookupProfile(name string) (Profile, error) {
	if name == "" {
		name = DefaultProfile
	}
	for _, p := range Profiles() {
		if p.Name == name {
			return p, nil
		}
	}
	return Profile{}, fmt.Errorf("%w: unknown profile %q (known: %v)", ErrConfig, name, ProfileNames())
}

// Engine returns the engine of pod i.
func (p Profile) Engine(i int) Engine { return p.Engines[i%len(p.Engines)] }

// Configs returns the configs of a fleet of n pods of p: pod i is base with
// its zero engine fields filled from p.Engine(i) (see Engine.Fill), Seed
// base.Seed+i and, when set, KV event ports base's +i, as StartFleet
// numbers them.
func (p Profile) Configs(n int, base Config) []Config {
	cfgs := make([]Config, n)
	for i := range cfgs {
		cfgs[i] = base.forPod(i)
		p.Engine(i).Fill(&cfgs[i])
	}
	return cfgs
}

// ApplyProfile fills c's zero engine fields from the named single-engine
// profile (see Engine.Fill); a fleet profile of several engines (mixed)
// needs Profile.Configs.
func (c *Config) ApplyProfile(name string) error {
	p, err := LookupProfile(name)
	if err != nil {
		return err
	}
	if len(p.Engines) != 1 {
		return fmt.Errorf("%w: profile %q mixes %d engines; use Profile.Configs", ErrConfig, name, len(p.Engines))
	}
	p.Engines[0].Fill(c)
	return nil
}

// StartProfileFleet starts n pods of p on 127.0.0.1:0, pod i configured as
// p.Configs(n, base)[i].
func StartProfileFleet(p Profile, n int, base Config) (*Fleet, error) {
	return StartFleetOf(p.Configs(n, base)...)
}
