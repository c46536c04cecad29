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
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/pflag"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/kvroute/kvroute/app"
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

// config is kvroute's whole configuration: the router's (app.Config)
// and the process's own. Every field is a flag, also settable as
// KVROUTE_<FLAG> in the environment (flag name upper-cased, dashes as
// underscores); a flag on the command line wins.
type config struct {
	app.Config
	Listen       string
	AdminListen  string
	DrainTimeout time.Duration
	LogLevel     string
	LogFormat    string
	showVersion  bool
}

// newFlags binds c's fields to flags, in groups; each flag's default is
// the field's value in c (app.DefaultConfig for the router's).
func newFlags(c *config) *app.Flags {
	f := app.NewFlags("kvroute", "kvroute: a KV-cache-aware router for vLLM, SGLang, llama.cpp and Ollama.\n\nUsage: kvroute [flags]\n\n"+
		"Every flag may also be set as KVROUTE_<FLAG> in the environment, e.g. KVROUTE_BACKENDS.\n")
	g := f.Group
	listen, backends, health, pfx, kv, pd, upstream, ops := g("Listeners"), g("Backends and routing"), g("Health and engine metrics"),
		g("Prefix-aware routing (--policy prefix)"), g("Engine KV-cache events (--policy prefix)"),
		g("Prefill/decode disaggregation (with a decode pool)"), g("Upstream connections"), g("Operations")

	listen.StringVar(&c.Listen, "listen", c.Listen, "address of the OpenAI-compatible API listener")
	listen.StringVar(&c.AdminListen, "admin-listen", c.AdminListen, "address of the admin listener (/metrics, /livez, /readyz, /debug/pprof/)")
	listen.IntVar(&c.MaxBodyBytes, "max-body-bytes", c.MaxBodyBytes, "largest request body accepted; larger ones get 413")
	listen.DurationVar(&c.ClientIdleTimeout, "client-idle-timeout", c.ClientIdleTimeout, "close client keep-alive connections idle this long")
	listen.DurationVar(&c.ClientHeaderTimeout, "client-header-timeout", c.ClientHeaderTimeout, "a request's header block must arrive within this of its first byte (0: no limit)")
	listen.DurationVar(&c.ClientBodyTimeout, "client-body-timeout", c.ClientBodyTimeout, "longest wait for the next bytes of a request body (0: no limit)")
	listen.IntVar(&c.MaxHeaderBytes, "max-header-bytes", c.MaxHeaderBytes, "largest request header block accepted; larger ones get 431")
	listen.IntVar(&c.MaxPromptTokens, "max-prompt-tokens", c.MaxPromptTokens, "most token ids a prompt may carry; longer ones get vLLM's context-length error (400)")
	listen.StringVar(&c.AdminToken, "admin-token", c.AdminToken, "bearer token required by the admin listener's mutating endpoints and /debug/pprof/, which are off without one (prefer KVROUTE_ADMIN_TOKEN)")

	backends.StringVar(&c.Service, "service", c.Service, "headless Service of the model-server pods, NAME[:PORT|:PORTNAME] (e.g. vllm.llm.svc.cluster.local:8000); resolved through DNS")
	backends.StringSliceVar(&c.Backends, "backends", c.Backends, "static model-server base URLs (http://host:port), repeated or comma-separated")
	backends.StringVar(&c.PrefillService, "prefill-service", c.PrefillService, "headless Service of the prefill pool (disaggregated serving)")
	backends.StringVar(&c.DecodeService, "decode-service", c.DecodeService, "headless Service of the decode pool (disaggregated serving)")
	backends.StringSliceVar(&c.PrefillBackends, "prefill-backends", c.PrefillBackends, "static base URLs of the prefill pool")
	backends.StringSliceVar(&c.DecodeBackends, "decode-backends", c.DecodeBackends, "static base URLs of the decode pool")
	backends.StringVar(&c.ServiceScheme, "service-scheme", c.ServiceScheme, "scheme of endpoints found through DNS: http or https")
	backends.StringVar(&c.DNSResolvConf, "dns-resolv-conf", c.DNSResolvConf, "resolver configuration: nameservers, search domains, ndots (as a pod's resolver)")
	backends.StringVar(&c.DNSServer, "dns-server", c.DNSServer, "DNS server host:port, overriding the resolv.conf nameservers")
	backends.DurationVar(&c.DNSInterval, "dns-interval", c.DNSInterval, "re-resolve Services this often (sooner when record TTLs are shorter)")
	backends.StringVar(&c.Policy, "policy", c.Policy, "routing policy: "+strings.Join(routing.PolicyNames(routing.Policies()), ", "))
	backends.IntVar(&c.Retries, "retries", c.Retries, "times a request may be re-sent to another endpoint when no answer can come from where it went: connection refused, no free connection, a failed write, a 429/503 answer, or a connection closed or reset before the first response byte (never after a timeout)")
	backends.Float64Var(&c.RetryBudget, "retry-budget", c.RetryBudget, "share of recent requests (10 s window) that may be retries (0: no budget)")
	backends.IntVar(&c.MinRetries, "min-retries", c.MinRetries, "retries allowed per window whatever the budget")
	backends.IntVar(&c.MaxMigrations, "max-migrations", c.MaxMigrations, "times a streamed completion or chat answer whose pod fails mid-stream is continued on another pod, text-exact (0: never; each counts as a retry in the budget)")
	backends.DurationVar(&c.QueueTimeout, "queue-timeout", c.QueueTimeout, "when every eligible endpoint is saturated, wait this long in kvroute for one, then answer 429 (0: at once)")
	backends.IntVar(&c.MaxQueue, "max-queue", c.MaxQueue, "most requests waiting for a saturated fleet; beyond, 429 at once")
	backends.IntVar(&c.Tenants.MaxQueue, "max-queue-per-tenant", c.Tenants.MaxQueue, "most requests of one tenant waiting for a saturated fleet; beyond, that tenant gets 429 while others still queue (0: --max-queue)")
	backends.StringVar(&c.Tenants.Header, "tenant-header", c.Tenants.Header, "request header naming the tenant (set by a gateway in front); default: the API key (Authorization: Bearer). Either is kept only as a hash")
	backends.StringVar(&c.Tenants.PriorityHeader, "priority-header", c.Tenants.PriorityHeader, "request header whose value (priority, default, flex) sets a request's class over its body's service_tier (\"\": service_tier only)")
	backends.StringVar(&c.BudgetsFile, "tenant-budgets", c.BudgetsFile, "JSON file of per-tenant budgets (weight, max_concurrency, tokens_per_minute, requests_per_minute, max_class; see docs/operations.md), reloaded when it changes; a bad file is refused and the budgets in force stay")
	backends.BoolVar(&c.Tenants.EnginePriority, "engine-priority", c.Tenants.EnginePriority, "pass each request's class on to the engines as vLLM's priority field (priority -1, flex 1; for vLLM run with --scheduling-policy priority, which refuses the field otherwise)")
	backends.IntVar(&c.Tenants.Reserve, "tenant-reserve", c.Tenants.Reserve, "free places of a saturated fleet that a tenant's requests of one class, running their share of the fleet's batches or more, leave to active tenants running less than theirs and to a higher class (0: none; the queue is then fully work-conserving)")
	backends.BoolVar(&c.Tenants.Preempt, "tenant-preempt", c.Tenants.Preempt, "take a place back for a tenant below its share of a saturated fleet, or a higher class: cut the stream that started last of a tenant above its share (or a lower class), which continues, text-exact, once a place is free for it (needs --max-migrations > 0; an engine found to go on with a cut request is not cut for 10 minutes)")
	backends.BoolVar(&c.Tenants.FIFO, "queue-fifo", c.Tenants.FIFO, "order the queue by arrival alone, ignoring tenants and classes (the order before tenants)")
	backends.IntVar(&c.MaxInFlightPerEndpoint, "max-in-flight-per-endpoint", c.MaxInFlightPerEndpoint, "this router's requests in flight per endpoint before it counts as saturated (0: no cap but --max-conns-per-endpoint)")

	healthFlags(health, c)
	gossipFlags(g("Router replicas (gossip, --policy prefix)"), c)

	pfx.IntVar(&c.PrefixBlockBytes, "prefix-block-bytes", c.PrefixBlockBytes, "bytes of the canonical prompt rendering per hashed block (1 KiB ≈ 256 tokens)")
	pfx.IntVar(&c.NearMissBlocks, "near-miss-blocks", c.NearMissBlocks, "leading blocks of every prompt checked for near-identical prefixes (the same text up to whitespace, line endings or a byte-order mark, but other bytes: counted in kvroute_prompt_near_misses_total, sampled in the log; 0: off)")
	pfx.BoolVar(&c.NormalizePrompts, "normalize-prompts", c.NormalizePrompts, "rewrite prompt and message text to one normal form before routing and forwarding: outside fenced code blocks, byte-order marks removed and each line's trailing carriage return, spaces and tabs removed (CRLF becomes LF); nothing else changes, and a body already in normal form is forwarded byte for byte")
	pfx.IntVar(&c.PrefixMaxBlocks, "prefix-max-blocks", c.PrefixMaxBlocks, "blocks hashed per request; 256 × 1 KiB covers 256 KiB ≈ 64k tokens")
	pfx.IntVar(&c.PrefixCapacityBlocks, "prefix-capacity-blocks", c.PrefixCapacityBlocks, "index blocks remembered per endpoint: the engine's KV capacity in blocks (450k tokens / 256 for an 8B model on an H100)")
	pfx.IntVar(&c.PrefixMaxEntries, "prefix-max-entries", c.PrefixMaxEntries, "cap on (block, endpoint) entries of all endpoints together (≈ 56 bytes each)")
	pfx.DurationVar(&c.PrefixTTL, "prefix-ttl", c.PrefixTTL, "forget blocks nobody was routed to for this long (0: never)")
	pfx.Float64Var(&c.Prefix.PrefillTokensPerSec, "prefix-prefill-tokens-per-sec", c.Prefix.PrefillTokensPerSec, "prior prefill rate of an endpoint, turning uncached tokens into seconds of wait (learned per endpoint; setting it pins it)")
	pfx.Float64Var(&c.Prefix.DecodeCostSec, "prefix-decode-cost", c.Prefix.DecodeCostSec, "prior seconds of wait one in-flight request adds: one decode step (learned per endpoint from the engine's inter-token latency; setting it pins it)")
	pfx.IntVar(&c.Prefix.BatchLimit, "prefix-batch-limit", c.Prefix.BatchLimit, "requests an endpoint runs at once, its max_num_seqs (0: learned per endpoint from the engine's running and waiting counts; setting it pins it)")
	pfx.Float64Var(&c.Prefix.SpillMarginSec, "prefix-spill-margin", c.Prefix.SpillMarginSec, "seconds the warm endpoint's wait may exceed the best alternative's before the request spills")
	pfx.Float64Var(&c.Prefix.SpillRatio, "prefix-spill-ratio", c.Prefix.SpillRatio, "the warm endpoint keeps a request while its wait is at most this × the best wait + the spill margin")
	pfx.Float64Var(&c.Prefix.SpillMaxKVUsage, "prefix-spill-max-kv-usage", c.Prefix.SpillMaxKVUsage, "an endpoint takes spills only while its scraped KV usage is below this (a fuller cache would evict the prefixes homed there)")
	pfx.IntVar(&c.Prefix.MinMatchBlocks, "prefix-min-match-blocks", c.Prefix.MinMatchBlocks, "least matched blocks that make an endpoint warm, and the depth of the block that keys a prefix's home (a shared prefix shorter than this many blocks is not seen)")
	pfx.Float64Var(&c.Prefix.TieSec, "prefix-tie", c.Prefix.TieSec, "waits closer than this are ties, broken by rendezvous hashing")
	pfx.Float64Var(&c.Prefix.QueueCostSec, "prefix-queue-cost", c.Prefix.QueueCostSec, "prior seconds of wait per request queued in the engine, scraped (learned per endpoint as its mean prefill time or batch turnover; setting it pins it)")
	pfx.Float64Var(&c.Prefix.KVCostSec, "prefix-kv-cost", c.Prefix.KVCostSec, "seconds of wait at a full KV cache (scraped usage 1.0), linear in usage")
	pfx.Float64Var(&c.Prefix.HomeLoadFactor, "prefix-home-load-factor", c.Prefix.HomeLoadFactor, "no endpoint homes more than this × the mean number of recurring prefixes (a prefix is homed on its rendezvous winner unless that endpoint is full; a router alone places a new prefix below the mean)")

	kv.IntVar(&c.KVEventsPort, "kv-events-port", c.KVEventsPort, "subscribe to every endpoint's KV-cache events at tcp://<endpoint host>:PORT (vLLM --kv-events-config publisher zmq, endpoint tcp://*:5557; SGLang likewise), following discovery: the engines' stores, evictions and restarts then correct the prefix index (0: off)")
	kv.StringVar(&c.KVEventsListen, "kv-events-listen", c.KVEventsListen, "bind a ZeroMQ SUB socket at tcp://HOST:PORT or HOST:PORT (host * or empty: every interface) for publishers that dial in (e.g. the llm-d inference simulator's --zmq-endpoint); endpoints are told apart by the topic kv@<ip>:<port>@<model> (off when empty)")
	kv.IntVar(&c.KVEventsReplayPort, "kv-events-replay-port", c.KVEventsReplayPort, "the engines' replay endpoint port (vLLM replay_endpoint): missed batches are asked for there; without it a gap drops the endpoint to learning until its next batch (0: off)")
	kv.DurationVar(&c.KVEventsStaleAfter, "kv-events-stale-after", c.KVEventsStaleAfter, "an endpoint whose events stopped this long while it was sent requests falls back to learning until events resume (0: never)")
	kv.BoolVar(&c.KVEventsTiers, "kv-events-tiers", c.KVEventsTiers, "count blocks the engines offloaded to CPU memory or storage (an event's medium) as cached: a hit there costs a load, not a recompute (false: GPU blocks only)")
	kv.Float64Var(&c.TokenizeRate, "tokenize-rate", c.TokenizeRate, "most POST /tokenize requests a second kvroute sends the engines, off the request path, to line each new prompt's bytes up with the tokens the events name (once per new prompt)")

	pd.StringVar(&c.PDProtocol, "pd-protocol", c.PDProtocol, "prefill/decode handoff protocol with a decode pool: vllm (NixlConnector: a prefill leg, then its kv_transfer_params to the decode pod) or sglang (bootstrap room, both legs at once)")
	pd.IntVar(&c.PDMinUncachedTokens, "pd-min-uncached-tokens", c.PDMinUncachedTokens, "vllm: a request on a decode pod gets a prefill leg only when its prompt tokens not cached there reach this (0: learned per decode pod: the tokens it prefills in one decode step plus half an index block, at least one block; 328 with the priors)")
	pd.DurationVar(&c.PrefillTimeout, "prefill-timeout", c.PrefillTimeout, "bound on a prefill leg, from sending it to its whole answer; then another prefill pod, then the decode pod alone (0: none)")
	pd.IntVar(&c.PDBootstrapPort, "pd-bootstrap-port", c.PDBootstrapPort, "sglang: the prefill pods' bootstrap port, unless a prefill URL names its own (http://host:port#bootstrap=PORT)")
	pd.BoolVar(&c.TrustClientKVParams, "trust-client-kv-params", c.TrustClientKVParams, "forward a client's own kv_transfer_params / bootstrap_* fields (without a prefill leg) instead of refusing them with 400; they make a decode engine connect where they say")

	upstream.DurationVar(&c.ConnectTimeout, "connect-timeout", c.ConnectTimeout, "timeout for connecting to a model server")
	upstream.DurationVar(&c.ResponseHeaderTimeout, "response-header-timeout", c.ResponseHeaderTimeout, "timeout from sending a request to the first response byte (0: none); non-streaming requests answer only after generation")
	upstream.DurationVar(&c.StreamIdleTimeout, "stream-idle-timeout", c.StreamIdleTimeout, "longest gap between two chunks of a response body (0: none); there is never a total deadline on a stream")
	upstream.DurationVar(&c.UpstreamIdleTimeout, "upstream-idle-timeout", c.UpstreamIdleTimeout, "close idle upstream keep-alive connections after this; keep below the engine's keep-alive (uvicorn, hence vLLM and SGLang: 5s)")
	upstream.IntVar(&c.MaxConnsPerEndpoint, "max-conns-per-endpoint", c.MaxConnsPerEndpoint, "upstream connection cap per endpoint (each stream holds one)")

	ops.DurationVar(&c.ShutdownDelay, "shutdown-delay", c.ShutdownDelay, "on SIGTERM, keep accepting (answering with Connection: close) for this long while /readyz answers 503, so that Services and load balancers stop sending first; then drain")
	ops.DurationVar(&c.DrainTimeout, "drain-timeout", c.DrainTimeout, "on SIGTERM, after --shutdown-delay, how long in-flight requests and streams may finish")
	ops.StringVar(&c.LogLevel, "log-level", c.LogLevel, "log level: debug, info, warn, error")
	ops.StringVar(&c.LogFormat, "log-format", c.LogFormat, "log format: json or console")
	ops.BoolVar(&c.AccessLog, "access-log", c.AccessLog, "log one line per request")
	ops.Float64Var(&c.AccessLogSample, "access-log-sample", c.AccessLogSample, "share of successful requests (status < 400) the access log records, at random; errors are always logged")
	ops.StringVar(&c.OTLPEndpoint, "otlp-endpoint", c.OTLPEndpoint, "export OpenTelemetry spans (request, pick, prefill and decode legs) over OTLP/HTTP to this collector, e.g. http://otel-collector:4318 (off when empty)")
	ops.Float64Var(&c.OTLPSampleRatio, "otlp-sample-ratio", c.OTLPSampleRatio, "share of new traces sampled for export; a client's sampled traceparent is always followed")
	ops.BoolVar(&c.showVersion, "version", false, "print the version and exit")

	return f
}

