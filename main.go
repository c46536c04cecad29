// Command kvroute is a KV-cache-aware L7 router for LLM inference servers
// (vLLM, SGLang). It stands where a Kubernetes ClusterIP Service would stand
// and forwards the OpenAI API to the model-server pods behind it.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/pflag"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/metrics"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/proxy"
	"github.com/kvroute/kvroute/routing"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr, nil); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "kvroute:", err)
		os.Exit(2)
	}
}

// Config is kvroute's whole configuration. Every field is a flag, also
// settable as KVROUTE_<FLAG> in the environment (flag name upper-cased,
// dashes as underscores); a flag on the command line wins.
type Config struct {
	Listen      string
	AdminListen string

	Backends []string
	Policy   string

	MaxBodyBytes          int
	Retries               int
	ConnectTimeout        time.Duration
	ResponseHeaderTimeout time.Duration
	StreamIdleTimeout     time.Duration
	UpstreamIdleTimeout   time.Duration
	ClientIdleTimeout     time.Duration
	MaxConnsPerEndpoint   int
	DrainTimeout          time.Duration

	LogLevel  string
	LogFormat string
	AccessLog bool

	PrefixBlockBytes     int
	PrefixMaxBlocks      int
	PrefixCapacityBlocks int
	PrefixMaxEntries     int
	PrefixTTL            time.Duration
	Prefix               routing.PrefixParams
}

// Policies that --policy accepts.
var policies = []string{"prefix", "round-robin", "random", "least-request"}

// flagGroup is a titled group of flags for --help.
type flagGroup struct {
	title string
	fs    *pflag.FlagSet
}

