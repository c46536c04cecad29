// Command kvhop measures the cost of one proxy hop (make bench-proxy): wrk
// against an instant loopback backend directly, through kvroute (default
// flags), through a bare fasthttp proxy (kvhop itself, as "kvhop
// bare-proxy"), nginx and HAProxy, alternating in rounds; it writes
// table.md and results.json under --out.
//
//	kvhop --kvroute bin/kvroute --out bench/results/proxy
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
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
	if len(args) > 0 && args[0] == "bare-proxy" {
		return bare(args[1:])
	}
	fs := flag.NewFlagSet("kvhop", flag.ContinueOnError)
	kvroute := fs.String("kvroute", "bin/kvroute", "kvroute binary")
	out := fs.String("out", "bench/results/proxy", "results directory")
	rounds := fs.Int("rounds", 3, "rounds; every target is measured once per round and case")
	dur := fs.Duration("duration", 5*time.Second, "length of one wrk measurement (whole seconds)")
	events := fs.Int("events", 100, "SSE events per streamed answer")
	only := fs.String("only", "", "comma-separated cases to run (NAME or NAME/CONNS, e.g. completion-1KiB/32); default all")
	targets := fs.String("targets", "", "comma-separated targets (direct, kvroute, "+hop.BareTarget+", nginx, haproxy, "+hop.EventsTarget+", "+hop.GossipTarget+"); default all but those two")
	streams := fs.Int("streams", 0, "instead of the wrk run: hold this many SSE streams, then as many idle keep-alive connections, through kvroute and report its RSS per stream and per connection (two file descriptors each in kvroute)")
	kvEvents := fs.Bool("kv-events", false, "also measure kvroute with engine truth on ("+hop.EventsTarget+"): the backend publishes KV events (≈ 3,500 a second) and answers /tokenize")
	gossip := fs.Bool("gossip", false, "also measure kvroute gossiping its placements to a second kvroute process ("+hop.GossipTarget+", --peers)")
	more := fs.String("kvroutes", "", "comma-separated further kvroute binaries, measured as kvroute-1, kvroute-2, ... (an A/B of builds)")
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
	if *streams > 0 {
		return memory(ctx, abs, work, *streams, *out)
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	cfg := hop.Config{Kvroute: abs, Dir: work, Rounds: *rounds, Duration: *dur, Events: *events, Log: os.Stdout,
		Only: list(*only), Targets: list(*targets), KVEvents: *kvEvents, Gossip: *gossip, Bare: self}
	for _, b := range list(*more) {
		a, err := filepath.Abs(b)
		if err != nil {
			return err
		}
		cfg.Kvroutes = append(cfg.Kvroutes, a)
	}
	rep, err := hop.Run(ctx, cfg)
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

// memory runs hop.MeasureMemory and writes memory.json and memory.md.
func memory(ctx context.Context, kvroute, work string, n int, out string) error {
	rep, err := hop.MeasureMemory(ctx, kvroute, work, n)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	md := fmt.Sprintf("| open through kvroute | kvroute RSS | RSS per one | Go heap in use per one | goroutine stacks per one |\n|---|---:|---:|---:|---:|\n"+
		"| nothing (after warm-up) | %d KiB | | | |\n"+
		"| %d SSE streams | %d KiB | **%.1f KiB** | %.1f KiB | %.1f KiB |\n"+
		"| %d idle keep-alive connections (one request each) | %d KiB | **%.1f KiB** | %.1f KiB | %.1f KiB |\n\n%s.\n",
		rep.BaseRSSKiB, rep.Streams, rep.StreamsRSSKiB, rep.PerStreamKiB, rep.StreamHeapKiB, rep.StreamStackKiB,
		rep.IdleConns, rep.IdleRSSKiB, rep.PerIdleConnKiB, rep.IdleHeapKiB, rep.IdleStackKiB, rep.Note)
	js, _ := json.MarshalIndent(rep, "", "  ")
	if err := os.WriteFile(filepath.Join(out, "memory.md"), []byte(md), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(out, "memory.json"), js, 0o644); err != nil {
		return err
	}
	fmt.Print(md)
	return nil
}

// list splits a comma-separated flag value; "" is nil.
func list(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}

// bare serves the bare fasthttp proxy (hop.ServeBare): kvhop runs itself
// as "kvhop bare-proxy --listen ADDR --backend ADDR" for that target.
func bare(args []string) error {
	fs := flag.NewFlagSet("kvhop bare-proxy", flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:0", "address to serve on")
	backend := fs.String("backend", "", "backend host:port")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *backend == "" {
		return fmt.Errorf("bare-proxy: --backend is required")
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	return hop.ServeBare(ln, *backend)
}
