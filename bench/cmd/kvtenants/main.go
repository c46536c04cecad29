// Command kvtenants runs the tenant scenarios (issue #38): quiet tenants
// beside a noisy one far beyond the fleet's capacity, and interactive
// traffic beside a flex batch flood, with kvroute's fair queue and with
// its queue in arrival order, on each engine asked for. It writes one
// Markdown report (and the JSON of every run) under --out.
//
//	bin/kvtenants --engine kvsim,llm-d,llamacpp --out bench/results/tenants-38
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvroute/kvroute/bench/scenario"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "kvtenants:", err)
		os.Exit(1)
	}
}

func run() error {
	scenarios := pflag.StringSlice("scenario", scenario.TenantScenarioNames(), "tenant scenarios: "+strings.Join(scenario.TenantScenarioNames(), ", ")+
		" ("+scenario.NoisyNeighbour429+" runs on "+scenario.EngineLLMD+" only)")
	engines := pflag.StringSlice("engine", []string{scenario.EngineKVSim}, "engines: "+strings.Join(scenario.Engines(), ", "))
	phase := pflag.Duration("phase", 30*time.Second, "sending time of each phase (capacity, alone, flood apart (on its own fleet), flood fair, flood fair with preemption, flood fair with neither reserve nor preemption, flood fifo, flood capped)")
	spread := pflag.Int("output-spread", 0, "draw each request's output length uniformly within 64 ± this many tokens (0: every request 64)")
	reserve := pflag.Int("reserve", -1, "kvroute's --tenant-reserve in the fair-queue phases (-1: its default)")
	seqs := pflag.Int("seqs", 0, "each simulated pod's batch, max-num-seqs (0: 4; llama.cpp keeps its four slots)")
	out := pflag.String("out", "", "directory for report.md and the runs' JSON (default: stdout only)")
	llmdBin := pflag.String("llmd-binary", os.Getenv("KVBENCH_LLMD"), "the llm-d inference simulator's binary (default $KVBENCH_LLMD, else found on PATH)")
	pflag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	var md strings.Builder
	var reps []*scenario.TenantReport
	for _, e := range *engines {
		engine, err := scenario.ParseEngine(e)
		if err != nil {
			return err
		}
		for _, name := range *scenarios {
			if name == scenario.NoisyNeighbour429 && engine != scenario.EngineLLMD {
				continue
			}
			rep, err := scenario.RunTenants(ctx, name, engine, scenario.TenantOptions{Phase: *phase, OutputSpread: *spread, Reserve: *reserve, Seqs: *seqs},
				scenario.RunOptions{Log: os.Stderr, LLMDBinary: *llmdBin})
			if err != nil {
				return fmt.Errorf("%s on %s: %w", name, engine, err)
			}
			reps = append(reps, rep)
			var one strings.Builder
			scenario.WriteTenantReport(&one, rep)
			fmt.Print(one.String())
			md.WriteString(one.String())
		}
	}
	if *out == "" {
		return nil
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(reps, "", " ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(*out, "runs.json"), b, 0o644); err != nil {
		return err
	}
	head := fmt.Sprintf("# Tenant scenarios\n\n`bin/kvtenants --engine %s --scenario %s --phase %s --output-spread %d --reserve %d --seqs %d --out %s`\n\n",
		strings.Join(*engines, ","), strings.Join(*scenarios, ","), *phase, *spread, *reserve, *seqs, *out)
	return os.WriteFile(filepath.Join(*out, "report.md"), []byte(head+md.String()), 0o644)
}
