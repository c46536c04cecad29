package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"runtime"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/metrics"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// Config is a whole router's configuration: pools, discovery, policy,
// prefix index and upstream behaviour. Command-line flags bind to its
// fields (main.go); the benchmark fills it the same way. DefaultConfig is
// the one place its defaults live.
type Config struct {
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

	// HealthInterval 0 disables probes, EjectFailures 0 passive ejection,
	// ScrapeInterval 0 scraping.
	HealthInterval      time.Duration
	HealthTimeout       time.Duration
	HealthFailThreshold int
	HealthRiseThreshold int
	EjectFailures       int
	EjectCooldown       time.Duration
	EjectMaxCooldown    time.Duration
	ScrapeInterval      time.Duration
	ScrapeTimeout       time.Duration
	ModelsInterval      time.Duration
	EndpointDrainLimit  time.Duration

	Limits
	// Prefill/decode disaggregation (with a decode pool).
	PDProtocol          string
	PDMinUncachedTokens int
	PrefillTimeout      time.Duration
	PDBootstrapPort     int
	TrustClientKVParams bool

	AccessLog bool
	// AccessLogSample is the share of successful requests (status < 400)
	// the access log records; the others are always recorded.
	AccessLogSample float64
	// ShutdownDelay is how long, once Run's context is done, the API
	// listener keeps accepting while /readyz answers 503 (so that load
	// balancers stop sending first), before the drain.
	ShutdownDelay time.Duration
	// OTLPEndpoint, when set, is the OTLP/HTTP collector (base URL or
	// full /v1/traces URL) the request spans are exported to, with
	// OTLPSampleRatio of the traces that no sampled parent decides.
	OTLPEndpoint    string
	OTLPSampleRatio float64
	// AdminToken, when set, is the bearer token the admin listener's
	// mutating endpoints and /debug/pprof/ require; without it they are
	// off.
	AdminToken string

	// NearMissBlocks is how many leading blocks of every prompt the
	// near-identical prompt detector normalises (0: off).
	NearMissBlocks int
	// NormalizePrompts rewrites prompts' line endings, trailing blanks and
	// byte-order marks to one normal form (outside code blocks).
	NormalizePrompts bool

	// Engine truth (the prefix policy): KV-cache events by dialing every
	// endpoint's host at KVEventsPort and/or binding KVEventsListen, with
	// replay at KVEventsReplayPort; an endpoint whose events stop for
	// KVEventsStaleAfter while it is sent requests falls back to learning.
	// TokenizeRate bounds the tokenize requests that link prompts to the
	// events' tokens.
	KVEventsPort       int
	KVEventsListen     string
	KVEventsReplayPort int
	KVEventsStaleAfter time.Duration
	TokenizeRate       float64
	// KVEventsTiers counts blocks the events place in CPU or storage
	// tiers as held (false: the GPU's alone).
	KVEventsTiers bool

	PrefixBlockBytes     int
	PrefixMaxBlocks      int
	PrefixCapacityBlocks int
	PrefixMaxEntries     int
	PrefixTTL            time.Duration
	Prefix               routing.PrefixParams

	// Policies is the table Policy is looked up in; nil means
	// routing.Policies(). Not a flag: the benchmark adds its peers here.
	Policies map[string]routing.NewPolicy
	// Intn is the random and least-request policies' source of randomness
	// (nil: math/rand/v2). Not a flag: the benchmark seeds it.
	Intn func(int) int
	// Version and Revision are the build's (kvroute_build_info, the
	// spans' service.version). Not flags: main sets them.
	Version, Revision string
}