// newFlags binds c's fields to flags with their defaults, in groups.
func newFlags(c *Config) (*pflag.FlagSet, []flagGroup) {
	g := func(title string) flagGroup {
		fs := pflag.NewFlagSet(title, pflag.ContinueOnError)
		fs.SortFlags = false
		return flagGroup{title, fs}
	}
	listen, backends, pfx, upstream, ops := g("Listeners"), g("Backends and routing"), g("Prefix-aware routing (--policy prefix)"), g("Upstream connections"), g("Operations")

	listen.fs.StringVar(&c.Listen, "listen", ":8000", "address of the OpenAI-compatible API listener")
	listen.fs.StringVar(&c.AdminListen, "admin-listen", ":9090", "address of the admin listener (/metrics, /livez, /readyz, /debug/pprof/)")
	listen.fs.IntVar(&c.MaxBodyBytes, "max-body-bytes", 64<<20, "largest request body accepted; larger ones get 413")
	listen.fs.DurationVar(&c.ClientIdleTimeout, "client-idle-timeout", 2*time.Minute, "close client keep-alive connections idle this long")

	backends.fs.StringSliceVar(&c.Backends, "backends", nil, "static model-server base URLs (http://host:port), repeated or comma-separated")
	backends.fs.StringVar(&c.Policy, "policy", "prefix", "routing policy: "+strings.Join(policies, ", "))
	backends.fs.IntVar(&c.Retries, "retries", 2, "times a request may be re-sent to another endpoint on connection failure or 429/502/503/504, before its first response byte")

	d := routing.DefaultPrefixParams()
	pfx.fs.IntVar(&c.PrefixBlockBytes, "prefix-block-bytes", 1024, "bytes of the canonical prompt rendering per hashed block (1 KiB ≈ 256 tokens)")
	pfx.fs.IntVar(&c.PrefixMaxBlocks, "prefix-max-blocks", 256, "blocks hashed per request; 256 × 1 KiB covers 256 KiB ≈ 64k tokens")
	pfx.fs.IntVar(&c.PrefixCapacityBlocks, "prefix-capacity-blocks", 1760, "index blocks remembered per endpoint: the engine's KV capacity in blocks (450k tokens / 256 for an 8B model on an H100)")
	pfx.fs.IntVar(&c.PrefixMaxEntries, "prefix-max-entries", 4_000_000, "cap on (block, endpoint) entries of all endpoints together (≈ 76 bytes each)")
	pfx.fs.DurationVar(&c.PrefixTTL, "prefix-ttl", 30*time.Minute, "forget blocks nobody was routed to for this long (0: never)")
	pfx.fs.Float64Var(&c.Prefix.PrefillTokensPerSec, "prefix-prefill-tokens-per-sec", d.PrefillTokensPerSec, "an endpoint's prefill rate, turning uncached tokens into seconds of wait")
	pfx.fs.Float64Var(&c.Prefix.DecodeCostSec, "prefix-decode-cost", d.DecodeCostSec, "seconds of wait one in-flight request adds to a new request's first token")
	pfx.fs.Float64Var(&c.Prefix.SpillMarginSec, "prefix-spill-margin", d.SpillMarginSec, "seconds the warm endpoint's wait may exceed the best alternative's before the request spills")
	pfx.fs.IntVar(&c.Prefix.MinMatchBlocks, "prefix-min-match-blocks", d.MinMatchBlocks, "least matched blocks that make an endpoint warm (a short shared system prompt must not pin the fleet)")
	pfx.fs.Float64Var(&c.Prefix.TieSec, "prefix-tie", d.TieSec, "waits closer than this are ties, broken by rendezvous hashing")

	upstream.fs.DurationVar(&c.ConnectTimeout, "connect-timeout", 5*time.Second, "timeout for connecting to a model server")
	upstream.fs.DurationVar(&c.ResponseHeaderTimeout, "response-header-timeout", 10*time.Minute, "timeout from sending a request to the first response byte (0: none); non-streaming requests answer only after generation")
	upstream.fs.DurationVar(&c.StreamIdleTimeout, "stream-idle-timeout", 0, "longest gap between two chunks of a response body (0: none); there is never a total deadline on a stream")
	upstream.fs.DurationVar(&c.UpstreamIdleTimeout, "upstream-idle-timeout", 4*time.Second, "close idle upstream keep-alive connections after this; keep below the engine's keep-alive (vLLM/uvicorn: 5s)")
	upstream.fs.IntVar(&c.MaxConnsPerEndpoint, "max-conns-per-endpoint", 4096, "upstream connection cap per endpoint (each stream holds one)")

	ops.fs.DurationVar(&c.DrainTimeout, "drain-timeout", 30*time.Second, "on SIGTERM, how long in-flight requests and streams may finish")
	ops.fs.StringVar(&c.LogLevel, "log-level", "info", "log level: debug, info, warn, error")
	ops.fs.StringVar(&c.LogFormat, "log-format", "json", "log format: json or console")
	ops.fs.BoolVar(&c.AccessLog, "access-log", true, "log one line per request")

	all := pflag.NewFlagSet("kvroute", pflag.ContinueOnError)
	groups := []flagGroup{listen, backends, pfx, upstream, ops}
	for _, gr := range groups {
		all.AddFlagSet(gr.fs)
	}
	return all, groups
}

// parseConfig reads flags from args and the environment (getenv).
func parseConfig(args []string, getenv func(string) string, usage io.Writer) (*Config, error) {
	c := &Config{}
	fs, groups := newFlags(c)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			writeUsage(usage, groups)
		}
		return nil, err
	}
	var errs []error
	fs.VisitAll(func(f *pflag.Flag) {
		if f.Changed {
			return
		}
		env := "KVROUTE_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v := getenv(env); v != "" {
			if err := fs.Set(f.Name, v); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", env, err))
			}
		}
	})
	if fs.NArg() > 0 {
		errs = append(errs, fmt.Errorf("unexpected arguments: %q", fs.Args()))
	}
	return c, errors.Join(errs...)
}

func writeUsage(w io.Writer, groups []flagGroup) {
	fmt.Fprintf(w, "kvroute: a KV-cache-aware router for vLLM and SGLang.\n\nUsage: kvroute [flags]\n\nEvery flag may also be set as KVROUTE_<FLAG> in the environment, e.g. KVROUTE_BACKENDS.\n")
	for _, g := range groups {
		fmt.Fprintf(w, "\n%s:\n%s", g.title, g.fs.FlagUsages())
	}
}

