package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/pflag"

	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/localengine"
	"github.com/kvroute/kvroute/bench/report"
	"github.com/kvroute/kvroute/bench/scenario"
	"github.com/kvroute/kvroute/bench/sim"
)

func TestHelpAndBadArgs(t *testing.T) {
	for _, tc := range []struct {
		name    string
		args    []string
		wantErr string
		wantOut string
	}{
		{name: "help", args: []string{"--help"}, wantErr: pflag.ErrHelp.Error(), wantOut: "--base-url"},
		{name: "unknown flag", args: []string{"--nope"}, wantErr: "unknown flag"},
		{name: "stray argument", args: []string{"extra"}, wantErr: "unexpected arguments"},
		{name: "unknown scenario", args: []string{"--scenario", "nope"}, wantErr: "unknown scenario"},
		{name: "unknown policy", args: []string{"--policies", "nope"}, wantErr: "unknown policy"},
		{name: "unknown profile", args: []string{"--scenario", "random", "--profile", "nope"}, wantErr: "unknown profile"},
		{name: "both modes", args: []string{"--scenario", "random", "--base-url", "http://x"}, wantErr: "exclude"},
		{name: "bad range", args: []string{"--base-url", "http://127.0.0.1:1", "--workload", "multi-turn", "--turns", "5-2"}, wantErr: "--turns"},
		{name: "bad rate", args: []string{"--base-url", "http://127.0.0.1:1", "--rate", "-3"}, wantErr: "rate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out, errOut strings.Builder
			err := run(context.Background(), tc.args, &out, &errOut, false)
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("err = %v, want it to contain %q", err, tc.wantErr)
			}
			if !strings.Contains(out.String(), tc.wantOut) {
				t.Fatalf("output lacks %q:\n%s", tc.wantOut, out.String())
			}
		})
	}
}

func TestParseRange(t *testing.T) {
	for _, tc := range []struct {
		in     string
		lo, hi int
		ok     bool
	}{
		{in: "12-18", lo: 12, hi: 18, ok: true},
		{in: "7", lo: 7, hi: 7, ok: true},
		{in: " 3 - 4 ", lo: 3, hi: 4, ok: true},
		{in: "4-3"},
		{in: "0-3"},
		{in: "a-b"},
	} {
		t.Run(tc.in, func(t *testing.T) {
			lo, hi, err := parseRange(tc.in)
			if (err == nil) != tc.ok || tc.ok && (lo != tc.lo || hi != tc.hi) {
				t.Fatalf("parseRange(%q) = %d, %d, %v", tc.in, lo, hi, err)
			}
		})
	}
}

