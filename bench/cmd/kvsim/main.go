// Command kvsim runs simulated vLLM pods (package bench/sim) on consecutive
// loopback ports and prints their base URLs, one per line, then serves until
// SIGINT or SIGTERM.
//
//	kvsim --pods 4 --port 8100 --time-scale 10
//	kvsim --pods 4 --prefill-pods 2 --role decode   # 2 prefill + 2 decode pods
//	kvsim --pods 4 --profile slow-large             # Llama-3.1-70B on 4×A100 per pod (sim.Profiles)
//
// KV-cache events as vLLM's --kv-events-config publishes them, and a CPU KV
// tier as its OffloadingConnector keeps one; pod i binds the event ports
// +i, as it listens on --port+i:
//
//	kvsim --pods 4 --port 8100 --kv-events-port 5557 --kv-events-replay-port 5657 \
//	      --kv-events-topic 'kv@{addr}@{model}' --cpu-blocks 100000
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
	"strings"
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
	addrs, cfgs, err := parse(args)
	if err != nil {
		return err
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

// parse turns args into each pod's address and validated config: the
// profile's engine, with the pod flags given explicitly on top.
func parse(args []string) ([]string, []sim.Config, error) {
	fs := pflag.NewFlagSet("kvsim", pflag.ContinueOnError)
	def := sim.DefaultConfig()
	def.BindFlags(fs)
	profile := fs.String("profile", sim.DefaultProfile, "engine profile of the pods: "+strings.Join(sim.ProfileNames(), ", ")+
		" (mixed: pods alternate h100-8b and a100-8b); pod flags given explicitly override its values")
	pods := fs.Int("pods", 1, "number of pods")
	host := fs.String("host", "127.0.0.1", "address to listen on")
	port := fs.Int("port", 8000, "port of the first pod; pod i listens on port+i (0: any free ports)")
	role := fs.String("role", string(sim.RoleMixed), "role of the pods: mixed, prefill or decode")
	prefill := fs.Int("prefill-pods", 0, "make the first N pods prefill pods (the rest keep --role)")
	if err := fs.Parse(args); err != nil {
		return nil, nil, err
	}
	r, err := sim.ParseRole(*role)
	if err != nil {
		return nil, nil, err
	}
	p, err := sim.LookupProfile(*profile)
	if err != nil {
		return nil, nil, err
	}
	if *pods < 1 || *prefill < 0 || *prefill > *pods {
		return nil, nil, fmt.Errorf("need --pods ≥ 1 and 0 ≤ --prefill-pods ≤ --pods")
	}
	base, err := explicit(fs)
	if err != nil {
		return nil, nil, err
	}
	base.Role = r
	cfgs := p.Configs(*pods, base)
	addrs := make([]string, *pods)
	for i := range cfgs {
		pt := 0
		if *port != 0 {
			pt = *port + i
		}
		addrs[i] = net.JoinHostPort(*host, strconv.Itoa(pt))
		if i < *prefill {
			cfgs[i].Role = sim.RolePrefill
		}
		if err := cfgs[i].Validate(); err != nil {
			return nil, nil, err
		}
	}
	return addrs, cfgs, nil
}

// explicit returns a Config holding only the fields whose flags were set
// on fs (the rest zero), so that a profile fills what was not given.
func explicit(fs *pflag.FlagSet) (sim.Config, error) {
	var c sim.Config
	set := pflag.NewFlagSet("explicit", pflag.ContinueOnError)
	c.BindFlags(set)
	var err error
	fs.Visit(func(f *pflag.Flag) {
		if set.Lookup(f.Name) != nil {
			err = errors.Join(err, set.Set(f.Name, f.Value.String()))
		}
	})
	return c, err
}