// healthFlags binds the health, engine-dialect and engine-metrics flags.
func healthFlags(health *pflag.FlagSet, c *config) {
	health.DurationVar(&c.HealthInterval, "health-interval", c.HealthInterval, "probe every endpoint (GET /health; Ollama: /api/version) this often (0: no probes)")
	health.DurationVar(&c.HealthTimeout, "health-timeout", c.HealthTimeout, "timeout of one health probe")
	health.StringVar(&c.HealthPath, "health-path", c.HealthPath, "probe path of every endpoint (default: its engine dialect's, /health, or /api/version for Ollama); a 404 or 405 is never a failed probe")
	health.StringVar(&c.EngineDialect, "engine-dialect", c.EngineDialect, "engine of every endpoint: auto (detect each endpoint's), vllm, sglang, llamacpp or ollama; decides the probe path, model-name matching and the metrics read")
	health.IntVar(&c.HealthFailThreshold, "health-fail-threshold", c.HealthFailThreshold, "consecutive failed probes that mark an endpoint down")
	health.IntVar(&c.HealthRiseThreshold, "health-rise-threshold", c.HealthRiseThreshold, "consecutive good probes that bring it back")
	health.IntVar(&c.EjectFailures, "eject-failures", c.EjectFailures, "consecutive request failures (connection errors, 5xx) that eject an endpoint (0: never)")
	health.DurationVar(&c.EjectCooldown, "eject-cooldown", c.EjectCooldown, "first ejection's length; doubles on repeat")
	health.DurationVar(&c.EjectMaxCooldown, "eject-max-cooldown", c.EjectMaxCooldown, "longest ejection")
	health.DurationVar(&c.ScrapeInterval, "scrape-interval", c.ScrapeInterval, "scrape every endpoint's /metrics this often for queue and KV usage (0: never)")
	health.DurationVar(&c.ScrapeTimeout, "scrape-timeout", c.ScrapeTimeout, "timeout of one scrape")
	health.DurationVar(&c.ModelsInterval, "models-interval", c.ModelsInterval, "read every endpoint's GET /v1/models this often, to send a request only to endpoints serving its model or LoRA adapter and to answer /v1/models with their union (0: never; every endpoint is presumed to serve every model)")
	health.DurationVar(&c.EndpointDrainLimit, "endpoint-drain-limit", c.EndpointDrainLimit, "an endpoint that left DNS is dropped once idle, or after this long")
}

