// Command kvhop measures the cost of one proxy hop (make bench-proxy): wrk
// against an instant loopback backend directly, through kvroute (default
// flags), nginx and HAProxy, alternating in rounds; it writes
// table.md and results.json under --out.
//
//	kvhop --kvroute bin/kvroute --out bench/results/proxy
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"time"

	"github.com/kvroute/kvroute/bench/hop"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "kvhop:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	fs := flag.NewFlagSet("kvhop", flag.ContinueOnError)
	kvroute := fs.String("kvroute", "bin/kvroute", "kvroute binary")
	out := fs.String("out", "bench/results/proxy", "results directory")
	rounds := fs.Int("rounds", 3, "rounds; every target is measured once per round and case")
	dur := fs.Duration("duration", 5*time.Second, "length of one wrk measurement (whole seconds)")
	events := fs.Int("events", 100, "SSE events per streamed answer")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *rounds < 1 || *dur < time.Second || *events < 1 {
		return fmt.Errorf("--rounds, --events must be at least 1 and --duration at least 1s")
	}
	abs, err := filepath.Abs(*kvroute)
	if err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "kvhop-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	rep, err := hop.Run(ctx, hop.Config{Kvroute: abs, Dir: work, Rounds: *rounds, Duration: *dur, Events: *events, Log: os.Stdout})
	if err != nil {
		return err
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return err
	}
	md := rep.Markdown()
	js, _ := json.MarshalIndent(rep, "", "  ")
	if err := os.WriteFile(filepath.Join(*out, "table.md"), []byte(md), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(*out, "results.json"), js, 0o644); err != nil {
		return err
	}
	fmt.Print("\n" + md)
	return nil
}
