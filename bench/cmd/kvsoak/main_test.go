package main

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/leakcheck"
	"github.com/kvroute/kvroute/bench/soak"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

func TestParse(t *testing.T) {
	var stderr bytes.Buffer
	cfg, err := parse(nil, &stderr)
	if err != nil {
		t.Fatal(err)
	}
	def := soak.DefaultConfig()
	if cfg.Duration != 10*time.Minute || cfg.Interval != 5*time.Second || cfg.Pods != 4 ||
		cfg.Out != "bench/results/soak" || cfg.KVRoute != "bin/kvroute" || cfg.Rate != def.Rate {
		t.Fatalf("defaults = %+v", cfg)
	}
	cfg, err = parse([]string{"--duration", "60s", "--interval", "2s", "--out", "/tmp/x", "--seed", "7",
		"--kvroute-arg=--policy=least-request", "--kvroute-arg", "--log-level=warn"}, &stderr)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Duration != time.Minute || cfg.Interval != 2*time.Second || cfg.Seed != 7 ||
		strings.Join(cfg.KVRouteArgs, " ") != "--policy=least-request --log-level=warn" {
		t.Fatalf("parsed = %+v", cfg)
	}
	for _, bad := range [][]string{{"--pods", "1"}, {"--interval", "0s"}, {"--duration", "10s", "--interval", "5s"}, {"stray"}} {
		if _, err := parse(bad, &stderr); err == nil {
			t.Errorf("parse(%v) accepted", bad)
		}
	}
}

func TestRunExitCodes(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"--help"}, &out, &errb); code != 0 || !strings.Contains(errb.String(), "--duration") {
		t.Fatalf("--help: code %d, usage %q", code, errb.String())
	}
	if code := run(context.Background(), []string{"--pods", "0"}, &out, &errb); code != 2 {
		t.Fatalf("bad flag: code %d", code)
	}
	errb.Reset()
	missing := filepath.Join(t.TempDir(), "no-kvroute")
	code := run(context.Background(), []string{"--kvroute", missing, "--out", t.TempDir()}, &out, &errb)
	if code != 2 || !strings.Contains(errb.String(), "kvroute binary") {
		t.Fatalf("missing binary: code %d, %q", code, errb.String())
	}
}
