package discovery

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// EndpointStatus is one endpoint as introspection shows it (GET
// /debug/endpoints). Durations are in seconds.
type EndpointStatus struct {
	// Models are the endpoint's served models and adapters, as its
	// /v1/models last listed them (absent: not known, every model
	// presumed served).
	Models []string `json:"models,omitempty"`
	URL    string   `json:"url"`
	Role   string   `json:"role"`
	State  State    `json:"state"`
	// Routable is what policies see: false when down, ejected or draining.
	Routable        bool  `json:"routable"`
	InFlight        int64 `json:"in_flight"`
	InFlightPrefill int64 `json:"in_flight_prefill_tokens"`
	// PeerInFlight is the other router replicas' requests in flight
	// (their gossip; omitted without).
	PeerInFlight int64 `json:"peer_in_flight,omitempty"`
	// PeerPrefill is the prompt tokens the replicas' placements here are
	// taken to be still computing (their gossip; until a predicted time).
	PeerPrefill int64 `json:"peer_prefill_tokens,omitempty"`
	// UnheardPrefill is the prompt tokens the replicas most likely sent
	// here in the last 20 ms and have not told yet (AddUnheardPrefill).
	UnheardPrefill int64 `json:"unheard_prefill_tokens,omitempty"`
	// RoomLimit is the known load at which the engine has no room (its
	// batch limit, or the slow start's; 0: none), HasRoom whether it has
	// room now, and Full whether it answered 429 at the load it still
	// has (backpressure, room.go).
	RoomLimit int64  `json:"room_limit"`
	HasRoom   bool   `json:"has_room"`
	Full      bool   `json:"full,omitempty"`
	Requests  uint64 `json:"requests"`
	Failures  uint64 `json:"failures"`
	// ProbeFailures and ProbeSuccesses are the current runs of consecutive
	// probe results.
	ProbeFailures  int32 `json:"consecutive_probe_failures"`
	ProbeSuccesses int32 `json:"consecutive_probe_successes"`
	// ConsecutiveFailures is the current run of failures the proxy reported.
	ConsecutiveFailures int32 `json:"consecutive_failures"`
	// Ejections is the ejections in a row (the cooldown doubles with each);
	// CooldownSec is the current or last ejection's cooldown and
	// EjectedForSec what remains of it.
	Ejections     int     `json:"ejections_in_a_row,omitempty"`
	CooldownSec   float64 `json:"cooldown_sec,omitempty"`
	EjectedForSec float64 `json:"ejected_for_sec,omitempty"`
	// DrainingSec is how long the endpoint has been draining.
	DrainingSec float64 `json:"draining_sec,omitempty"`
	// Dialect is the engine's dialect, detected or pinned ("unknown"
	// until told).
	Dialect Dialect `json:"dialect"`
	// Info is what the engine said of itself (slots, context; see
	// EngineInfo); absent when nothing.
	Info *EngineInfo `json:"engine_info,omitempty"`
	// Metrics is whether the engine's /metrics is read: "scraped" (a
	// scrape succeeded), "absent" (404, 405 or 501: Ollama, llama-server
	// without --metrics; the router's own counts stand alone) or
	// "unknown".
	Metrics string `json:"metrics"`
	// Engine is the latest successful scrape, fresh or not; nil if none.
	Engine *EngineStatus `json:"engine,omitempty"`
	// Learned is what calibration has measured of the endpoint; nil if
	// nothing yet.
	Learned *Costs `json:"learned,omitempty"`
}

// EngineStatus is the latest scrape of an endpoint with its age.
type EngineStatus struct {
	EngineStats
	AgeSec float64 `json:"age_sec"`
	// Fresh is whether routing uses the values (Endpoint.Engine non-nil).
	Fresh bool `json:"fresh"`
}

// Endpoints returns every endpoint of the current Set, then the draining
// ones, with their state, counters and latest engine metrics.
func (f *Fleet) Endpoints() []EndpointStatus {
	now := time.Now()
	set := f.pool.Load()
	draining := f.pool.drainingList()
	out := make([]EndpointStatus, 0, set.Len()+len(draining))
	for _, e := range set.Endpoints {
		out = append(out, f.status(e, now))
	}
	for _, d := range draining {
		s := f.status(d.e, now)
		s.DrainingSec = now.Sub(d.since).Seconds()
		out = append(out, s)
	}
	return out
}

// status reads e's state at now.
func (f *Fleet) status(e *Endpoint, now time.Time) EndpointStatus {
	s := EndpointStatus{
		URL: e.URL, Role: e.Role.String(), State: e.State(), Routable: e.Routable(),
		InFlight: e.InFlight(), InFlightPrefill: e.PendingPrefill(), PeerInFlight: e.PeerInFlight(), PeerPrefill: e.PeerPrefill(), UnheardPrefill: e.UnheardPrefill(),
		RoomLimit: e.roomLimit(), HasRoom: e.HasRoom(), Full: e.Full(),
		Requests: e.Requests(), Failures: e.Failures.Load(),
		ProbeFailures: e.probeFails.Load(), ProbeSuccesses: e.probeOKs.Load(),
		ConsecutiveFailures: e.passiveFails.Load(), Learned: e.Costs(),
		Dialect: e.Dialect(), Info: e.Info(), Metrics: "unknown",
	}
	switch {
	case e.noMetricsUntil.Load() != 0 || e.Dialect() == DialectOllama:
		s.Metrics = "absent"
	case e.last.Load() != nil:
		s.Metrics = "scraped"
	}
	f.ejectMu.Lock()
	s.Ejections, s.CooldownSec = e.ejectLevel, e.cooldown.Seconds()
	if e.flags.Load()&flagEjected != 0 {
		s.EjectedForSec = max(e.ejectedUntil.Sub(now).Seconds(), 0)
	}
	f.ejectMu.Unlock()
	if st := e.last.Load(); st != nil {
		s.Engine = &EngineStatus{EngineStats: *st, AgeSec: st.Age(now).Seconds(), Fresh: e.fresh.Load() == st}
	}
	if m := e.Models(); m != nil {
		for _, x := range m.List {
			s.Models = append(s.Models, x.ID)
		}
	}
	return s
}

