package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/kvroute/kvroute/bench/localengine"
	"github.com/kvroute/kvroute/bench/report"
	"github.com/kvroute/kvroute/bench/scenario"
	"github.com/kvroute/kvroute/bench/sim"
)

// plan is what --scenario, --profile and --policies ask of scenario mode.
type plan struct {
	// names are the scenarios to run on each of profiles, in order, on
	// each of engines.
	names    []string
	profiles []string
	engines  []string
	// pols are the policies to compare (nil: each scenario's own).
	pols []scenario.Policy
	// matrix asks for the matrix, on matrixProfiles with matrixPols.
	matrix         bool
	matrixProfiles []string
	matrixPols     []scenario.Policy
}

// newPlan checks o's scenario-mode flags and returns the plan.
func newPlan(o *options) (*plan, error) {
	pl := &plan{}
	pl.engines = []string{scenario.EngineKVSim}
	if len(o.engines) > 0 {
		pl.engines = unique(o.engines)
	}
	req := o.scenarios
	if len(req) == 0 {
		req = []string{scenario.SharedPrefix}
		if !slices.ContainsFunc(pl.engines, func(e string) bool { return !scenario.IsLocal(e) }) {
			req = []string{scenario.LocalSharedPrefix4}
		}
	}
	known := append(append(scenario.Names(), scenario.Demo, scenario.SharedPrefixTiers), append(scenario.PDNames(), scenario.LocalNames()...)...)
	for _, n := range req {
		switch {
		case n == "all":
			pl.names = append(pl.names, scenario.Names()...)
		case n == "local":
			pl.names = append(pl.names, scenario.LocalNames()...)
		case n == scenario.Matrix:
			pl.matrix = true
		case slices.Contains(known, n):
			pl.names = append(pl.names, n)
		default:
			return nil, fmt.Errorf("unknown scenario %q (want %s, all, %s, %s, %s, %s, local or %s)",
				n, strings.Join(scenario.Names(), ", "), strings.Join(scenario.PDNames(), ", "), scenario.SharedPrefixTiers, scenario.Demo,
				strings.Join(scenario.LocalNames(), ", "), scenario.Matrix)
		}
	}
	pl.names = unique(pl.names)
	if err := checkEngines(pl); err != nil {
		return nil, err
	}
	for _, p := range o.profiles {
		if _, err := sim.LookupProfile(p); err != nil {
			return nil, err
		}
	}
	pl.profiles, pl.matrixProfiles = unique(o.profiles), unique(o.profiles)
	if len(o.profiles) == 0 {
		pl.profiles, pl.matrixProfiles = []string{sim.DefaultProfile}, scenario.MatrixProfiles()
	}
	pl.matrixPols = scenario.MatrixPolicies()
	if len(o.policies) > 0 {
		pols, err := scenario.SelectPolicies(o.policies)
		if err != nil {
			return nil, err
		}
		pl.pols, pl.matrixPols = pols, pols
	}
	return pl, nil
}

// checkEngines checks pl's engines, and that the real local servers run
// only the scenarios sized for them.
func checkEngines(pl *plan) error {
	for _, e := range pl.engines {
		if _, err := scenario.ParseEngine(e); err != nil {
			return err
		}
		if !scenario.IsLocal(e) {
			continue
		}
		for _, n := range pl.names {
			if !slices.Contains(scenario.LocalNames(), n) {
				return fmt.Errorf("scenario %s is sized for simulated GPUs, not for --engine %s: run the local scenarios (%s)",
					n, e, strings.Join(scenario.LocalNames(), ", "))
			}
		}
		if pl.matrix {
			return fmt.Errorf("the matrix is sized for simulated GPUs, not for --engine %s", e)
		}
	}
	return nil
}

// localFlags are the real local servers' flags (localengine.Settings).
type localFlags struct {
	numParallel, slots, cacheRAM int
	metrics                      bool
}

// settings returns the flags that apply to engine (the zero Settings for
// a simulated one).
func (l localFlags) settings(engine string) localengine.Settings {
	s := localengine.Settings{Engine: engine}
	switch engine {
	case scenario.EngineOllama:
		s.NumParallel = l.numParallel
	case scenario.EngineLlamaCpp:
		s.Slots, s.Metrics = l.slots, l.metrics
		if l.cacheRAM >= 0 {
			ram := l.cacheRAM
			s.CacheRAMMiB = &ram
		}
	default:
		return localengine.Settings{}
	}
	return s
}