// gossipFlags binds the replicas' gossip flags.
func gossipFlags(f *pflag.FlagSet, c *config) {
	f.StringSliceVar(&c.Peers, "peers", c.Peers, "other kvroute replicas' gossip addresses, host:port (repeated or comma-separated; this replica's own may be among them): replicas send each other the placements they make, so that a prefix placed by any replica is a warm route for all (off when empty)")
	f.StringVar(&c.PeersService, "peers-service", c.PeersService, "headless Service of kvroute's own pods, NAME[:PORT] (port 7946 by default, or a named port's SRV records), resolved like --service: the replicas found there gossip as with --peers; use publishNotReadyAddresses, since a replica is not ready before it has met its peers")
	f.StringVar(&c.GossipListen, "gossip-listen", c.GossipListen, "gossip listener, TCP and UDP (memberlist's port 7946), with --peers or --peers-service")
	f.StringVar(&c.GossipAdvertise, "gossip-advertise", c.GossipAdvertise, "host:port the other replicas reach this one at (empty: the listen address, or a private address of this host when it listens on all)")
	f.StringVar(&c.GossipKeyFile, "gossip-key-file", c.GossipKeyFile, "file of gossip keys, one base64 key of 16, 24 or 32 bytes a line (e.g. openssl rand -base64 32), the first used to send: gossip is encrypted and authenticated with them; required unless --gossip-listen is a loopback address")
	f.DurationVar(&c.GossipSyncTimeout, "gossip-sync-timeout", c.GossipSyncTimeout, "with --peers or --peers-service, /readyz waits until this replica has merged a peer's prefix index (it starts warm), at most this long (the first replica of a fleet meets none)")
}