// Validate reports every problem of c at once.
func (c *Config) Validate() error {
	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	for _, a := range []struct{ name, v string }{{"--listen", c.Listen}, {"--admin-listen", c.AdminListen}} {
		if _, _, err := net.SplitHostPort(a.v); err != nil {
			bad("%s %q: want host:port (%v)", a.name, a.v, err)
		}
	}
	if c.Listen == c.AdminListen && !strings.HasSuffix(c.Listen, ":0") {
		bad("--listen and --admin-listen must differ (both %q)", c.Listen)
	}
	if len(c.Backends) == 0 {
		bad("no backends: set --backends (e.g. --backends http://10.0.0.7:8000,http://10.0.0.8:8000)")
	}
	for _, b := range c.Backends {
		if _, err := discovery.NewEndpoint(b, discovery.RoleMixed); err != nil {
			bad("--backends: %v", err)
		}
	}
	if !contains(policies, c.Policy) {
		bad("--policy %q: want one of %s", c.Policy, strings.Join(policies, ", "))
	}
	if c.MaxBodyBytes <= 0 {
		bad("--max-body-bytes must be positive, got %d", c.MaxBodyBytes)
	}
	if c.Retries < 0 || c.Retries > 10 {
		bad("--retries must be in [0, 10], got %d", c.Retries)
	}
	if c.PrefixBlockBytes < 16 || c.PrefixMaxBlocks < 1 || c.PrefixCapacityBlocks < 1 || c.PrefixMaxEntries < 1 {
		bad("--prefix-block-bytes must be at least 16 and --prefix-max-blocks, --prefix-capacity-blocks, --prefix-max-entries positive")
	}
	if c.PrefixTTL < 0 {
		bad("--prefix-ttl must not be negative")
	}
	if err := c.Prefix.Validate(); err != nil {
		bad("prefix policy: %v", err)
	}
	if c.MaxConnsPerEndpoint <= 0 {
		bad("--max-conns-per-endpoint must be positive, got %d", c.MaxConnsPerEndpoint)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"--connect-timeout", c.ConnectTimeout}, {"--response-header-timeout", c.ResponseHeaderTimeout},
		{"--stream-idle-timeout", c.StreamIdleTimeout}, {"--upstream-idle-timeout", c.UpstreamIdleTimeout},
		{"--client-idle-timeout", c.ClientIdleTimeout}, {"--drain-timeout", c.DrainTimeout},
	} {
		if d.v < 0 {
			bad("%s must not be negative, got %s", d.name, d.v)
		}
	}
	if c.UpstreamIdleTimeout == 0 {
		bad("--upstream-idle-timeout must be positive")
	}
	if _, err := zapcore.ParseLevel(c.LogLevel); err != nil {
		bad("--log-level %q: want debug, info, warn or error", c.LogLevel)
	}
	if c.LogFormat != "json" && c.LogFormat != "console" {
		bad("--log-format %q: want json or console", c.LogFormat)
	}
	return errors.Join(errs...)
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// newLogger builds the process logger. Log lines are buffered (flushed every
// second and at exit) so the access log costs no syscall per request.
func newLogger(c *Config, w io.Writer) (*zap.Logger, func(), error) {
	level, err := zapcore.ParseLevel(c.LogLevel)
	if err != nil {
		return nil, nil, err
	}
	encCfg := zap.NewProductionEncoderConfig()
	encCfg.EncodeTime = zapcore.ISO8601TimeEncoder
	var enc zapcore.Encoder
	if c.LogFormat == "console" {
		enc = zapcore.NewConsoleEncoder(encCfg)
	} else {
		enc = zapcore.NewJSONEncoder(encCfg)
	}
	ws := &zapcore.BufferedWriteSyncer{WS: zapcore.AddSync(w), FlushInterval: time.Second}
	logger := zap.New(zapcore.NewCore(enc, ws, level))
	return logger, func() { _ = ws.Stop() }, nil
}

// picker builds the --policy picker; the prefix policy also returns its
// index.
func picker(c *Config) (proxy.Picker, *routing.Prefix) {
	switch c.Policy {
	case "prefix":
		idx := prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: c.PrefixCapacityBlocks,
			MaxEntries: c.PrefixMaxEntries, TTL: c.PrefixTTL})
		p := routing.NewPrefix(idx, c.PrefixBlockBytes, c.Prefix)
		return p, p
	case "round-robin":
		return routing.NewRoundRobin(), nil
	case "random":
		return routing.NewRandom(nil), nil
	default:
		return routing.NewLeastRequest(nil), nil
	}
}

