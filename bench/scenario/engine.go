package scenario

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/kvroute/kvroute/bench/llmd"
	"github.com/kvroute/kvroute/bench/localengine"
	"github.com/kvroute/kvroute/bench/sim"
)

// The engines a scenario's pods can run: the project's simulator
// (bench/sim, in process), the public llm-d inference simulator
// (bench/llmd, one process per pod), whose scheduler, latency model and
// cache nobody here wrote, and two real local servers with real CPU
// compute (bench/localengine): stock Ollama and llama.cpp's llama-server,
// serving the tiny model, their flags from Scenario.Local.
const (
	EngineKVSim    = "kvsim"
	EngineLLMD     = "llm-d"
	EngineOllama   = localengine.Ollama
	EngineLlamaCpp = localengine.LlamaCpp
)

// Engines lists the engines in documentation order.
func Engines() []string { return []string{EngineKVSim, EngineLLMD, EngineOllama, EngineLlamaCpp} }

// IsLocal reports whether engine is a real local server (bench/localengine),
// for which only the local scenarios (LocalNames) are sized.
func IsLocal(engine string) bool { return slices.Contains(localengine.Engines(), engine) }

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

// engineFleet is a scenario's running pods, on either engine.
type engineFleet interface {
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

// localSettings returns the local servers' settings of sc (its Local,
// else the engine's defaults); false when sc's engine is not local.
func (sc *Scenario) localSettings() (localengine.Settings, bool) {
	e := sc.engineName()
	if !IsLocal(e) {
		return localengine.Settings{}, false
	}
	if sc.Local != nil {
		s := *sc.Local
		s.Engine = e
		return s, true
	}
	return localengine.Settings{Engine: e}, true
}

// simEngines returns cfgs when sc's pods are simulated (the peers
// calibrated per deployment read them), nil on a real engine.
func (sc *Scenario) simEngines(cfgs []sim.Config) []sim.Config {
	if IsLocal(sc.engineName()) {
		return nil
	}
	return cfgs
}

// startFleet starts sc's pods, configured as cfgs, on sc's engine: bin is
// the llm-d simulator's binary (see llmd.Binary; "" finds it). Real local
// servers (bench/localengine) ignore cfgs: sc.Pods of them, warm.
func startFleet(ctx context.Context, sc *Scenario, cfgs []sim.Config, bin string) (engineFleet, error) {
	if sc.engineName() == EngineKVSim {
		return sim.StartFleetOf(cfgs...)
	}
	if s, ok := sc.localSettings(); ok {
		return localengine.Start(ctx, s, sc.Pods)
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
		out[i].ZMQEndpoint = sc.zmqEndpoint
		out[i].MaxWaiting = sc.llmdMaxWaiting
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
//   - max-num-seqs is cfg's, bounded by the requests whose blocks the KV
//     holds at once when they share nothing (KV tokens ÷ (prompt +
//     output), the batch Sizing assumes): llm-d answers 500 to a request
//     whose blocks do not fit beside the running ones' (vLLM would queue
//     it), so the rest wait in llm-d's queue instead;
//   - the inter-token latency is cfg's decode step of one such sequence
//     (prompt + output/2 tokens of context), and the time factor under
//     load its step at the full batch over that: llm-d stretches every
//     running request's times linearly with the running count, to that
//     factor at max-num-seqs, as a memory-bound decode step grows with the
//     batch's context.
//
// What stays llm-d's own: every admitted request runs on its own clock,
// prefills in parallel where a GPU computes them chunk after chunk.
func LLMDSettings(cfg sim.Config, prompt, output int) llmd.Settings {
	_ = cfg.Validate() // fills defaults; a scenario's configs were validated
	wall := func(d time.Duration) time.Duration { return time.Duration(float64(d) / cfg.TimeScale) }
	perToken := time.Duration(float64(time.Second) / cfg.PrefillTokensPerSec)
	overhead := cfg.StepCost(1, 0) - perToken
	b := min(cfg.MaxNumSeqs, max(1, cfg.NumGPUBlocks*cfg.BlockSize/max(1, prompt+output)))
	ctx := prompt + output/2
	one := cfg.StepCost(0, ctx)
	return llmd.Settings{
		Model: cfg.Model, LoRAs: cfg.LoRAs, MaxLoRAs: cfg.MaxLoRAs,
		BlockSize: cfg.BlockSize, KVBlocks: cfg.NumGPUBlocks,
		MaxNumSeqs: b, MaxModelLen: cfg.MaxModelLen,
		PrefillOverhead: wall(overhead), PrefillPerToken: wall(perToken),
		InterTokenLatency: wall(one), TimeFactorUnderLoad: float64(cfg.StepCost(0, b*ctx)) / float64(one),
		Seed: cfg.Seed,
	}
}