// fleetMetrics are the Fleet's Prometheus metrics; per-role children are
// resolved once, here.
type fleetMetrics struct {
	dnsLookups, dnsFailures *prometheus.CounterVec
	probeFailuresVec        *prometheus.CounterVec
	ejectionsVec            *prometheus.CounterVec
	scrapeFailuresVec       *prometheus.CounterVec
	restartsVec             *prometheus.CounterVec
	scrapeDurationVec       *prometheus.HistogramVec
	endpoints               *prometheus.Desc
	dialects                *prometheus.Desc

	probeFailures, ejections, scrapeFailures, restarts [3]prometheus.Counter
	scrapeDuration                                     [3]prometheus.Observer
}

// metricPrefix is kvroute's metric namespace and this package's subsystem.
const metricPrefix = "kvroute_discovery_"

func newFleetMetrics() *fleetMetrics {
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: metricPrefix + name, Help: help}, labels)
	}
	m := &fleetMetrics{
		dnsLookups:        counter("dns_lookups_total", "DNS lookups of a service (each may send several queries).", "service"),
		dnsFailures:       counter("dns_failures_total", "DNS lookups that failed; the last good endpoints were kept.", "service"),
		probeFailuresVec:  counter("probe_failures_total", "Failed /health probes.", "pool"),
		ejectionsVec:      counter("ejections_total", "Endpoints ejected after consecutive failures reported by the proxy.", "pool"),
		scrapeFailuresVec: counter("scrape_failures_total", "Failed engine /metrics scrapes.", "pool"),
		restartsVec:       counter("engine_restarts_total", "Engine restarts seen by scraping.", "pool"),
		scrapeDurationVec: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: metricPrefix + "scrape_duration_seconds", Help: "Time to fetch and parse one engine /metrics.",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
		}, []string{"pool"}),
		endpoints: prometheus.NewDesc(metricPrefix+"endpoints",
			"Endpoints by pool (role) and state (up, down, ejected, draining).", []string{"pool", "state"}, nil),
		dialects: prometheus.NewDesc(metricPrefix+"endpoint_dialects",
			"Endpoints of the current set by engine dialect (vllm, sglang, llamacpp, ollama, unknown).", []string{"dialect"}, nil),
	}
	for r := range 3 {
		pool := roleOfIndex(r).String()
		m.probeFailures[r] = m.probeFailuresVec.WithLabelValues(pool)
		m.ejections[r] = m.ejectionsVec.WithLabelValues(pool)
		m.scrapeFailures[r] = m.scrapeFailuresVec.WithLabelValues(pool)
		m.restarts[r] = m.restartsVec.WithLabelValues(pool)
		m.scrapeDuration[r] = m.scrapeDurationVec.WithLabelValues(pool)
	}
	return m
}

func (m *fleetMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.dnsLookups, m.dnsFailures, m.probeFailuresVec, m.ejectionsVec,
		m.scrapeFailuresVec, m.restartsVec, m.scrapeDurationVec}
}

// Describe implements prometheus.Collector.
func (f *Fleet) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range f.m.collectors() {
		c.Describe(ch)
	}
	ch <- f.m.endpoints
	ch <- f.m.dialects
}

// Collect implements prometheus.Collector: the counters, and the endpoint
// gauge counted from the current Set and the draining list.
func (f *Fleet) Collect(ch chan<- prometheus.Metric) {
	for _, c := range f.m.collectors() {
		c.Collect(ch)
	}
	var n [3][4]int // role × state
	var d [len(dialectNames)]int
	for _, e := range f.pool.Load().Endpoints {
		n[roleIndex(e.Role)][e.State()]++
		if x := e.Dialect(); int(x) < len(d) {
			d[x]++
		}
	}
	for x, c := range d {
		ch <- prometheus.MustNewConstMetric(f.m.dialects, prometheus.GaugeValue, float64(c), Dialect(x).String())
	}
	for _, e := range f.pool.Draining() {
		n[roleIndex(e.Role)][StateDraining]++
	}
	for r := range n {
		for s := range n[r] {
			ch <- prometheus.MustNewConstMetric(f.m.endpoints, prometheus.GaugeValue, float64(n[r][s]),
				roleOfIndex(r).String(), State(s).String())
		}
	}
}

// roleOfIndex inverts roleIndex.
func roleOfIndex(i int) Role {
	switch i {
	case 1:
		return RolePrefill
	case 2:
		return RoleDecode
	default:
		return RoleMixed
	}
}
