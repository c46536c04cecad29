package scenario

import (
	"context"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/kvroute/kvroute/bench/llmd"
	"github.com/kvroute/kvroute/bench/sim"
)

// The engines a scenario's pods can run: the project's simulator
// (bench/sim, in process) or the public llm-d inference simulator
// (bench/llmd, one process per pod), whose scheduler, latency model and
// cache nobody here wrote.
const (
	EngineKVSim = "kvsim"
	EngineLLMD  = "llm-d"
)

// Engines lists the engines in documentation order.
func Engines() []string { return []string{EngineKVSim, EngineLLMD} }

// ParseEngine checks an engine name; "" is EngineKVSim.
func ParseEngine(name string) (string, error) {
	if name == "" {
		return EngineKVSim, nil
	}
	if !slices.Contains(Engines(), name) {
		return "", fmt.Errorf("%w: unknown engine %q (known: %v)", ErrConfig, name, Engines())
	}
	return name, nil
}

// fleet is a scenario's running pods, on either engine.
type fleet interface {
	URLs() []string
	Close() error
}

// engineName returns sc's engine, EngineKVSim when unset.
func (sc *Scenario) engineName() string {
	if sc.Engine == "" {
		return EngineKVSim
	}
	return sc.Engine
}

// startFleet starts sc's pods, configured as cfgs, on sc's engine: bin is
// the llm-d simulator's binary (see llmd.Binary; "" finds it).
func startFleet(ctx context.Context, sc *Scenario, cfgs []sim.Config, bin string) (fleet, error) {
	if sc.engineName() == EngineKVSim {
		return sim.StartFleetOf(cfgs...)
	}
	path, err := llmd.Binary(bin)
	if err != nil {
		return nil, err
	}
	return llmd.Start(ctx, path, sc.llmdSettings(cfgs))
}

// llmdSettings returns the llm-d pods' settings for cfgs on sc's workload.
func (sc *Scenario) llmdSettings(cfgs []sim.Config) []llmd.Settings {
	prompt, output := meanRequest(sc.Workload)
	out := make([]llmd.Settings, len(cfgs))
	for i, c := range cfgs {
		out[i] = LLMDSettings(c, prompt, output)
	}
	return out
}

// LLMDSettings returns the llm-d simulator's settings for a pod of cfg
// (defaults filled) serving requests of prompt and output tokens on
// average, in wall time (modelled ÷ cfg.TimeScale):
//
//   - model, adapters, block size, KV blocks and max model length as cfg;
//   - the prefill overhead is a prefill step's fixed cost (P0 plus a bare
//     step), the time per prompt token 1 ÷ cfg's prefill rate: llm-d
//     charges only uncached tokens, as bench/sim does;
//   - the inter-token latency is cfg's decode step at the batch Sizing
//     assumes (b = min(max_num_seqs, KV tokens ÷ (prompt + output))
//     sequences of prompt + output/2 tokens of context);
//   - max-num-seqs: llm-d runs each admitted request on its own clock,
//     its prefills in parallel, where a GPU computes them one chunk after
//     another; so its slots are what gives the pod cfg's capacity on the
//     mean cold request (PodCapacity): capacity × the request's time
//     alone, rounded, between 1 and b. A cached request takes less time,
//     so the pod serves more of them, as a real one does.
func LLMDSettings(cfg sim.Config, prompt, output int) llmd.Settings {
	_ = cfg.Validate() // fills defaults; a scenario's configs were validated
	wall := func(d time.Duration) time.Duration { return time.Duration(float64(d) / cfg.TimeScale) }
	kv := cfg.NumGPUBlocks * cfg.BlockSize
	b := min(cfg.MaxNumSeqs, max(1, kv/max(1, prompt+output)))
	overhead := cfg.StepCost(1, 0) - time.Duration(float64(time.Second)/cfg.PrefillTokensPerSec)
	perToken := time.Duration(float64(time.Second) / cfg.PrefillTokensPerSec)
	itl := cfg.StepCost(0, b*(prompt+output/2))
	alone := overhead + time.Duration(prompt)*perToken + time.Duration(output)*itl
	slots := int(math.Round(PodCapacity(cfg, prompt, output, kv) * alone.Seconds()))
	return llmd.Settings{
		Model: cfg.Model, LoRAs: cfg.LoRAs, MaxLoRAs: cfg.MaxLoRAs,
		BlockSize: cfg.BlockSize, KVBlocks: cfg.NumGPUBlocks,
		MaxNumSeqs: min(b, max(1, slots)), MaxModelLen: cfg.MaxModelLen,
		PrefillOverhead: wall(overhead), PrefillPerToken: wall(perToken), InterTokenLatency: wall(itl),
		Seed: cfg.Seed,
	}
}
