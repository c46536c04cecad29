package app

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/kvevents"
	"github.com/kvroute/kvroute/metrics"
	"github.com/kvroute/kvroute/peers"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/proxy"
	"github.com/kvroute/kvroute/routing"
)

// Router is one running kvroute: discovery over the pools, the policy, the
// proxy server and the collectors of its Prometheus registry. Build it
// with New and run it with Run; main and the benchmark both do.
type Router struct {
	cfg      Config
	logger   *zap.Logger
	Server   *proxy.Server
	Fleet    *discovery.Fleet
	Pool     *discovery.Pool
	Picker   routing.Picker
	Prefix   *routing.Prefix // the prefix policy, nil under another policy
	Registry *prometheus.Registry
	tracing  *sdktrace.TracerProvider // nil without --otlp-endpoint
	truth    *kvevents.EngineTruth    // nil without KV events
	// Mesh is the replicas' gossip, nil without --peers.
	Mesh *peers.Mesh
	// budgets is the --tenant-budgets file's content in force at start.
	budgets []byte
}

// budgetsPoll is how often the --tenant-budgets file is read for changes
// (a Kubernetes ConfigMap's update reaches the pod within a minute or so).
const budgetsPoll = 5 * time.Second

// loadBudgets reads the --tenant-budgets file, if any.
func loadBudgets(path string) (*proxy.Budgets, []byte, error) {
	if path == "" {
		return nil, nil, nil
	}
	return proxy.LoadBudgets(path)
}

// accessLogTo is where the access log goes: nowhere when it is off.
func accessLogTo(cfg *Config) io.Writer {
	if !cfg.AccessLog {
		return nil
	}
	return cfg.AccessLogTo
}