// DefaultConfig returns the defaults of every field: discovery's own for
// health, ejection, scraping and DNS, the prefix policy's documented
// parameters, and the proxy's limits.
func DefaultConfig() Config {
	d := discovery.DefaultOptions()
	return Config{
		Policy:        "prefix",
		ServiceScheme: "http",
		DNSResolvConf: "/etc/resolv.conf",
		DNSInterval:   discovery.DefaultDNSInterval,

		HealthInterval:      d.Health.Interval,
		HealthTimeout:       d.Health.Timeout,
		HealthFailThreshold: d.Health.FailThreshold,
		HealthRiseThreshold: d.Health.RiseThreshold,
		EjectFailures:       d.Passive.Failures,
		EjectCooldown:       d.Passive.Cooldown,
		EjectMaxCooldown:    d.Passive.MaxCooldown,
		ScrapeInterval:      d.Scrape.Interval,
		ModelsInterval:      5 * time.Second,
		ScrapeTimeout:       d.Scrape.Timeout,
		EndpointDrainLimit:  d.DrainLimit,

		Limits: Limits{
			MaxBodyBytes: 64 << 20,
			Retries:      2,
			// Dialing a pod on the cluster network takes milliseconds; 5 s
			// covers a node under pressure without holding a request long
			// on a dead address.
			ConnectTimeout: 5 * time.Second,
			// A non-streaming request answers only after the whole
			// generation.
			ResponseHeaderTimeout: 10 * time.Minute,
			// A healthy engine streams a token every few tens of ms; its
			// longest pause is recomputing a preempted sequence (a 100k-token
			// context at 2k tokens/s: 50 s). Twice that, then the stream is
			// presumed stalled (nginx's proxy_read_timeout is 60 s, Envoy's
			// stream idle timeout 5 min).
			StreamIdleTimeout:   2 * time.Minute,
			UpstreamIdleTimeout: discovery.EngineIdleTimeout,
			ClientIdleTimeout:   2 * time.Minute,
			MaxConnsPerEndpoint: 4096,
			// nginx's client_header_timeout and client_body_timeout.
			ClientHeaderTimeout: 60 * time.Second,
			ClientBodyTimeout:   60 * time.Second,
			// Bearer tokens and cookies of 8 KiB occur; nginx accepts up to
			// 4 × 8 KiB buffers, Envoy 60 KiB.
			MaxHeaderBytes: 16 << 10,
			// Llama 3.1's context; an engine's own limit may be lower, and
			// it answers longer prompts with the same error.
			MaxPromptTokens: 131072,
			// Envoy's retry budget: 20% of requests, at least 3 retries.
			RetryBudget:  0.2,
			MinRetries:   3,
			QueueTimeout: 5 * time.Second,
			MaxQueue:     1024,
		},
		PDProtocol: ProtocolVLLM,
		// A prefill leg answers once the prompt is computed: 128k tokens
		// at 20k tokens/s take 6.4 s, so a minute covers a long queue too.
		PrefillTimeout:  60 * time.Second,
		PDBootstrapPort: 8998, // SGLang's --disaggregation-bootstrap-port default
		AccessLog:       true,
		AccessLogSample: 1,
		OTLPSampleRatio: 1, // the OpenTelemetry SDK's default: every trace

		// Differences of whitespace, line endings or a BOM show in a
		// prompt's first lines: 2 blocks (≈ 500 tokens) cost ≈ 2 µs
		// (BenchmarkParse).
		NearMissBlocks: 2,

		// 1 KiB of rendering ≈ 256 tokens; 256 blocks cover ≈ 64k tokens.
		PrefixBlockBytes: 1024,
		PrefixMaxBlocks:  256,
		// An 8B model on one H100 caches ≈ 450k tokens: 1,760 blocks of
		// 256 tokens. A scraped KV capacity replaces it per endpoint.
		PrefixCapacityBlocks: 1760,
		PrefixMaxEntries:     4_000_000,
		PrefixTTL:            30 * time.Minute,
		Prefix:               routing.DefaultPrefixParams(),

		// vLLM publishes every engine step while it computes; an engine
		// sent requests and silent for 30 s has lost its publisher.
		KVEventsStaleAfter: 30 * time.Second,
		TokenizeRate:       50,
		KVEventsTiers:      true,
	}
}

func (c *Config) policies() map[string]routing.NewPolicy {
	if c.Policies == nil {
		return routing.Policies()
	}
	return c.Policies
}

// kvEvents reports whether c subscribes to engines' KV-cache events: a
// port to dial every endpoint at, a listener, or a static backend naming
// its publisher (#kv-events=PORT).
func (c *Config) kvEvents() bool {
	if c.KVEventsPort > 0 || c.KVEventsListen != "" {
		return true
	}
	for _, urls := range [][]string{c.Backends, c.PrefillBackends, c.DecodeBackends} {
		for _, u := range urls {
			if strings.Contains(u, "kv-events=") {
				return true
			}
		}
	}
	return false
}

