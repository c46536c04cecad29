// Command kvroute is a KV-cache-aware L7 router for LLM inference servers
// (vLLM, SGLang). It stands where a Kubernetes ClusterIP Service would stand
// and forwards the OpenAI API to the model-server pods behind it.
package main

import (
	"context"
	"encoding/json"
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

	Backends        []string
	PrefillBackends []string
	DecodeBackends  []string
	Service         string
	PrefillService  string
	DecodeService   string
	ServiceScheme   string
	DNSResolvConf   string
	DNSServer       string
	DNSInterval     time.Duration
	Policy          string

	HealthInterval      time.Duration
	HealthTimeout       time.Duration
	HealthFailThreshold int
	HealthRiseThreshold int
	EjectFailures       int
	EjectCooldown       time.Duration
	EjectMaxCooldown    time.Duration
	ScrapeInterval      time.Duration
	ScrapeTimeout       time.Duration
	EndpointDrainLimit  time.Duration

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
	listen, backends, health, pfx, upstream, ops := g("Listeners"), g("Backends and routing"), g("Health and engine metrics"),
		g("Prefix-aware routing (--policy prefix)"), g("Upstream connections"), g("Operations")

	listen.fs.StringVar(&c.Listen, "listen", ":8000", "address of the OpenAI-compatible API listener")
	listen.fs.StringVar(&c.AdminListen, "admin-listen", ":9090", "address of the admin listener (/metrics, /livez, /readyz, /debug/pprof/)")
	listen.fs.IntVar(&c.MaxBodyBytes, "max-body-bytes", 64<<20, "largest request body accepted; larger ones get 413")
	listen.fs.DurationVar(&c.ClientIdleTimeout, "client-idle-timeout", 2*time.Minute, "close client keep-alive connections idle this long")

	backends.fs.StringVar(&c.Service, "service", "", "headless Service of the model-server pods, NAME[:PORT|:PORTNAME] (e.g. vllm.llm.svc.cluster.local:8000); resolved through DNS")
	backends.fs.StringSliceVar(&c.Backends, "backends", nil, "static model-server base URLs (http://host:port), repeated or comma-separated")
	backends.fs.StringVar(&c.PrefillService, "prefill-service", "", "headless Service of the prefill pool (disaggregated serving)")
	backends.fs.StringVar(&c.DecodeService, "decode-service", "", "headless Service of the decode pool (disaggregated serving)")
	backends.fs.StringSliceVar(&c.PrefillBackends, "prefill-backends", nil, "static base URLs of the prefill pool")
	backends.fs.StringSliceVar(&c.DecodeBackends, "decode-backends", nil, "static base URLs of the decode pool")
	backends.fs.StringVar(&c.ServiceScheme, "service-scheme", "http", "scheme of endpoints found through DNS: http or https")
	backends.fs.StringVar(&c.DNSResolvConf, "dns-resolv-conf", "/etc/resolv.conf", "resolver configuration: nameservers, search domains, ndots (as a pod's resolver)")
	backends.fs.StringVar(&c.DNSServer, "dns-server", "", "DNS server host:port, overriding the resolv.conf nameservers")
	backends.fs.DurationVar(&c.DNSInterval, "dns-interval", 5*time.Second, "re-resolve Services this often (sooner when record TTLs are shorter)")
	backends.fs.StringVar(&c.Policy, "policy", "prefix", "routing policy: "+strings.Join(policies, ", "))
	backends.fs.IntVar(&c.Retries, "retries", 2, "times a request may be re-sent to another endpoint on connection failure or 429/502/503/504, before its first response byte")

	health.fs.DurationVar(&c.HealthInterval, "health-interval", 5*time.Second, "GET /health every endpoint this often (0: no probes)")
	health.fs.DurationVar(&c.HealthTimeout, "health-timeout", 2*time.Second, "timeout of one health probe")
	health.fs.IntVar(&c.HealthFailThreshold, "health-fail-threshold", 3, "consecutive failed probes that mark an endpoint down")
	health.fs.IntVar(&c.HealthRiseThreshold, "health-rise-threshold", 2, "consecutive good probes that bring it back")
	health.fs.IntVar(&c.EjectFailures, "eject-failures", 5, "consecutive request failures (connection errors, 5xx) that eject an endpoint (0: never)")
	health.fs.DurationVar(&c.EjectCooldown, "eject-cooldown", 5*time.Second, "first ejection's length; doubles on repeat")
	health.fs.DurationVar(&c.EjectMaxCooldown, "eject-max-cooldown", 2*time.Minute, "longest ejection")
	health.fs.DurationVar(&c.ScrapeInterval, "scrape-interval", time.Second, "scrape every endpoint's /metrics this often for queue and KV usage (0: never)")
	health.fs.DurationVar(&c.ScrapeTimeout, "scrape-timeout", time.Second, "timeout of one scrape")
	health.fs.DurationVar(&c.EndpointDrainLimit, "endpoint-drain-limit", 10*time.Minute, "an endpoint that left DNS is dropped once idle, or after this long")

	d := routing.DefaultPrefixParams()
	pfx.fs.IntVar(&c.PrefixBlockBytes, "prefix-block-bytes", 1024, "bytes of the canonical prompt rendering per hashed block (1 KiB ≈ 256 tokens)")
	pfx.fs.IntVar(&c.PrefixMaxBlocks, "prefix-max-blocks", 256, "blocks hashed per request; 256 × 1 KiB covers 256 KiB ≈ 64k tokens")
	pfx.fs.IntVar(&c.PrefixCapacityBlocks, "prefix-capacity-blocks", 1760, "index blocks remembered per endpoint: the engine's KV capacity in blocks (450k tokens / 256 for an 8B model on an H100)")
	pfx.fs.IntVar(&c.PrefixMaxEntries, "prefix-max-entries", 4_000_000, "cap on (block, endpoint) entries of all endpoints together (≈ 56 bytes each)")
	pfx.fs.DurationVar(&c.PrefixTTL, "prefix-ttl", 30*time.Minute, "forget blocks nobody was routed to for this long (0: never)")
	pfx.fs.Float64Var(&c.Prefix.PrefillTokensPerSec, "prefix-prefill-tokens-per-sec", d.PrefillTokensPerSec, "an endpoint's prefill rate, turning uncached tokens into seconds of wait")
	pfx.fs.Float64Var(&c.Prefix.DecodeCostSec, "prefix-decode-cost", d.DecodeCostSec, "seconds of wait one in-flight request adds to a new request's first token")
	pfx.fs.Float64Var(&c.Prefix.SpillMarginSec, "prefix-spill-margin", d.SpillMarginSec, "seconds the warm endpoint's wait may exceed the best alternative's before the request spills")
	pfx.fs.Float64Var(&c.Prefix.SpillRatio, "prefix-spill-ratio", d.SpillRatio, "the warm endpoint keeps a request while its wait is at most this × the best wait + the spill margin")
	pfx.fs.Float64Var(&c.Prefix.SpillMaxKVUsage, "prefix-spill-max-kv-usage", d.SpillMaxKVUsage, "an endpoint takes spills only while its scraped KV usage is below this (a fuller cache would evict the prefixes homed there)")
	pfx.fs.IntVar(&c.Prefix.MinMatchBlocks, "prefix-min-match-blocks", d.MinMatchBlocks, "least matched blocks that make an endpoint warm (a short shared system prompt must not pin the fleet)")
	pfx.fs.Float64Var(&c.Prefix.TieSec, "prefix-tie", d.TieSec, "waits closer than this are ties, broken by rendezvous hashing")
	pfx.fs.Float64Var(&c.Prefix.QueueCostSec, "prefix-queue-cost", d.QueueCostSec, "seconds of wait per request queued in the engine (scraped)")
	pfx.fs.Float64Var(&c.Prefix.KVCostSec, "prefix-kv-cost", d.KVCostSec, "seconds of wait at a full KV cache (scraped usage 1.0), linear in usage")
	pfx.fs.Float64Var(&c.Prefix.HomeLoadFactor, "prefix-home-load-factor", d.HomeLoadFactor, "no endpoint homes more than this × the mean number of recurring prefixes (a prefix is homed on its rendezvous winner unless that endpoint is full)")

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
	groups := []flagGroup{listen, backends, health, pfx, upstream, ops}
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
	if len(c.Backends) == 0 && c.Service == "" {
		bad("no backends: set --service (a headless Service) or --backends (e.g. --backends http://10.0.0.7:8000,http://10.0.0.8:8000)")
	}
	for name, list := range map[string][]string{"--backends": c.Backends, "--prefill-backends": c.PrefillBackends, "--decode-backends": c.DecodeBackends} {
		for _, b := range list {
			if _, err := discovery.NewEndpoint(b, discovery.RoleMixed); err != nil {
				bad("%s: %v", name, err)
			}
		}
	}
	if c.ServiceScheme != "http" && c.ServiceScheme != "https" {
		bad("--service-scheme %q: want http or https", c.ServiceScheme)
	}
	if c.DNSServer != "" {
		if _, _, err := net.SplitHostPort(c.DNSServer); err != nil {
			bad("--dns-server %q: want host:port", c.DNSServer)
		}
	}
	if c.HealthFailThreshold < 1 || c.HealthRiseThreshold < 1 || c.EjectFailures < 0 {
		bad("--health-fail-threshold and --health-rise-threshold must be at least 1, --eject-failures not negative")
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
		{"--dns-interval", c.DNSInterval}, {"--health-interval", c.HealthInterval}, {"--health-timeout", c.HealthTimeout},
		{"--eject-cooldown", c.EjectCooldown}, {"--eject-max-cooldown", c.EjectMaxCooldown},
		{"--scrape-interval", c.ScrapeInterval}, {"--scrape-timeout", c.ScrapeTimeout}, {"--endpoint-drain-limit", c.EndpointDrainLimit},
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

// newFleet builds discovery from the configuration: static lists and DNS
// sources per pool, health probes, passive ejection and engine scraping.
// Endpoints that leave, or whose engine restarts, are forgotten by the
// prefix index; a scraped KV capacity sizes the endpoint's index LRU.
func newFleet(cfg *Config, logger *zap.Logger, pfx *routing.Prefix) (*discovery.Fleet, error) {
	o := discovery.Options{
		Logger: logger.Named("discovery"),
		Health: discovery.HealthConfig{Disabled: cfg.HealthInterval == 0, Interval: cfg.HealthInterval,
			Timeout: cfg.HealthTimeout, FailThreshold: cfg.HealthFailThreshold, RiseThreshold: cfg.HealthRiseThreshold},
		Passive: discovery.PassiveConfig{Disabled: cfg.EjectFailures == 0, Failures: cfg.EjectFailures,
			Cooldown: cfg.EjectCooldown, MaxCooldown: cfg.EjectMaxCooldown},
		Scrape:     discovery.ScrapeConfig{Disabled: cfg.ScrapeInterval == 0, Interval: cfg.ScrapeInterval, Timeout: cfg.ScrapeTimeout},
		DrainLimit: cfg.EndpointDrainLimit,
	}
	var events routing.FleetEvents
	events.Set(pfx)
	events.Wire(&o)
	fleet, err := discovery.New(o)
	if err != nil {
		return nil, err
	}
	for _, src := range []struct {
		role discovery.Role
		urls []string
		svc  string
	}{
		{discovery.RoleMixed, cfg.Backends, cfg.Service},
		{discovery.RolePrefill, cfg.PrefillBackends, cfg.PrefillService},
		{discovery.RoleDecode, cfg.DecodeBackends, cfg.DecodeService},
	} {
		if len(src.urls) > 0 {
			if err := fleet.AddStatic(src.role, src.urls); err != nil {
				return nil, err
			}
		}
		if src.svc != "" {
			if err := fleet.AddDNS(discovery.DNSConfig{Service: src.svc, Role: src.role, Scheme: cfg.ServiceScheme,
				ResolvConf: cfg.DNSResolvConf, Server: cfg.DNSServer, Interval: cfg.DNSInterval,
				MinInterval: min(time.Second, cfg.DNSInterval)}); err != nil {
				return nil, err
			}
		}
	}
	return fleet, nil
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

	pick, pfx := picker(cfg)
	fleet, err := newFleet(cfg, logger, pfx)
	if err != nil {
		return err
	}
	pool := fleet.Pool()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), fleet)
	m := metrics.New(reg, proxy.Classes, func(yield func(metrics.EndpointSample)) {
		for _, e := range pool.Load().Endpoints {
			yield(metrics.EndpointSample{URL: e.URL, Role: e.Role.String(),
				InFlight: e.InFlight.Load(), Requests: e.Requests.Load(), Failures: e.Failures.Load()})
		}
	})
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
	mux.HandleFunc("GET /debug/endpoints", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(fleet.Endpoints())
	})
	if pfx != nil {
		srv.HandleExplain(mux, pfx)
		proxy.HandleParams(mux, pfx)
		metrics.RegisterIndex(reg, func() metrics.IndexSample {
			s := pfx.Index().Stats()
			return metrics.IndexSample{Endpoints: s.Endpoints, Hashes: s.Hashes, Entries: s.Entries,
				Bytes: s.Bytes, Evictions: s.Evictions, Expiries: s.Expiries, Homes: pfx.Homes()}
		})
	}
	admin := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	fctx, stopFleet := context.WithCancel(context.Background())
	defer stopFleet()
	fleetDone := make(chan struct{})
	go func() { defer close(fleetDone); _ = fleet.Run(fctx) }()
	errc := make(chan error, 2)
	go func() { errc <- srv.Serve(apiLn) }()
	go func() {
		if err := admin.Serve(adminLn); !errors.Is(err, http.ErrServerClosed) {
			errc <- err
		}
	}()
	logger.Info("kvroute serving", zap.String("listen", apiLn.Addr().String()),
		zap.String("admin", adminLn.Addr().String()), zap.String("policy", cfg.Policy),
		zap.Int("endpoints", pool.Load().Len()), zap.String("service", cfg.Service))
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
	stopFleet() // health and draining kept running during the drain
	<-fleetDone
	logger.Info("stopped")
	return nil
}
