// Command kvsoak is the engine of make soak: it runs the kvroute binary in
// front of simulated vLLM pods (in this process) under a mix of workloads
// while faults rotate over the pods, samples kvroute's RSS, open FDs,
// goroutines, in-flight requests and prefix index every --interval, and
// judges whether they stay flat after a warm-up (package bench/soak).
//
//	kvsoak                                  # 10 minutes, results under bench/results/soak
//	kvsoak --duration 60s --interval 2s --out /tmp/soak-check
//
// It writes <out>/soak.csv, soak.png, soak.md, requests.csv, faults.csv
// and kvroute.log, prints the verdict table, and exits 1 when a series is
// not flat, a request was lost or kvroute did not stop cleanly on SIGTERM
// (2 when the run could not be made).
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/pflag"

	"github.com/kvroute/kvroute/bench/soak"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// run parses args, runs the soak and returns the exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg, err := parse(args, stderr)
	if errors.Is(err, pflag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "kvsoak:", err)
		return 2
	}
	cfg.Log = stdout
	res, err := soak.Run(ctx, cfg)
	if res != nil {
		fmt.Fprintln(stdout)
		res.WriteSummary(stdout)
		for _, f := range res.Files {
			fmt.Fprintln(stdout, "wrote", f)
		}
	}
	switch {
	case err != nil:
		fmt.Fprintln(stderr, "kvsoak:", err)
		return 2
	case !res.Flat:
		return 1
	}
	return 0
}

// parse turns args into a soak configuration.
func parse(args []string, stderr io.Writer) (soak.Config, error) {
	cfg := soak.DefaultConfig()
	fs := pflag.NewFlagSet("kvsoak", pflag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "kvsoak: soak kvroute under mixed load and rotating faults; fail when its resources do not stay flat.")
		fmt.Fprintln(stderr, "\nUsage: kvsoak [flags]")
		fs.PrintDefaults()
	}
	fs.DurationVar(&cfg.Duration, "duration", cfg.Duration, "how long requests are sent")
	fs.DurationVar(&cfg.Interval, "interval", cfg.Interval, "sampling period of kvroute's resources")
	fs.IntVar(&cfg.Pods, "pods", cfg.Pods, "simulated pods (≥ 2)")
	fs.StringVar(&cfg.Out, "out", cfg.Out, "directory of the results")
	fs.StringVar(&cfg.KVRoute, "kvroute", cfg.KVRoute, "path of the kvroute binary")
	fs.StringArrayVar(&cfg.KVRouteArgs, "kvroute-arg", nil, "extra kvroute flag, repeatable (e.g. --kvroute-arg=--policy=least-request)")
	fs.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the workloads, the mix and the pods")
	fs.Float64Var(&cfg.Rate, "rate", cfg.Rate, "mean request rate (Poisson), requests/s")
	fs.IntVar(&cfg.MaxInFlight, "max-in-flight", cfg.MaxInFlight, "client cap on requests in flight (arrivals past it are skipped)")
	fs.DurationVar(&cfg.RequestTimeout, "request-timeout", cfg.RequestTimeout, "a request without an end after this long is lost")
	fs.Float64Var(&cfg.Warmup, "warmup", cfg.Warmup, "share of --duration before the fits start")
	fs.DurationVar(&cfg.Settle, "settle", cfg.Settle, "wait after the drain before the last sample")
	fs.DurationVar(&cfg.DrainTimeout, "drain-timeout", cfg.DrainTimeout, "kvroute's --drain-timeout: after SIGTERM it must exit 0 within it")
	fs.BoolVar(&cfg.Faults, "faults", cfg.Faults, "rotate faults over the pods")
	fs.IntVar(&cfg.KVBlocks, "kv-blocks", cfg.KVBlocks, "KV capacity of each pod in blocks of 16 tokens (bounds kvroute's prefix index)")
	fs.Float64Var(&cfg.Limits.GrowthPct, "max-growth", cfg.Limits.GrowthPct, "largest RSS growth after warm-up, percent")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments %v", fs.Args())
	}
	return cfg, cfg.Validate()
}