// Validate reports every problem of c at once, naming the flags.
func (c *Config) Validate() error {
	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	mixed, prefill, decode := len(c.Backends) > 0 || c.Service != "", len(c.PrefillBackends) > 0 || c.PrefillService != "",
		len(c.DecodeBackends) > 0 || c.DecodeService != ""
	switch {
	case prefill && !decode:
		bad("a prefill pool needs a decode pool (--decode-service or --decode-backends) to hand its KV to")
	case !mixed && !decode:
		bad("no backends: set --service (a headless Service) or --backends (e.g. --backends http://10.0.0.7:8000,http://10.0.0.8:8000), or a decode pool (--decode-service or --decode-backends) with a prefill pool")
	case decode && !prefill && c.PDProtocol == ProtocolSGLang:
		bad("--pd-protocol sglang: a decode pool needs a prefill pool (--prefill-service or --prefill-backends); an SGLang decode engine cannot compute a prompt alone")
	}
	if c.PDProtocol != ProtocolVLLM && c.PDProtocol != ProtocolSGLang {
		bad("--pd-protocol %q: want vllm or sglang", c.PDProtocol)
	}
	if c.PDMinUncachedTokens < 0 || c.PDBootstrapPort < 1 || c.PDBootstrapPort > 65535 || c.PrefillTimeout < 0 {
		bad("--pd-min-uncached-tokens and --prefill-timeout must not be negative, --pd-bootstrap-port must be in [1, 65535]")
	}
	for _, l := range []struct {
		name string
		urls []string
	}{{"--backends", c.Backends}, {"--prefill-backends", c.PrefillBackends}, {"--decode-backends", c.DecodeBackends}} {
		for _, b := range l.urls {
			if _, err := discovery.NewEndpoint(b, discovery.RoleMixed); err != nil {
				bad("%s: %v", l.name, err)
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
	if _, ok := c.policies()[c.Policy]; !ok {
		bad("--policy %q: want one of %s", c.Policy, strings.Join(routing.PolicyNames(c.policies()), ", "))
	}
	if c.HealthFailThreshold < 1 || c.HealthRiseThreshold < 1 || c.EjectFailures < 0 {
		bad("--health-fail-threshold and --health-rise-threshold must be at least 1, --eject-failures not negative")
	}
	if c.MaxBodyBytes <= 0 {
		bad("--max-body-bytes must be positive, got %d", c.MaxBodyBytes)
	}
	if c.Retries < 0 || c.Retries > 10 {
		bad("--retries must be in [0, 10], got %d", c.Retries)
	}
	if c.MaxConnsPerEndpoint <= 0 {
		bad("--max-conns-per-endpoint must be positive, got %d", c.MaxConnsPerEndpoint)
	}
	if c.MaxHeaderBytes < 1024 || c.MaxPromptTokens < 1 || c.MaxQueue < 0 || c.MaxInFlightPerEndpoint < 0 || c.MinRetries < 0 {
		bad("--max-header-bytes must be at least 1024, --max-prompt-tokens positive, --max-queue, --max-in-flight-per-endpoint and --min-retries not negative")
	}
	if c.RetryBudget < 0 || c.RetryBudget > 1 {
		bad("--retry-budget must be in [0, 1], got %g", c.RetryBudget)
	}
	if c.PrefixBlockBytes < 16 || c.PrefixMaxBlocks < 1 || c.PrefixCapacityBlocks < 1 || c.PrefixMaxEntries < 1 {
		bad("--prefix-block-bytes must be at least 16 and --prefix-max-blocks, --prefix-capacity-blocks, --prefix-max-entries positive")
	}
	if err := c.Prefix.Validate(); err != nil {
		bad("prefix policy: %v", err)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"--connect-timeout", c.ConnectTimeout}, {"--response-header-timeout", c.ResponseHeaderTimeout},
		{"--stream-idle-timeout", c.StreamIdleTimeout}, {"--upstream-idle-timeout", c.UpstreamIdleTimeout},
		{"--client-idle-timeout", c.ClientIdleTimeout}, {"--dns-interval", c.DNSInterval},
		{"--client-header-timeout", c.ClientHeaderTimeout}, {"--client-body-timeout", c.ClientBodyTimeout},
		{"--queue-timeout", c.QueueTimeout},
		{"--health-interval", c.HealthInterval}, {"--health-timeout", c.HealthTimeout},
		{"--eject-cooldown", c.EjectCooldown}, {"--eject-max-cooldown", c.EjectMaxCooldown},
		{"--scrape-interval", c.ScrapeInterval}, {"--scrape-timeout", c.ScrapeTimeout},
		{"--endpoint-drain-limit", c.EndpointDrainLimit}, {"--prefix-ttl", c.PrefixTTL}, {"--models-interval", c.ModelsInterval},
		{"--shutdown-delay", c.ShutdownDelay},
	} {
		if d.v < 0 {
			bad("%s must not be negative, got %s", d.name, d.v)
		}
	}
	if c.UpstreamIdleTimeout == 0 {
		bad("--upstream-idle-timeout must be positive")
	}
	if c.NearMissBlocks < 0 || c.NearMissBlocks > c.PrefixMaxBlocks {
		bad("--near-miss-blocks must be between 0 and --prefix-max-blocks (%d), got %d", c.PrefixMaxBlocks, c.NearMissBlocks)
	}
	for _, r := range []struct {
		name string
		v    float64
	}{{"--access-log-sample", c.AccessLogSample}, {"--otlp-sample-ratio", c.OTLPSampleRatio}} {
		if !(r.v >= 0 && r.v <= 1) {
			bad("%s must be between 0 and 1, got %v", r.name, r.v)
		}
	}
	if c.KVEventsPort < 0 || c.KVEventsPort > 65535 || c.KVEventsReplayPort < 0 || c.KVEventsReplayPort > 65535 {
		bad("--kv-events-port and --kv-events-replay-port must be in [0, 65535]")
	}
	if c.KVEventsListen != "" {
		if _, _, err := net.SplitHostPort(c.KVEventsListen); err != nil {
			bad("--kv-events-listen %q: want host:port", c.KVEventsListen)
		}
	}
	if !(c.TokenizeRate > 0) || c.KVEventsStaleAfter < 0 {
		bad("--tokenize-rate must be positive and --kv-events-stale-after not negative")
	}
	if c.OTLPEndpoint != "" {
		if _, err := otlpURL(c.OTLPEndpoint); err != nil {
			bad("--otlp-endpoint: %v", err)
		}
	}
	return errors.Join(errs...)
}

// Router is one running kvroute: discovery over the pools, the policy, the
// proxy server and the collectors of its Prometheus registry. Build it
// with NewRouter and run it with Run; main and the benchmark both do.
type Router struct {
	cfg      Config
	logger   *zap.Logger
	Server   *Server
	Fleet    *discovery.Fleet
	Pool     *discovery.Pool
	Picker   routing.Picker
	Prefix   *routing.Prefix // the prefix policy, nil under another policy
	Registry *prometheus.Registry
	tracing  *sdktrace.TracerProvider // nil without --otlp-endpoint
	truth    *engineTruth             // nil without KV events
}

// NewRouter validates cfg and builds the router; it starts nothing. logger
// receives the access log and discovery's events (nil: none).
func NewRouter(cfg Config, logger *zap.Logger) (*Router, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = zap.NewNop()
	}
	pick := cfg.policies()[cfg.Policy](routing.PolicyConfig{
		BlockBytes: cfg.PrefixBlockBytes,
		Index: prefix.IndexConfig{BlocksPerEndpoint: cfg.PrefixCapacityBlocks,
			MaxEntries: cfg.PrefixMaxEntries, TTL: cfg.PrefixTTL},
		Prefix: cfg.Prefix,
		Intn:   cfg.Intn,
	})
	r := &Router{cfg: cfg, logger: logger, Picker: pick, Registry: prometheus.NewRegistry()}
	r.Prefix, _ = pick.(*routing.Prefix)
	fleet, err := newFleet(&cfg, logger, r.Prefix)
	if err != nil {
		return nil, err
	}
	r.Fleet, r.Pool = fleet, fleet.Pool()
	r.Registry.MustRegister(collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), fleet)
	m := metrics.New(r.Registry, Classes, func(yield func(metrics.EndpointSample)) {
		for _, e := range r.Pool.Load().Endpoints {
			s := metrics.EndpointSample{URL: e.URL, Role: e.Role.String(),
				InFlight: e.InFlight(), PendingPrefill: e.PendingPrefill(), Requests: e.Requests(), Failures: e.Failures.Load(), KVUsage: -1}
			if st := e.Engine(); st != nil {
				s.KVUsage = st.KVUsage
			}
			if c := e.Costs(); c != nil {
				s.Costs = &metrics.CostsSample{PrefillTokensPerSec: c.PrefillTokensPerSec, LoadTokensPerSec: c.LoadTokensPerSec, FixedSec: c.FixedSec,
					DecodeStepSec: c.DecodeStepSec, DecodeSec: c.DecodeSec, BatchLimit: c.BatchLimit,
					TTFTSamples: c.TTFTSamples, DecodeSamples: c.DecodeSamples, StepSamples: c.StepSamples,
					LimitSamples: c.LimitSamples}
			}
			yield(s)
		}
	})
	opt := Options{Limits: cfg.Limits, Picker: pick, Pool: r.Pool, Metrics: m, Logger: logger,
		AccessLog: cfg.AccessLog, AccessLogSkip: 1 - cfg.AccessLogSample, NearMissBlocks: cfg.NearMissBlocks,
		NormalizePrompts: cfg.NormalizePrompts, AdminToken: cfg.AdminToken, BlockSize: cfg.PrefixBlockBytes, MaxBlocks: cfg.PrefixMaxBlocks,
		PD: PDOptions{Protocol: cfg.PDProtocol, PrefillTimeout: cfg.PrefillTimeout, BootstrapPort: cfg.PDBootstrapPort,
			TrustClientKV: cfg.TrustClientKVParams,
			Decider: routing.PDDecider{MinUncachedTokens: cfg.PDMinUncachedTokens, Params: func() routing.PrefixParams {
				if r.Prefix != nil {
					return r.Prefix.Params()
				}
				return cfg.Prefix
			}, BlockTokens: func() int {
				bpt := 4.0
				if r.Prefix != nil {
					bpt = r.Prefix.BytesPerToken()
				}
				return int(float64(cfg.PrefixBlockBytes) / bpt)
			}}}}
	if r.Prefix != nil {
		opt.Learner = r.Prefix
		metrics.RegisterIndex(r.Registry, func() metrics.IndexSample {
			s := r.Prefix.Index().Stats()
			return metrics.IndexSample{Endpoints: s.Endpoints, Hashes: s.Hashes, Entries: s.Entries,
				Bytes: s.Bytes, Evictions: s.Evictions, Expiries: s.Expiries, Homes: r.Prefix.Homes(), Foreign: r.Prefix.Foreign()}
		})
	}
	if cfg.kvEvents() {
		if r.Prefix == nil {
			return nil, fmt.Errorf("--kv-events-port and --kv-events-listen feed the prefix index: they need --policy prefix, not %q", cfg.Policy)
		}
		r.truth = newEngineTruth(&cfg, r.Pool, r.Prefix.Index(), logger)
		opt.Tokenizer = r.truth.tok
		metrics.RegisterKVEvents(r.Registry, r.truth.sample)
	}
	if cfg.OTLPEndpoint != "" {
		if r.tracing, err = newTracerProvider(cfg.OTLPEndpoint, cfg.OTLPSampleRatio, cfg.Version); err != nil {
			return nil, err
		}
		opt.Tracer = r.tracing.Tracer("github.com/kvroute/kvroute/proxy")
	}
	metrics.RegisterBuildInfo(r.Registry, cfg.Version, cfg.Revision, runtime.Version())
	r.Server = New(opt)
	return r, nil
}