// unique returns ss without repeats, in first-seen order.
func unique(ss []string) []string {
	var out []string
	for _, s := range ss {
		if !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	return out
}

// preset is the scenarios' preset for profile on engine.
func (o *options) preset(engine, profile string) scenario.Preset {
	return scenario.Preset{Full: o.full, Pods: o.pods, TimeScale: o.timeScale, TracePath: o.trace, Seed: o.seed,
		Profile: profile, Engine: engine, Local: o.local.settings(engine), LocalRate: o.localRate}
}

// resultDir is where a scenario's results on profile and engine go:
// out/<scenario> for the default profile on bench/sim (as before profiles),
// out/<profile>/<scenario> for the others, under out/llm-d/ on that engine;
// on a real local server out/<engine>[-<flags>]/<scenario>
// (localengine.Settings.Tag of local).
func resultDir(out, engine, profile, name string, local localengine.Settings) string {
	if scenario.IsLocal(engine) {
		return filepath.Join(out, local.Tag(), name)
	}
	if engine != scenario.EngineKVSim {
		out = filepath.Join(out, engine)
	}
	if profile == sim.DefaultProfile {
		return filepath.Join(out, name)
	}
	return filepath.Join(out, profile, name)
}

// cell names one scenario on one profile and engine.
type cell struct{ engine, profile, scenario string }

// scenarios runs the named built-in scenarios on each profile, then the
// matrix if asked, and writes their results.
func scenarios(ctx context.Context, o *options, stdout, stderr, progress io.Writer) error {
	if o.rounds < 1 {
		return fmt.Errorf("--rounds %d: want at least 1", o.rounds)
	}
	pl, err := newPlan(o)
	if err != nil {
		return err
	}
	start := time.Now()
	done := make(map[cell]*scenario.Report)
	for _, eng := range pl.engines {
		for _, prof := range pl.profiles {
			for _, name := range pl.names {
				if name == scenario.Overhead {
					if eng == pl.engines[0] && prof == pl.profiles[0] { // no simulated engine: once
						files, err := overhead(ctx, o, filepath.Join(o.out, name), stdout, stderr)
						if err != nil {
							return err
						}
						printFiles(stdout, filepath.Join(o.out, name), files)
					}
					continue
				}
				sc, ok := scenario.Lookup(o.preset(eng, prof), name)
				if !ok { // only the trace scenario without a trace
					fmt.Fprintln(stderr, "trace: skipped, no --trace file (the Mooncake traces are not in the repository)")
					continue
				}
				dir := resultDir(o.out, eng, prof, name, o.local.settings(eng))
				rep, files, err := comparison(ctx, o, sc, pl.pols, dir, stdout, stderr, progress)
				if rep != nil {
					done[cell{eng, prof, name}] = rep
				}
				if err != nil {
					return err
				}
				printFiles(stdout, dir, files)
			}
		}
	}
	if pl.matrix {
		if err := matrix(ctx, o, pl, done, stdout, stderr, progress); err != nil {
			return err
		}
	}
	fmt.Fprintf(stderr, "done in %s\n", time.Since(start).Round(time.Second))
	return nil
}

// comparison runs sc with pols (nil: the scenario's own), writes what
// finished under dir and prints its tables.
func comparison(ctx context.Context, o *options, sc scenario.Scenario, pols []scenario.Policy, dir string, stdout, stderr, progress io.Writer) (*scenario.Report, []string, error) {
	rep, err := scenario.Run(ctx, sc, scenario.RunOptions{Policies: pols, Progress: progress, Log: stderr, LLMDBinary: o.llmdBin, Rounds: o.rounds})
	var files []string
	if rep != nil && len(rep.Runs) > 0 {
		var werr error
		files, werr = report.Write(dir, rep)
		err = errors.Join(err, werr)
		fmt.Fprintf(stdout, "\n%s", report.Markdown(rep))
	}
	return rep, files, err
}

// matrixPolicies returns the policies of sc's matrix cell: --policies
// when given, else a scenario's own choice (the pressure scenarios': the
// anchor, kvroute and the fixed-affinity reference), else the matrix's.
func matrixPolicies(pl *plan, sc scenario.Scenario) []scenario.Policy {
	if pl.pols == nil && sc.Policies != nil {
		if pols, err := scenario.SelectPolicies(sc.Policies); err == nil {
			return pols
		}
	}
	return pl.matrixPols
}

// matrix runs the matrix's workloads on each of its profiles, reusing the
// comparisons this invocation already ran when they cover the matrix's
// policies, writes each cell where a --profile run would and the matrix
// under --out, and prints it. It writes what finished when a run fails.
func matrix(ctx context.Context, o *options, pl *plan, done map[cell]*scenario.Report, stdout, stderr, progress io.Writer) error {
	var reps []*scenario.Report
	var err error
	for _, eng := range pl.engines {
		for _, prof := range pl.matrixProfiles {
			for _, name := range scenario.MatrixScenarios() {
				sc, _ := scenario.Lookup(o.preset(eng, prof), name)
				pols := matrixPolicies(pl, sc)
				if rep, ok := done[cell{eng, prof, name}]; ok {
					if only, all := rep.Only(names(pols)); all {
						fmt.Fprintf(stderr, "matrix: %s on %s (%s) from the run above\n", name, prof, eng)
						reps = append(reps, only)
						continue
					}
				}
				dir := resultDir(o.out, eng, prof, name, o.local.settings(eng))
				var rep *scenario.Report
				var files []string
				rep, files, err = comparison(ctx, o, sc, pols, dir, stdout, stderr, progress)
				if rep != nil && len(rep.Runs) > 0 {
					reps = append(reps, rep)
				}
				if err != nil {
					break
				}
				printFiles(stdout, dir, files)
			}
			if err != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	if len(reps) == 0 {
		return err
	}
	m, files, werr := report.WriteMatrix(o.out, reps)
	fmt.Fprintf(stdout, "\n%s\nMatrix in %s\n", report.MatrixMarkdown(m), strings.Join(files, ", "))
	return errors.Join(err, werr)
}