// Direct mode against one simulated pod: the summary is printed, the JSON
// written, and the model discovered from /v1/models.
func TestDirectMode(t *testing.T) {
	fleet, err := sim.StartFleet(1, sim.Config{TimeScale: 100, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer fleet.Close()
	dir := t.TempDir()
	jsonPath, rawPath := filepath.Join(dir, "r.json"), filepath.Join(dir, "raw.json")
	var out, errOut strings.Builder
	args := []string{"--base-url", fleet.URL(0), "--pod-urls", fleet.URL(0), "--time-scale", "100",
		"--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "3", "--system-len", "64",
		"--question-len", "8", "--output-len", "4", "--rate", "inf", "--slo-ttft", "5s",
		"--json", jsonPath, "--raw", rawPath}
	if err := run(context.Background(), args, &out, &errOut, false); err != nil {
		t.Fatalf("%v\n%s", err, errOut.String())
	}
	for _, want := range []string{"Successful requests:", "Engine hit rate", "Ideal hit rate", "Request goodput"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("summary lacks %q:\n%s", want, out.String())
		}
	}
	var res load.Result
	b, err := os.ReadFile(jsonPath)
	if err == nil {
		err = json.Unmarshal(b, &res)
	}
	if err != nil || res.Summary.Completed != 6 || res.Engine == nil {
		t.Fatalf("JSON result: %v %+v", err, res.Summary)
	}
	var raw []load.RequestResult
	if b, err = os.ReadFile(rawPath); err == nil {
		err = json.Unmarshal(b, &raw)
	}
	if err != nil || len(raw) != 6 {
		t.Fatalf("raw records: %d, %v", len(raw), errors.Join(err))
	}
}

func TestPlan(t *testing.T) {
	for _, tc := range []struct {
		name           string
		o              options
		names          []string
		matrix         bool
		profiles, mpro []string
		pols, mpols    int
		wantErr        string
	}{
		{name: "default", names: []string{scenario.SharedPrefix}, profiles: []string{"h100-8b"},
			mpro: scenario.MatrixProfiles(), mpols: len(scenario.MatrixPolicies())},
		{name: "all and matrix", o: options{scenarios: []string{"all", "matrix", "random"}}, names: scenario.Names(), matrix: true,
			profiles: []string{"h100-8b"}, mpro: scenario.MatrixProfiles(), mpols: len(scenario.MatrixPolicies())},
		{name: "profiles and policies", o: options{scenarios: []string{"matrix", "hot-prefix"}, profiles: []string{"slow-large", "mixed", "slow-large"},
			policies: []string{"prefix", "round-robin"}}, names: []string{"hot-prefix"}, matrix: true,
			profiles: []string{"slow-large", "mixed"}, mpro: []string{"slow-large", "mixed"}, pols: 2, mpols: 2},
		{name: "unknown profile", o: options{profiles: []string{"tpu"}}, wantErr: "unknown profile"},
		{name: "unknown engine", o: options{engines: []string{"vllm"}}, wantErr: "unknown engine"},
		{name: "unknown scenario", o: options{scenarios: []string{"matrixx"}}, wantErr: "unknown scenario"},
		{name: "local default", o: options{engines: []string{"ollama", "llamacpp"}}, names: []string{scenario.LocalSharedPrefix4},
			profiles: []string{"h100-8b"}, mpro: scenario.MatrixProfiles(), mpols: len(scenario.MatrixPolicies())},
		{name: "local", o: options{scenarios: []string{"local"}, engines: []string{"kvsim", "llamacpp"}}, names: scenario.LocalNames(),
			profiles: []string{"h100-8b"}, mpro: scenario.MatrixProfiles(), mpols: len(scenario.MatrixPolicies())},
		{name: "GPU scenario on a local engine", o: options{scenarios: []string{"shared-prefix"}, engines: []string{"ollama"}},
			wantErr: "sized for simulated GPUs"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pl, err := newPlan(&tc.o)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil || !slices.Equal(pl.names, tc.names) || pl.matrix != tc.matrix || !slices.Equal(pl.profiles, tc.profiles) ||
				!slices.Equal(pl.matrixProfiles, tc.mpro) || len(pl.pols) != tc.pols || len(pl.matrixPols) != tc.mpols {
				t.Fatalf("plan %+v, %v", pl, err)
			}
		})
	}
	ram := 8
	for _, tc := range []struct {
		engine, profile, want string
		local                 localengine.Settings
	}{
		{engine: scenario.EngineOllama, profile: "h100-8b", want: filepath.Join("out", "ollama", "random"),
			local: localengine.Settings{Engine: "ollama"}},
		{engine: scenario.EngineOllama, profile: "h100-8b", want: filepath.Join("out", "ollama-parallel-4", "random"),
			local: localengine.Settings{Engine: "ollama", NumParallel: 4}},
		{engine: scenario.EngineLlamaCpp, profile: "h100-8b", want: filepath.Join("out", "llamacpp-np-1-cache-ram-8-metrics", "random"),
			local: localengine.Settings{Engine: "llamacpp", Slots: 1, CacheRAMMiB: &ram, Metrics: true}},
		{engine: scenario.EngineKVSim, profile: "h100-8b", want: filepath.Join("out", "random")},
		{engine: scenario.EngineKVSim, profile: "mixed", want: filepath.Join("out", "mixed", "random")},
		{engine: scenario.EngineLLMD, profile: "h100-8b", want: filepath.Join("out", "llm-d", "random")},
		{engine: scenario.EngineLLMD, profile: "mixed", want: filepath.Join("out", "llm-d", "mixed", "random")},
	} {
		if d := resultDir("out", tc.engine, tc.profile, "random", tc.local); d != tc.want {
			t.Errorf("%s on %s: results in %s, want %s", tc.profile, tc.engine, d, tc.want)
		}
	}
}

// The matrix takes every cell this invocation already ran (here fakes
// with more policies than the matrix's) and runs nothing more.
func TestMatrixFromDoneRuns(t *testing.T) {
	o := &options{out: t.TempDir(), seed: 1}
	pl, err := newPlan(&options{scenarios: []string{"matrix"}})
	if err != nil {
		t.Fatal(err)
	}
	done := make(map[cell]*scenario.Report)
	pols, err := scenario.SelectPolicies(append(policyNames(), scenario.FixedAffinity))
	if err != nil {
		t.Fatal(err)
	}
	want := 0
	for _, prof := range pl.matrixProfiles {
		for _, name := range scenario.MatrixScenarios() {
			rep := &scenario.Report{Scenario: scenario.Scenario{Name: name, Profile: prof}}
			for _, p := range pols {
				rep.Runs = append(rep.Runs, &load.Result{Label: p.Name, Summary: load.Summary{OutputThroughput: 100, TTFT: load.Dist{P90: 50}}})
			}
			done[cell{scenario.EngineKVSim, prof, name}] = rep
			sc, _ := scenario.Lookup(o.preset(scenario.EngineKVSim, prof), name)
			want += len(matrixPolicies(pl, sc))
		}
	}
	var out, errOut strings.Builder
	if err := matrix(context.Background(), o, pl, done, &out, &errOut, nil); err != nil {
		t.Fatalf("%v\n%s", err, errOut.String())
	}
	b, err := os.ReadFile(filepath.Join(o.out, report.FileMatrix))
	if err != nil {
		t.Fatal(err)
	}
	// Every row compares with least-request; the pressure cells run no
	// round-robin.
	rows := strings.Count(string(b), "| 100 | 1.00× | 1.00× | 50 ms | 1.00× | 1.00× |") +
		strings.Count(string(b), "| 100 | 1.00× | – | 50 ms | 1.00× | – |")
	if rows != want {
		t.Fatalf("%d matrix rows, want %d:\n%s", rows, want, b)
	}
	if strings.Contains(string(b), "llm-d-sticky") != slices.Contains(matrixPolicyNames(), "llm-d-sticky") {
		t.Fatalf("the matrix's rows are not its policies':\n%s", b)
	}
}