// parseConfig reads flags from args and the environment (getenv).
func parseConfig(args []string, getenv func(string) string, usage io.Writer) (*config, error) {
	c := &config{Config: app.DefaultConfig(), Listen: ":8000", AdminListen: ":9090",
		DrainTimeout: 30 * time.Second, LogLevel: "info", LogFormat: "json"}
	flags := newFlags(c)
	if err := flags.Parse(args, usage); err != nil {
		return nil, err
	}
	fs := flags.All()
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
	// A learned constant that the operator set is pinned: their value is
	// the truth on every endpoint.
	for flag, name := range map[string]string{"prefix-prefill-tokens-per-sec": routing.PinPrefillRate,
		"prefix-decode-cost": routing.PinDecodeCost, "prefix-queue-cost": routing.PinQueueCost,
		"prefix-batch-limit": routing.PinBatchLimit} {
		if fs.Changed(flag) {
			c.Prefix.Pinned = append(c.Prefix.Pinned, name)
		}
	}
	slices.Sort(c.Prefix.Pinned)
	return c, errors.Join(errs...)
}

// Validate reports every problem of c at once.
func (c *config) Validate() error {
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
	if c.DrainTimeout < 0 {
		bad("--drain-timeout must not be negative, got %s", c.DrainTimeout)
	}
	if _, err := zapcore.ParseLevel(c.LogLevel); err != nil {
		bad("--log-level %q: want debug, info, warn or error", c.LogLevel)
	}
	if c.LogFormat != "json" && c.LogFormat != "console" {
		bad("--log-format %q: want json or console", c.LogFormat)
	}
	return errors.Join(append(errs, c.Config.Validate())...)
}

