package discovery

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Sentinel errors of the Fleet; returned errors wrap them.
var (
	// ErrBadConfig is returned by New and the Add methods for an unusable
	// configuration.
	ErrBadConfig = errors.New("discovery: bad configuration")
	// ErrRunning is returned by the Add methods and Run once Run started.
	ErrRunning = errors.New("discovery: fleet already running")
)

// Options configure a Fleet. A zero field takes the documented default;
// DefaultOptions returns them all, for flags.
type Options struct {
	// Logger receives state changes (endpoint down, up, ejected, returned,
	// removed; DNS and scrape outages, each logged once per outage). nil
	// means no logging.
	Logger *zap.Logger
	// Health configures active health probes (/health; Ollama's
	// /api/version).
	Health HealthConfig
	// Passive configures ejection on failures the proxy reports.
	Passive PassiveConfig
	// Scrape configures the engines' /metrics scraping.
	Scrape ScrapeConfig
	// Models configures the reading of the endpoints' /v1/models.
	Models ModelsConfig
	// Calibration configures the learning of every endpoint's Costs.
	Calibration CalibrationConfig
	// Dialect pins every endpoint's engine dialect (--engine-dialect);
	// DialectUnknown (the default, "auto") detects each endpoint's.
	Dialect Dialect
	// DrainLimit is the longest an endpoint that left the Set keeps
	// draining with requests still in flight before it is dropped anyway
	// (a stream that never ends must not keep a gone pod forever).
	// Default 10 minutes, above vLLM's longest practical generation.
	DrainLimit time.Duration

	// OnRemove is called once for every endpoint dropped after draining
	// (so the prefix index forgets it), from a Fleet goroutine, one call at
	// a time. It must be quick and must not call back into the Fleet.
	OnRemove func(*Endpoint)
	// OnRestart is called when a scrape shows the engine restarted (a new
	// process start time, or a cumulative counter that went down): its KV
	// cache is empty. Called from a scraper goroutine, possibly
	// concurrently for different endpoints.
	OnRestart func(*Endpoint)
	// OnCapacity is called with the engine's KV-cache capacity in tokens
	// (Σ block_size × num_gpu_blocks over its engines) when a scrape first
	// shows it and whenever it changes. Called like OnRestart.
	OnCapacity func(e *Endpoint, tokens int)
}

// DefaultDrainLimit is Options.DrainLimit's default.
const DefaultDrainLimit = 10 * time.Minute

// EngineIdleTimeout is how long an idle keep-alive connection to an engine
// is kept: below uvicorn's default 5 s keep-alive (vLLM's and SGLang's HTTP
// servers run on uvicorn), so the client side closes an idle connection
// before the engine closes it under a request being written.
const EngineIdleTimeout = 4 * time.Second

// DefaultOptions returns the defaults of every field (hooks and logger nil;
// Scrape.StaleAfter 0, which follows Scrape.Interval).
func DefaultOptions() Options {
	o := Options{
		Health:     HealthConfig{}.withDefaults(),
		Passive:    PassiveConfig{}.withDefaults(),
		Scrape:     ScrapeConfig{}.withDefaults(),
		DrainLimit: DefaultDrainLimit,
	}
	o.Scrape.StaleAfter = 0
	return o
}

// Fleet keeps a Pool's Set current from its sources (static lists and
// headless-Service DNS, one per role or several), drains the endpoints that
// leave, detects every endpoint's engine dialect and probes its liveness,
// ejects endpoints the proxy reports failing and scrapes the engines'
// /metrics. Sources are added
// before Run; Run owns every goroutine and returns when its context ends.
// A Fleet is also a prometheus.Collector of its own metrics. Methods are
// safe for concurrent use.
type Fleet struct {
	o    Options
	log  *zap.Logger
	pool Pool
	// sources is guarded by pool.mu, so that merging the lists and
	// publishing the result is one step.
	sources []*source
	// running is guarded by pool.mu.
	running bool
	// ejectMu guards every endpoint's ejection bookkeeping and serialises
	// ejection decisions (the ejected-fraction cap counts the others).
	ejectMu sync.Mutex
	client  *http.Client
	m       *fleetMetrics
	// costs pools the endpoints' measured costs per role (roleIndex), the
	// fallback of an endpoint not measured yet.
	costs [3]*fleetCosts
	// ramp takes the endpoints whose slow start asks for a scrape now
	// (rampScrape); nil when scraping is off.
	ramp chan *Endpoint

	// reapEvery and reapGrace pace the reaping of drained endpoints:
	// every second, an endpoint idle and draining for at least a second.
	reapEvery, reapGrace time.Duration
	// redetectEvery bounds re-detection after a 404 probe (dialect.go's
	// redetectEvery; tests shorten it).
	redetectEvery time.Duration
	// trace, when set before Run, is told about events (tests only).
	trace func(event string, e *Endpoint)
}

