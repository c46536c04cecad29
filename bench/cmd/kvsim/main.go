// Command kvsim runs simulated vLLM pods (package bench/sim) on consecutive
// loopback ports and prints their base URLs, one per line, then serves until
// SIGINT or SIGTERM.
//
//	kvsim --pods 4 --port 8100 --time-scale 10
//	kvsim --pods 4 --prefill-pods 2 --role decode   # 2 prefill + 2 decode pods
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strconv"
	"syscall"

	"github.com/kvroute/kvroute/bench/sim"
	"github.com/spf13/pflag"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "kvsim:", err)
		os.Exit(1)
	}
}

// run parses args, starts the fleet, writes the URLs to out and serves until
// ctx is done.
func run(ctx context.Context, args []string, out io.Writer) error {
	fs := pflag.NewFlagSet("kvsim", pflag.ContinueOnError)
	cfg := sim.DefaultConfig()
	cfg.BindFlags(fs)
	pods := fs.Int("pods", 1, "number of pods")
	host := fs.String("host", "127.0.0.1", "address to listen on")
	port := fs.Int("port", 8000, "port of the first pod; pod i listens on port+i (0: any free ports)")
	role := fs.String("role", string(sim.RoleMixed), "role of the pods: mixed, prefill or decode")
	prefill := fs.Int("prefill-pods", 0, "make the first N pods prefill pods (the rest keep --role)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	r, err := sim.ParseRole(*role)
	if err != nil {
		return err
	}
	cfg.Role = r
	if err := cfg.Validate(); err != nil {
		return err
	}
	if *pods < 1 || *prefill < 0 || *prefill > *pods {
		return fmt.Errorf("need --pods ≥ 1 and 0 ≤ --prefill-pods ≤ --pods")
	}
	addrs := make([]string, *pods)
	cfgs := make([]sim.Config, *pods)
	for i := range cfgs {
		p := 0
		if *port != 0 {
			p = *port + i
		}
		addrs[i] = net.JoinHostPort(*host, strconv.Itoa(p))
		cfgs[i] = cfg
		cfgs[i].Seed = cfg.Seed + uint64(i)
		if i < *prefill {
			cfgs[i].Role = sim.RolePrefill
		}
	}
	fleet, err := sim.StartFleetAt(addrs, cfgs)
	if err != nil {
		return err
	}
	for _, u := range fleet.URLs() {
		fmt.Fprintln(out, u)
	}
	<-ctx.Done()
	return fleet.Close()
}