// newLogger builds the process logger and returns its output. Log lines
// are buffered (flushed every second and at exit), and the access log
// writes its batches to the same output, so that lines are never
// interleaved and cost no syscall each.
func newLogger(c *config, w io.Writer) (*zap.Logger, io.Writer, func(), error) {
	level, err := zapcore.ParseLevel(c.LogLevel)
	if err != nil {
		return nil, nil, nil, err
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
	return logger, ws, func() { _ = ws.Stop() }, nil
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
	bi := readBuildInfo()
	if cfg.showVersion {
		_, err := fmt.Fprintln(stdout, bi)
		return err
	}
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("invalid configuration:\n%w", err)
	}
	logger, out, flush, err := newLogger(cfg, stderr)
	if err != nil {
		return err
	}
	defer flush()
	if logger.Core().Enabled(zap.InfoLevel) { // the access log's lines are Info lines
		cfg.AccessLogTo, cfg.AccessLogConsole = out, cfg.LogFormat == "console"
	}

	cfg.Version, cfg.Revision = bi.Version, bi.Revision
	logger.Info("kvroute starting", zap.String("version", bi.Version), zap.String("revision", bi.Revision),
		zap.String("goversion", bi.GoVersion))
	router, err := app.New(cfg.Config, logger)
	if err != nil {
		return err
	}
	apiLn, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listen %s: %w", cfg.Listen, err)
	}
	adminLn, err := net.Listen("tcp", cfg.AdminListen)
	if err != nil {
		apiLn.Close()
		return fmt.Errorf("admin listen %s: %w", cfg.AdminListen, err)
	}
	if ready != nil {
		ready <- readyAddrs{API: apiLn.Addr().String(), Admin: adminLn.Addr().String()}
	}
	return router.Run(ctx, apiLn, adminLn, cfg.DrainTimeout)
}