// source is one static list or DNS name feeding the Set.
type source struct {
	name string // the DNS service, or "static"
	role Role
	dns  *dnsSource // nil for a static list
	eps  []*Endpoint
	// lookups and failures are this source's DNS counters (nil for static).
	lookups, failures prometheus.Counter
}

// New returns a Fleet with an empty Pool. It starts no goroutine.
func New(o Options) (*Fleet, error) {
	o.Health = o.Health.withDefaults()
	o.Passive = o.Passive.withDefaults()
	o.Scrape = o.Scrape.withDefaults()
	o.Models = o.Models.withDefaults()
	o.Calibration = o.Calibration.withDefaults()
	if o.DrainLimit == 0 {
		o.DrainLimit = DefaultDrainLimit
	}
	if err := errors.Join(o.Health.validate(), o.Passive.validate(), o.Scrape.validate(), o.Models.validate()); err != nil {
		return nil, err
	}
	if o.DrainLimit < 0 {
		return nil, fmt.Errorf("%w: drain limit must not be negative", ErrBadConfig)
	}
	log := o.Logger
	if log == nil {
		log = zap.NewNop()
	}
	dial := &net.Dialer{Timeout: max(o.Health.Timeout, o.Scrape.Timeout), KeepAlive: 30 * time.Second}
	tr := &http.Transport{
		DialContext:         dial.DialContext,
		MaxIdleConnsPerHost: 2,
		IdleConnTimeout:     EngineIdleTimeout,
		DisableCompression:  true, // spare the engines gzip; /metrics is ~50 KB
		ForceAttemptHTTP2:   false,
	}
	var ramp chan *Endpoint
	if !o.Scrape.Disabled {
		ramp = make(chan *Endpoint, 64)
	}
	return &Fleet{
		o: o, log: log, ramp: ramp,
		client:    &http.Client{Transport: tr, CheckRedirect: noRedirect},
		m:         newFleetMetrics(),
		costs:     [3]*fleetCosts{newFleetCosts(), newFleetCosts(), newFleetCosts()},
		reapEvery: time.Second, reapGrace: time.Second, redetectEvery: redetectEvery,
	}, nil
}