// readyAddrs are the bound listener addresses, sent once kvroute serves.
type readyAddrs struct{ API, Admin string }

// run is kvroute's main: it serves until ctx is done, then drains. ready,
// when non-nil, receives the bound addresses (tests listen on ":0").
func run(ctx context.Context, args []string, stdout, stderr io.Writer, ready chan<- readyAddrs) error {
	cfg, err := parseConfig(args, os.Getenv, stdout)
	if err != nil {
		return err
	}
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("invalid configuration:\n%w", err)
	}
	logger, flush, err := newLogger(cfg, stderr)
	if err != nil {
		return err
	}
	defer flush()

	pool := &discovery.Pool{}
	eps := make([]*discovery.Endpoint, 0, len(cfg.Backends))
	for _, b := range cfg.Backends {
		ep, _ := discovery.NewEndpoint(b, discovery.RoleMixed) // validated above
		eps = append(eps, ep)
	}
	pool.Publish(eps)

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m := metrics.New(reg, proxy.Classes, func(yield func(metrics.EndpointSample)) {
		for _, e := range pool.Load().Endpoints {
			yield(metrics.EndpointSample{URL: e.URL, Role: e.Role.String(),
				InFlight: e.InFlight.Load(), Requests: e.Requests.Load(), Failures: e.Failures.Load()})
		}
	})
	pick, pfx := picker(cfg)
	var learner proxy.Learner
	if pfx != nil {
		learner = pfx
	}
	srv := proxy.New(proxy.Options{
		Learner: learner,
		Picker:  pick, Pool: pool, Metrics: m, Logger: logger, AccessLog: cfg.AccessLog,
		BlockSize: cfg.PrefixBlockBytes, MaxBlocks: cfg.PrefixMaxBlocks,
		MaxBodyBytes: cfg.MaxBodyBytes, Retries: cfg.Retries,
		ConnectTimeout: cfg.ConnectTimeout, ResponseHeaderTimeout: cfg.ResponseHeaderTimeout,
		StreamIdleTimeout: cfg.StreamIdleTimeout, UpstreamIdleTimeout: cfg.UpstreamIdleTimeout,
		ClientIdleTimeout: cfg.ClientIdleTimeout, MaxConnsPerEndpoint: cfg.MaxConnsPerEndpoint,
	})

	apiLn, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listen %s: %w", cfg.Listen, err)
	}
	adminLn, err := net.Listen("tcp", cfg.AdminListen)
	if err != nil {
		apiLn.Close()
		return fmt.Errorf("admin listen %s: %w", cfg.AdminListen, err)
	}
	mux := srv.AdminHandler(reg)
	if pfx != nil {
		srv.HandleExplain(mux, pfx)
		proxy.HandleParams(mux, pfx)
		idx := pfx.Index()
		metrics.RegisterIndex(reg, func() metrics.IndexSample {
			s := idx.Stats()
			return metrics.IndexSample{Endpoints: s.Endpoints, Hashes: s.Hashes, Entries: s.Entries,
				Bytes: s.Bytes, Evictions: s.Evictions, Expiries: s.Expiries}
		})
	}
	admin := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	errc := make(chan error, 2)
	go func() { errc <- srv.Serve(apiLn) }()
	go func() {
		if err := admin.Serve(adminLn); !errors.Is(err, http.ErrServerClosed) {
			errc <- err
		}
	}()
	logger.Info("kvroute serving", zap.String("listen", apiLn.Addr().String()),
		zap.String("admin", adminLn.Addr().String()), zap.String("policy", cfg.Policy),
		zap.Int("backends", len(eps)))
	if ready != nil {
		ready <- readyAddrs{API: apiLn.Addr().String(), Admin: adminLn.Addr().String()}
	}

	select {
	case err := <-errc:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	logger.Info("draining", zap.Duration("timeout", cfg.DrainTimeout))
	dctx, cancel := context.WithTimeout(context.Background(), cfg.DrainTimeout)
	defer cancel()
	if err := srv.Shutdown(dctx); err != nil {
		logger.Warn("drain incomplete", zap.Error(err))
	}
	_ = admin.Shutdown(dctx)
	logger.Info("stopped")
	return nil
}