// newFleet builds discovery from cfg: static lists and DNS sources per
// pool, health probes, passive ejection and engine scraping. A prefix
// policy (pfx, may be nil) forgets endpoints that leave or whose engine
// restarts, and sizes an endpoint's index LRU from its scraped KV capacity.
func newFleet(cfg *Config, logger *zap.Logger, pfx *routing.Prefix) (*discovery.Fleet, error) {
	o := discovery.Options{
		Logger: logger.Named("discovery"),
		Health: discovery.HealthConfig{Disabled: cfg.HealthInterval == 0, Interval: cfg.HealthInterval,
			Timeout: cfg.HealthTimeout, FailThreshold: cfg.HealthFailThreshold, RiseThreshold: cfg.HealthRiseThreshold},
		Passive: discovery.PassiveConfig{Disabled: cfg.EjectFailures == 0, Failures: cfg.EjectFailures,
			Cooldown: cfg.EjectCooldown, MaxCooldown: cfg.EjectMaxCooldown},
		Scrape:     discovery.ScrapeConfig{Disabled: cfg.ScrapeInterval == 0, Interval: cfg.ScrapeInterval, Timeout: cfg.ScrapeTimeout},
		Models:     discovery.ModelsConfig{Disabled: cfg.ModelsInterval == 0, Interval: cfg.ModelsInterval, Timeout: cfg.HealthTimeout},
		DrainLimit: cfg.EndpointDrainLimit,
		// The prefix policy's prefill rate is the calibration's prior.
		Calibration: discovery.CalibrationConfig{PrefillTokensPerSec: cfg.Prefix.PrefillTokensPerSec},
	}
	if pfx != nil {
		pfx.Follow(&o)
	}
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

// AdminHandler returns the admin listener's handler: /metrics, /livez,
// /readyz, /debug/pprof/, /debug/endpoints and, under the prefix policy,
// /debug/route and /debug/prefix/params.
func (r *Router) AdminHandler() http.Handler {
	mux := r.Server.AdminHandler(r.Registry)
	mux.HandleFunc("GET /debug/endpoints", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		eps := r.Fleet.Endpoints()
		if r.truth == nil {
			_ = enc.Encode(eps)
			return
		}
		type withTruth struct {
			discovery.EndpointStatus
			KVEvents endpointTruth `json:"kv_events"`
		}
		byURL := make(map[string]*discovery.Endpoint)
		for _, e := range r.Pool.Load().Endpoints {
			byURL[e.URL] = e
		}
		out := make([]withTruth, len(eps))
		for i, s := range eps {
			out[i].EndpointStatus = s
			if e := byURL[s.URL]; e != nil {
				out[i].KVEvents = r.truth.status(e)
			} else {
				out[i].KVEvents.Source = "learned"
			}
		}
		_ = enc.Encode(out)
	})
	if r.Prefix != nil {
		r.Server.HandleExplain(mux, r.Prefix)
		r.Server.HandleParams(mux, r.Prefix)
	}
	return mux
}

