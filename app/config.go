package app

import (
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/kvevents"
	"github.com/kvroute/kvroute/peers"
	"github.com/kvroute/kvroute/proxy"
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
	// EngineDialect pins every endpoint's engine dialect (vllm, sglang,
	// llamacpp, ollama); "auto" detects each endpoint's. HealthPath, when
	// set, is every endpoint's probe path instead of its dialect's.
	EngineDialect string
	HealthPath    string

	proxy.Limits
	// Tenants: who asks (a hash of the API key or of TenantHeader) and how
	// urgently (service_tier, or PriorityHeader).
	Tenants proxy.TenantOptions
	// BudgetsFile, when set, is the tenants' budgets (proxy/budgets.go),
	// read at start and reloaded when it changes.
	BudgetsFile string
	// Prefill/decode disaggregation (with a decode pool).
	PDProtocol          string
	PDMinUncachedTokens int
	PrefillTimeout      time.Duration
	PDBootstrapPort     int
	TrustClientKVParams bool

	AccessLog bool
	// AccessLogTo is where the access log's lines go, in zap's production
	// layout (JSON, or console with AccessLogConsole); main sets it to its
	// logger's output when the logger writes Info lines. Nil: no access
	// log.
	AccessLogTo      io.Writer
	AccessLogConsole bool
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

	// Gossip between router replicas (the prefix policy, package peers):
	// on when Peers names other replicas' gossip addresses, or
	// PeersService a headless Service of kvroute's pods (NAME[:PORT],
	// resolved like Service, port 7946 by default). It listens
	// on GossipListen (advertised as GossipAdvertise when set), encrypted
	// with GossipKeyFile's keys (required off loopback); a replica is
	// not ready until it has met a peer or GossipSyncTimeout has passed.
	Peers             []string
	PeersService      string
	GossipListen      string
	GossipAdvertise   string
	GossipKeyFile     string
	GossipSyncTimeout time.Duration
	// GossipName is this replica's member name ("": the host name and a
	// random suffix). Not a flag: the benchmark names its replicas.
	GossipName string
	// GossipNoLoad keeps the replicas' requests in flight out of the
	// gossip (placements and state only). Not a flag: the benchmark
	// measures what sharing the load does.
	GossipNoLoad bool

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
		EngineDialect:       "auto",
		ScrapeTimeout:       d.Scrape.Timeout,
		EndpointDrainLimit:  d.DrainLimit,

		Limits:     proxy.DefaultLimits(),
		Tenants:    proxy.DefaultTenantOptions(),
		PDProtocol: proxy.ProtocolVLLM,
		// A prefill leg answers once the prompt is computed: 128k tokens
		// at 20k tokens/s take 6.4 s, so a minute covers a long queue too.
		PrefillTimeout:  60 * time.Second,
		PDBootstrapPort: 8998, // SGLang's --disaggregation-bootstrap-port default
		AccessLog:       true,
		AccessLogSample: 1,
		OTLPSampleRatio: 1, // the OpenTelemetry SDK's default: every trace

		// Differences of whitespace, line endings or a BOM show in a
		// prompt's first lines: 2 blocks, ≈ 500 tokens (their cost:
		// BENCHMARKS.md, "Measurements behind the code").
		NearMissBlocks: 2,

		PrefixBlockBytes: proxy.DefaultBlockBytes,
		PrefixMaxBlocks:  proxy.DefaultMaxBlocks,
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

		GossipListen:      ":7946", // memberlist's port
		GossipSyncTimeout: 10 * time.Second,
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

// engineTruth is engine truth's configuration from c's KV-event flags.
func (c *Config) engineTruth() kvevents.EngineTruthConfig {
	return kvevents.EngineTruthConfig{
		Events:     kvevents.Config{Port: c.KVEventsPort, ReplayPort: c.KVEventsReplayPort, Listen: c.KVEventsListen},
		BlockBytes: c.PrefixBlockBytes, Tokenizer: kvevents.TokenizerConfig{Rate: c.TokenizeRate},
		StaleAfter: c.KVEventsStaleAfter, Tiers: c.KVEventsTiers,
	}
}

// Validate reports every problem of c at once, naming the flags.
func (c *Config) Validate() error {
	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	c.validatePools(bad)
	c.validateLimits(bad)
	c.validateDurations(bad)
	c.validateOther(bad)
	return errors.Join(errs...)
}

// validatePools checks the pools, their discovery and the PD settings;
// bad collects the errors.
func (c *Config) validatePools(bad func(string, ...any)) {
	mixed, prefill, decode := len(c.Backends) > 0 || c.Service != "", len(c.PrefillBackends) > 0 || c.PrefillService != "",
		len(c.DecodeBackends) > 0 || c.DecodeService != ""
	switch {
	case prefill && !decode:
		bad("a prefill pool needs a decode pool (--decode-service or --decode-backends) to hand its KV to")
	case !mixed && !decode:
		bad("no backends: set --service (a headless Service) or --backends (e.g. --backends http://10.0.0.7:8000,http://10.0.0.8:8000), or a decode pool (--decode-service or --decode-backends) with a prefill pool")
	case decode && !prefill && c.PDProtocol == proxy.ProtocolSGLang:
		bad("--pd-protocol sglang: a decode pool needs a prefill pool (--prefill-service or --prefill-backends); an SGLang decode engine cannot compute a prompt alone")
	}
	if c.PDProtocol != proxy.ProtocolVLLM && c.PDProtocol != proxy.ProtocolSGLang {
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
}

// validateLimits checks the policy, health and the request and prefix
// limits.
func (c *Config) validateLimits(bad func(string, ...any)) {
	if _, ok := c.policies()[c.Policy]; !ok {
		bad("--policy %q: want one of %s", c.Policy, strings.Join(routing.PolicyNames(c.policies()), ", "))
	}
	if c.HealthFailThreshold < 1 || c.HealthRiseThreshold < 1 || c.EjectFailures < 0 {
		bad("--health-fail-threshold and --health-rise-threshold must be at least 1, --eject-failures not negative")
	}
	if _, err := discovery.ParseDialect(c.EngineDialect); err != nil {
		bad("--engine-dialect %q: want auto, vllm, sglang, llamacpp or ollama", c.EngineDialect)
	}
	if c.HealthPath != "" && c.HealthPath[0] != '/' {
		bad("--health-path %q must start with /", c.HealthPath)
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
	if c.MaxHeaderBytes < 1024 || c.MaxPromptTokens < 1 || c.MaxQueue < 0 || c.Tenants.MaxQueue < 0 || c.Tenants.Reserve < 0 || c.MaxInFlightPerEndpoint < 0 || c.MinRetries < 0 || c.MaxMigrations < 0 {
		bad("--max-header-bytes must be at least 1024, --max-prompt-tokens positive, --max-queue, --max-queue-per-tenant, --tenant-reserve, --max-in-flight-per-endpoint, --min-retries and --max-migrations not negative")
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
}

// validateDurations checks that no timeout or interval is negative.
func (c *Config) validateDurations(bad func(string, ...any)) {
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
		{"--shutdown-delay", c.ShutdownDelay}, {"--gossip-sync-timeout", c.GossipSyncTimeout},
	} {
		if d.v < 0 {
			bad("%s must not be negative, got %s", d.name, d.v)
		}
	}
	if c.UpstreamIdleTimeout == 0 {
		bad("--upstream-idle-timeout must be positive")
	}
}

// validateOther checks the near-miss detector, the sampling ratios, the
// KV events and tracing.
func (c *Config) validateOther(bad func(string, ...any)) {
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
		if _, err := kvevents.ParseEndpoint(c.KVEventsListen); err != nil {
			bad("--kv-events-listen: %v", err)
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
	c.validateGossip(bad)
}

// validateGossip checks the replicas' gossip: the key file, the
// addresses, and no plaintext gossip off loopback.
func (c *Config) validateGossip(bad func(string, ...any)) {
	if !c.gossipOn() {
		return
	}
	if c.PeersService != "" {
		if err := discovery.CheckService(c.PeersService); err != nil {
			bad("--peers-service: %v", err)
		}
	}
	var keys [][]byte
	if c.GossipKeyFile != "" {
		var err error
		if keys, err = peers.ReadKeys(c.GossipKeyFile); err != nil {
			bad("--gossip-key-file: %v", err)
			return
		}
	}
	if err := peers.Check(c.gossip(keys)); err != nil {
		bad("--peers, --gossip-listen, --gossip-advertise: %v", err)
	}
}

// gossipOn reports whether the replicas gossip (--peers or
// --peers-service).
func (c *Config) gossipOn() bool { return len(c.Peers) > 0 || c.PeersService != "" }

// peersResolver is the lookup of --peers-service, with the DNS settings
// of --service.
func (c *Config) peersResolver() (*discovery.Resolver, error) {
	return discovery.NewResolver(discovery.DNSConfig{Service: c.PeersService, ResolvConf: c.DNSResolvConf, Server: c.DNSServer},
		peers.DefaultPort)
}

// gossip is the replicas' gossip configuration from c, with keys (the
// index hooks are the router's).
func (c *Config) gossip(keys [][]byte) peers.Config {
	return peers.Config{Name: c.GossipName, Listen: c.GossipListen, Advertise: c.GossipAdvertise, Seeds: c.Peers, Keys: keys,
		Fingerprint: peers.Fingerprint(c.PrefixBlockBytes, c.NormalizePrompts, proxy.HashVersion), SyncTimeout: c.GossipSyncTimeout}
}