// New validates cfg and builds the router; it starts nothing. logger
// receives the access log and discovery's events (nil: none).
func New(cfg Config, logger *zap.Logger) (*Router, error) {
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
	m := metrics.New(r.Registry, proxy.Classes, func(yield func(metrics.EndpointSample)) {
		for _, e := range r.Pool.Load().Endpoints {
			s := metrics.EndpointSample{URL: e.URL, Role: e.Role.String(),
				InFlight: e.InFlight(), PendingPrefill: e.PendingPrefill(), Requests: e.Requests(), Failures: e.Failures.Load(), KVUsage: -1,
				PeerInFlight: -1}
			if r.Mesh != nil {
				s.PeerInFlight = e.PeerInFlight()
			}
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
	opt := proxy.Options{Limits: cfg.Limits, Tenants: cfg.Tenants, Picker: pick, Pool: r.Pool, Metrics: m, Logger: logger,
		AccessLog: accessLogTo(&cfg), AccessLogConsole: cfg.AccessLogConsole, AccessLogSkip: 1 - cfg.AccessLogSample, NearMissBlocks: cfg.NearMissBlocks,
		NormalizePrompts: cfg.NormalizePrompts, AdminToken: cfg.AdminToken, BlockSize: cfg.PrefixBlockBytes, MaxBlocks: cfg.PrefixMaxBlocks,
		PD: proxy.PDOptions{Protocol: cfg.PDProtocol, PrefillTimeout: cfg.PrefillTimeout, BootstrapPort: cfg.PDBootstrapPort,
			Disaggregated: len(cfg.DecodeBackends) > 0 || cfg.DecodeService != "",
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
		opt.Learner, opt.Cached, opt.Warm, opt.Holding = r.Prefix, r.Prefix.CachedTokens, r.Prefix.WarmRoom, r.Prefix.Holding
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
		r.truth = kvevents.NewEngineTruth(cfg.engineTruth(), r.Pool, r.Prefix.Index(), logger)
		opt.Tokenizer = r.truth.Tokenizer()
		metrics.RegisterKVEvents(r.Registry, r.truth.Sample)
	}
	if cfg.gossipOn() {
		if r.Prefix == nil {
			return nil, fmt.Errorf("--peers and --peers-service share the prefix index between router replicas: they need --policy prefix, not %q", cfg.Policy)
		}
		if r.Mesh, err = r.newMesh(logger); err != nil {
			return nil, err
		}
		opt.Ready, opt.Peers = r.Mesh.Ready, r.Mesh.Members
	}
	if cfg.OTLPEndpoint != "" {
		if r.tracing, err = newTracerProvider(cfg.OTLPEndpoint, cfg.OTLPSampleRatio, cfg.Version); err != nil {
			return nil, err
		}
		opt.Tracer = r.tracing.Tracer("github.com/kvroute/kvroute/proxy")
	}
	if opt.Budgets, r.budgets, err = loadBudgets(cfg.BudgetsFile); err != nil {
		return nil, err
	}
	metrics.RegisterBuildInfo(r.Registry, cfg.Version, cfg.Revision, runtime.Version())
	r.Server = proxy.New(opt)
	return r, nil
}

// newMesh builds the replicas' gossip (--peers): peers' placements on the
// router's endpoints merge into its prefix index, its own picks go out to
// them, so do the links its engine truth learns, and its figures are
// exported.
func (r *Router) newMesh(logger *zap.Logger) (*peers.Mesh, error) {
	var keys [][]byte
	if f := r.cfg.GossipKeyFile; f != "" {
		var err error
		if keys, err = peers.ReadKeys(f); err != nil {
			return nil, err
		}
	}
	pc := r.cfg.gossip(keys)
	if r.cfg.PeersService != "" {
		res, err := r.cfg.peersResolver()
		if err != nil {
			return nil, err
		}
		pc.Lookup = res.Lookup
	}
	pc.Known = func(id uint64) bool {
		return slices.ContainsFunc(r.Pool.Load().Endpoints, func(e *discovery.Endpoint) bool { return e.ID == id })
	}
	idx := r.Prefix.Index()
	pc.Export, pc.Import = idx.Export, idx.Import
	pc.ExportHomes, pc.ImportHomes = r.Prefix.ExportHomes, r.Prefix.ImportHomes
	pc.Record = func(id uint64, hashes []uint64) {
		eps := r.Pool.Load().Endpoints
		if i := slices.IndexFunc(eps, func(e *discovery.Endpoint) bool { return e.ID == id }); i >= 0 {
			r.Prefix.PeerPlaced(eps[i], hashes)
			return
		}
		idx.Record(id, hashes)
	}
	if !r.cfg.GossipNoLoad {
		pc.Load = func(yield func(id uint64, n int64)) {
			for _, e := range r.Pool.Load().Endpoints {
				yield(e.ID, e.InFlight())
			}
		}
		pc.SetLoad = func(id uint64, n int64) {
			eps := r.Pool.Load().Endpoints
			if i := slices.IndexFunc(eps, func(e *discovery.Endpoint) bool { return e.ID == id }); i >= 0 {
				fell := n < eps[i].PeerInFlight()
				eps[i].SetPeerInFlight(n)
				if fell && r.Server != nil {
					r.Server.Freed()
				}
			}
		}
	}
	if r.truth != nil {
		pc.Links = r.truth.PeerLinked
	}
	pc.Sequences, pc.Outcomes = r.Prefix.PeerSequenced, r.Prefix.PeerOutcome
	pc.Logger = logger.Named("peers")
	m, err := peers.New(pc)
	if err != nil {
		return nil, err
	}
	if r.truth != nil {
		r.truth.OnLinked(m.Linked)
	}
	r.Prefix.OnPlaced(m.Placed)
	r.Prefix.OnSequenced(m.Sequenced)
	r.Prefix.OnOutcome(m.Outcome)
	r.Prefix.Meshed(m.Shared, m.Members, m.Rank, m.Echo)
	metrics.RegisterPeers(r.Registry, func() metrics.PeersSample {
		s := m.Stats()
		return metrics.PeersSample{Members: s.Members, SentMessages: s.SentMessages, SentBytes: s.SentBytes,
			ReceivedMessages: s.ReceivedMessages, ReceivedBytes: s.ReceivedBytes,
			Merged: s.Merged, Unknown: s.Unknown, Mismatched: s.Mismatched, Dropped: s.Dropped, BadFormat: s.DecodeErrors,
			States: s.States, Imported: s.Imported, ImportedHomes: s.ImportedHomes, Links: s.Links}
	})
	return m, nil
}

// newFleet builds discovery from cfg: static lists and DNS sources per
// pool, health probes, passive ejection and engine scraping. A prefix
// policy (pfx, may be nil) forgets endpoints that leave or whose engine
// restarts, and sizes an endpoint's index LRU from its scraped KV capacity.
func newFleet(cfg *Config, logger *zap.Logger, pfx *routing.Prefix) (*discovery.Fleet, error) {
	o := discovery.Options{
		Logger: logger.Named("discovery"),
		Health: discovery.HealthConfig{Disabled: cfg.HealthInterval == 0, Interval: cfg.HealthInterval,
			Timeout: cfg.HealthTimeout, FailThreshold: cfg.HealthFailThreshold, RiseThreshold: cfg.HealthRiseThreshold,
			Path: cfg.HealthPath},
		Passive: discovery.PassiveConfig{Disabled: cfg.EjectFailures == 0, Failures: cfg.EjectFailures,
			Cooldown: cfg.EjectCooldown, MaxCooldown: cfg.EjectMaxCooldown},
		Scrape:     discovery.ScrapeConfig{Disabled: cfg.ScrapeInterval == 0, Interval: cfg.ScrapeInterval, Timeout: cfg.ScrapeTimeout},
		Models:     discovery.ModelsConfig{Disabled: cfg.ModelsInterval == 0, Interval: cfg.ModelsInterval, Timeout: cfg.HealthTimeout},
		DrainLimit: cfg.EndpointDrainLimit,
		// The prefix policy's prefill rate is the calibration's prior.
		Calibration: discovery.CalibrationConfig{PrefillTokensPerSec: cfg.Prefix.PrefillTokensPerSec},
	}
	o.Dialect, _ = discovery.ParseDialect(cfg.EngineDialect) // validated
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
// /debug/route and /debug/prefix/params; with --peers, /debug/peers.
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
			KVEvents kvevents.EndpointTruth `json:"kv_events"`
		}
		byURL := make(map[string]*discovery.Endpoint)
		for _, e := range r.Pool.Load().Endpoints {
			byURL[e.URL] = e
		}
		out := make([]withTruth, len(eps))
		for i, s := range eps {
			out[i].EndpointStatus = s
			if e := byURL[s.URL]; e != nil {
				out[i].KVEvents = r.truth.Status(e)
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
	if r.Mesh != nil {
		mux.HandleFunc("GET /debug/peers", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			enc := json.NewEncoder(w)
			enc.SetIndent("", "  ")
			_ = enc.Encode(r.Mesh.Status())
		})
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
		go func() { defer close(truthDone); r.truth.Run(fctx) }()
		defer func() { stopFleet(); <-truthDone }()
	}

	errc := make(chan error, 3)
	if r.Mesh != nil {
		meshDone := make(chan struct{})
		go func() {
			defer close(meshDone)
			if err := r.Mesh.Run(fctx); err != nil {
				select {
				case errc <- err:
				default:
				}
			}
		}()
		defer func() { stopFleet(); <-meshDone }()
	}
	if f := r.cfg.BudgetsFile; f != "" {
		go r.Server.WatchBudgets(fctx, f, budgetsPoll, r.budgets)
	}
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