func noRedirect(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

// Pool returns the Pool the Fleet publishes to. The proxy Loads it once per
// request; nothing else may Publish to it.
func (f *Fleet) Pool() *Pool { return &f.pool }

// AddStatic adds a fixed list of base URLs (as accepted by NewEndpoint)
// with the given role and publishes them at once. It must be called before
// Run.
func (f *Fleet) AddStatic(role Role, urls []string) error {
	eps := make([]*Endpoint, 0, len(urls))
	var errs []error
	for _, u := range urls {
		e, err := NewEndpoint(u, role)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		eps = append(eps, e)
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	src := &source{name: "static", role: role}
	if err := f.addSource(src); err != nil {
		return err
	}
	f.update(src, eps)
	return nil
}

// AddDNS adds a headless-Service DNS source (see DNSConfig). It reads the
// resolver configuration now, so a bad spec or file fails here; the first
// lookup happens when Run starts. It must be called before Run.
func (f *Fleet) AddDNS(c DNSConfig) error {
	d, err := newDNSSource(c)
	if err != nil {
		return err
	}
	src := &source{name: c.Service, role: c.Role, dns: d,
		lookups:  f.m.dnsLookups.WithLabelValues(c.Service),
		failures: f.m.dnsFailures.WithLabelValues(c.Service)}
	return f.addSource(src)
}

func (f *Fleet) addSource(src *source) error {
	f.pool.mu.Lock()
	defer f.pool.mu.Unlock()
	if f.running {
		return ErrRunning
	}
	f.sources = append(f.sources, src)
	return nil
}

// update replaces src's list with eps and publishes the merged Set, unless
// the list did not change.
func (f *Fleet) update(src *source, eps []*Endpoint) {
	slices.SortFunc(eps, func(a, b *Endpoint) int { return strings.Compare(a.URL, b.URL) })
	eps = slices.CompactFunc(eps, func(a, b *Endpoint) bool { return a.URL == b.URL })
	f.pool.mu.Lock()
	if src.eps != nil && slices.EqualFunc(src.eps, eps, func(a, b *Endpoint) bool { return a.URL == b.URL }) {
		f.pool.mu.Unlock()
		return
	}
	if eps == nil {
		eps = []*Endpoint{}
	}
	src.eps = eps
	var all []*Endpoint
	for _, s := range f.sources {
		all = append(all, s.eps...)
	}
	for _, e := range all {
		if e.owner == nil { // never published: no reader yet
			e.owner = f
			if f.o.Dialect != DialectUnknown {
				e.SetDialect(f.o.Dialect)
			}
			if !f.o.Calibration.Disabled {
				e.calib = newCalibrator(f.o.Calibration, &e.costs, f.costs[roleIndex(e.Role)])
			}
		}
	}
	set := f.pool.publishLocked(all)
	f.pool.mu.Unlock()
	f.log.Info("endpoints published", zap.String("source", src.name), zap.Stringer("role", src.role),
		zap.Int("source_endpoints", len(eps)), zap.Int("endpoints", set.Len()), zap.Uint64("version", set.Version))
	f.event("publish", nil)
	f.reap(time.Now())
}

// Run resolves the DNS sources, probes, scrapes and reaps drained
// endpoints until ctx is done, then waits for its goroutines and returns
// nil. It may be called once.
func (f *Fleet) Run(ctx context.Context) error {
	f.pool.mu.Lock()
	if f.running {
		f.pool.mu.Unlock()
		return ErrRunning
	}
	f.running = true
	srcs := slices.Clone(f.sources)
	f.pool.mu.Unlock()

	var wg sync.WaitGroup
	for _, s := range srcs {
		if s.dns != nil {
			wg.Go(func() { f.runDNS(ctx, s) })
		}
	}
	if !f.o.Health.Disabled {
		wg.Go(func() { f.runLoop(ctx, f.proberLoop()) })
	}
	if !f.o.Scrape.Disabled {
		wg.Go(func() { f.runLoop(ctx, f.scraperLoop()) })
	}
	if !f.o.Models.Disabled {
		wg.Go(func() { f.runLoop(ctx, f.modelsLoop()) })
	}
	wg.Go(func() {
		t := time.NewTicker(f.reapEvery)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case now := <-t.C:
				f.reap(now)
			}
		}
	})
	wg.Wait()
	f.client.CloseIdleConnections()
	return nil
}

// reap drops the drained endpoints and fires OnRemove for each.
func (f *Fleet) reap(now time.Time) {
	for _, e := range f.pool.reap(now, f.reapGrace, f.o.DrainLimit) {
		if n := e.InFlight(); n > 0 {
			f.log.Warn("endpoint dropped with requests in flight after the drain limit",
				zap.String("endpoint", e.URL), zap.Int64("in_flight", n), zap.Duration("limit", f.o.DrainLimit))
		} else {
			f.log.Info("endpoint removed after draining", zap.String("endpoint", e.URL), zap.Stringer("role", e.Role))
		}
		if c := e.calib; c != nil && c.fleet != nil {
			c.fleet.forget(c)
		}
		if f.o.OnRemove != nil {
			f.o.OnRemove(e)
		}
		f.event("remove", e)
	}
}

// runDNS resolves one DNS source every interval, sooner when the records'
// TTL is shorter, and publishes each result. A failed lookup keeps the last
// good list; retries back off from MinInterval to Interval.
func (f *Fleet) runDNS(ctx context.Context, s *source) {
	d := s.dns
	var failing int
	backoff := d.cfg.MinInterval
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		eps, ttl, err := d.resolve(ctx)
		s.lookups.Inc()
		var wait time.Duration
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			s.failures.Inc()
			if failing == 0 {
				f.log.Warn("DNS lookup failed; keeping the last good endpoints",
					zap.String("service", s.name), zap.Error(err))
			}
			failing++
			f.event("dns-error", nil)
			wait = min(backoff, d.cfg.Interval)
			backoff *= 2
		} else {
			if failing > 0 {
				f.log.Info("DNS lookup recovered", zap.String("service", s.name), zap.Int("failed_lookups", failing))
				failing = 0
			}
			backoff = d.cfg.MinInterval
			f.update(s, eps)
			f.event("dns-ok", nil)
			wait = min(d.cfg.Interval, max(ttl, d.cfg.MinInterval))
		}
		t.Reset(wait)
	}
}

// event reports to the test trace, if any.
func (f *Fleet) event(ev string, e *Endpoint) {
	if f.trace != nil {
		f.trace(ev, e)
	}
}