// Run serves the API on api and, when admin is not nil, the admin handler
// on admin, with discovery running beside them, until ctx is done or a
// listener fails. Then it drains: /readyz turns 503, in-flight requests and
// streams get drainTimeout to finish, and discovery (health, draining of
// endpoints) keeps running until they have. Run closes both listeners.
func (r *Router) Run(ctx context.Context, api, admin net.Listener, drainTimeout time.Duration) error {
	fctx, stopFleet := context.WithCancel(context.Background())
	defer stopFleet()
	fleetDone := make(chan struct{})
	go func() { defer close(fleetDone); _ = r.Fleet.Run(fctx) }()
	defer func() { stopFleet(); <-fleetDone }()
	if r.truth != nil {
		truthDone := make(chan struct{})
		go func() { defer close(truthDone); r.truth.run(fctx) }()
		defer func() { stopFleet(); <-truthDone }()
	}

	errc := make(chan error, 2)
	go func() { errc <- r.Server.Serve(api) }()
	var adminSrv *http.Server
	adminAddr := "none"
	if admin != nil {
		adminAddr = admin.Addr().String()
		adminSrv = &http.Server{Handler: r.AdminHandler(), ReadHeaderTimeout: 10 * time.Second}
		go func() {
			if err := adminSrv.Serve(admin); !errors.Is(err, http.ErrServerClosed) {
				errc <- err
			}
		}()
	}
	r.logger.Info("kvroute serving", zap.String("listen", api.Addr().String()), zap.String("admin", adminAddr),
		zap.String("policy", r.cfg.Policy),
		zap.Int("endpoints", r.Pool.Load().Len()), zap.String("service", r.cfg.Service))

	var err error
	select {
	case err = <-errc:
		err = fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
		if d := r.cfg.ShutdownDelay; d > 0 {
			// Load balancers see /readyz fail and stop sending; until then
			// new connections are still served (with Connection: close).
			r.Server.Drain()
			r.logger.Info("shutting down: still accepting", zap.Duration("delay", d))
			select {
			case err = <-errc:
				err = fmt.Errorf("serve: %w", err)
			case <-time.After(d):
			}
		}
	}
	r.logger.Info("draining", zap.Duration("timeout", drainTimeout))
	dctx, cancel := context.WithTimeout(context.Background(), drainTimeout)
	defer cancel()
	if derr := r.Server.Shutdown(dctx); derr != nil {
		r.logger.Warn("drain incomplete", zap.Error(derr))
	}
	if adminSrv != nil {
		_ = adminSrv.Shutdown(dctx)
	}
	if r.tracing != nil {
		tctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if terr := r.tracing.Shutdown(tctx); terr != nil { // exports the spans still queued
			r.logger.Warn("exporting the last spans failed", zap.Error(terr))
		}
		cancel()
	}
	r.logger.Info("stopped")
	return err
}
