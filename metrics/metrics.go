package metrics

import (
	"strconv"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// Namespace prefixes kvroute's own metrics; the llm_router_* names are the
// conventional names docs/operations.md ("Metrics") lists beside them.
const Namespace = "kvroute"

// latencyBuckets span 100 µs (a router hop on loopback) to 10 min (a long
// generation), roughly ×2.5 apart.
var latencyBuckets = []float64{
	0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
	0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600,
}

// EndpointSample is one endpoint's live state, read at scrape time.
type EndpointSample struct {
	URL, Role string
	InFlight  int64
	// PendingPrefill is the prompt tokens of the router's in-flight
	// requests that the endpoint has not answered yet.
	PendingPrefill     int64
	Requests, Failures uint64
	// PeerInFlight is the other router replicas' requests in flight at
	// the endpoint (their gossip); negative without gossip (not exported).
	PeerInFlight int64
	// KVUsage is the engine's scraped KV-cache usage (0–1); negative when
	// not freshly scraped.
	KVUsage float64
	// Costs are the endpoint's learned costs; nil before any observation.
	Costs *CostsSample
}

// CostsSample is what an endpoint's calibration has learned (see
// discovery.Costs); zero values are reported only once measured.
type CostsSample struct {
	PrefillTokensPerSec, LoadTokensPerSec, FixedSec, DecodeStepSec, DecodeSec float64
	BatchLimit                                                                int
	TTFTSamples, DecodeSamples, StepSamples, LimitSamples                     int
}

// Metrics is the set of kvroute's collectors. Safe for concurrent use.
type Metrics struct {
	classes []string
	tenants tenantMetrics

	requests      *prometheus.CounterVec
	duration      *prometheus.HistogramVec
	ttfb          *prometheus.HistogramVec
	inFlight      prometheus.Gauge
	upstreamErrs  *prometheus.CounterVec
	retries       prometheus.Counter
	retryDenied   prometheus.Counter
	cancelled     prometheus.Counter
	queued        prometheus.Gauge
	overloaded    prometheus.Counter
	durationByCls []prometheus.Observer
	ttfbByCls     []prometheus.Observer

	decisions     *prometheus.CounterVec
	decisionCache sync.Map // reason string → prometheus.Counter (label children, resolved once)
	hitTokens     prometheus.Counter
	promptTokens  prometheus.Counter
	estTokens     prometheus.Counter
	engineTokens  prometheus.Counter
	estOver       prometheus.Counter
	estUnder      prometheus.Counter
	estExact      prometheus.Counter

	reqCache   sync.Map // reqKey → prometheus.Counter
	modelsMu   sync.RWMutex
	models     map[string]string // model names an endpoint accepted → their label value
	chunkGap   prometheus.Observer
	migrations *prometheus.CounterVec
	holds      *prometheus.CounterVec
	migrGap    prometheus.Observer
	logDropped prometheus.Counter
	nearMisses *prometheus.CounterVec
	rewrites   prometheus.Counter

	e2e          prometheus.Observer
	pdDecisions  *prometheus.CounterVec
	pdCache      sync.Map // decision → prometheus.Counter
	pdStranded   *prometheus.CounterVec
	prefillLeg   prometheus.Observer
	prefillQueue prometheus.Observer
	handoff      prometheus.Observer
	decodeTTFB   prometheus.Observer
}

type reqKey struct {
	class, code int
	model       string
}

// MaxModels bounds the model label: the first MaxModels model names that
// an endpoint answered with a success are labelled by name; any other
// name is "other", and a request without one (or that kvroute refused
// before reading it) is "none". Clients choose the names, so only the
// engines' acceptance admits one.
const MaxModels = 32

// New registers kvroute's collectors on reg. classes are the path classes
// (label "class"), addressed by index in the recording methods. endpoints,
// when non-nil, is called at each scrape to report per-endpoint state; it
// must call yield once per endpoint.
func New(reg prometheus.Registerer, classes []string, endpoints func(yield func(EndpointSample))) *Metrics {
	m := &Metrics{
		classes: classes,
		models:  map[string]string{},
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "requests_total",
			Help: "Requests answered, by path class, HTTP status (499: the client went away) and model (the first 32 names an endpoint served; other, none).",
		}, []string{"class", "code", "model"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: Namespace, Name: "request_duration_seconds",
			Help:    "Time from reading the request to the end of the response body, by path class.",
			Buckets: latencyBuckets,
		}, []string{"class"}),
		ttfb: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: Namespace, Name: "time_to_first_byte_seconds",
			Help:    "Time from reading the request to the first response body byte from the endpoint, by path class.",
			Buckets: latencyBuckets,
		}, []string{"class"}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: Namespace, Name: "in_flight_requests",
			Help: "Requests being proxied now.",
		}),
		upstreamErrs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "upstream_errors_total",
			Help: "Failed upstream attempts, by kind: connect (refused, reset, failed write), timeout, status (a 5xx, 429 or 503 answer), busy (no free connection), cancelled (the client left), body (cut mid-answer), prefill (a failed prefill leg).",
		}, []string{"kind"}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: Namespace, Name: "retries_total",
			Help: "Requests re-sent to another endpoint before the first response byte.",
		}),
		retryDenied: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: Namespace, Name: "retries_budget_exhausted_total",
			Help: "Retries not made because the retry budget (a share of recent requests) was spent.",
		}),
		cancelled: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: Namespace, Name: "upstream_cancellations_total",
			Help: "Upstream requests cancelled because their client left before the answer ended.",
		}),
		queued: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: Namespace, Name: "queued_requests",
			Help: "Requests waiting in kvroute because every eligible endpoint was saturated.",
		}),
		overloaded: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: Namespace, Name: "overload_rejections_total",
			Help: "Requests answered 429 because every eligible endpoint stayed saturated past the queue timeout, or the queue was full.",
		}),
		logDropped: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: Namespace, Name: "access_log_dropped_lines_total",
			Help: "Access-log lines dropped because the log's output fell behind (more than 4 MiB of lines waiting).",
		}),
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "routing_decisions_total",
			Help: "Routing decisions by reason (warm, spill, cold, or the basic policy's name).",
		}, []string{"reason"}),
		hitTokens: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "llm_router_cache_hit_total",
			Help: "Prompt tokens the router expected the chosen endpoint to have cached (router-estimated).",
		}),
		promptTokens: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: Namespace, Name: "routed_prompt_tokens_total",
			Help: "Prompt tokens of routed inference requests, as the policy estimated them (rendering bytes over bytes per token).",
		}),
		estTokens: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: Namespace, Name: "prefix_estimated_cached_tokens_total",
			Help: "Cached prompt tokens the router estimated, over requests whose engine reported cached_tokens.",
		}),
		engineTokens: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: Namespace, Name: "prefix_engine_cached_tokens_total",
			Help: "Cached prompt tokens the engines reported (usage.prompt_tokens_details.cached_tokens).",
		}),
	}
	m.registerFamilies(reg)
	for _, c := range classes {
		m.durationByCls = append(m.durationByCls, m.duration.WithLabelValues(c))
		m.ttfbByCls = append(m.ttfbByCls, m.ttfb.WithLabelValues(c))
	}
	hitRatio := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "llm_router_cache_hit_ratio",
		Help: "llm_router_cache_hit_total / kvroute_routed_prompt_tokens_total since start (router-estimated).",
	}, func() float64 {
		p := readCounter(m.promptTokens)
		if p == 0 {
			return 0
		}
		return readCounter(m.hitTokens) / p
	})
	reg.MustRegister(m.requests, m.duration, m.ttfb, m.inFlight, m.upstreamErrs, m.retries,
		m.retryDenied, m.cancelled, m.queued, m.overloaded, m.logDropped, m.decisions, m.hitTokens, m.promptTokens, hitRatio)
	if endpoints != nil {
		reg.MustRegister(&endpointCollector{each: endpoints})
	}
	return m
}

// registerFamilies registers the families beyond New's own: prompts,
// streams, disaggregation and tenants; and starts every known label value
// of the upstream errors at 0.
func (m *Metrics) registerFamilies(reg prometheus.Registerer) {
	// Every known label value starts at 0, so that rate() and alerts see
	// the series before the first failure.
	for _, k := range []string{"connect", "dropped", "timeout", "status", "busy", "full", "cancelled", "body", "prefill"} {
		m.upstreamErrs.WithLabelValues(k)
	}
	m.registerPrompts(reg)
	m.registerStreams(reg)
	m.registerPD(reg)
	m.registerTenants(reg)
}

// registerPrompts registers the families about prompts and the router's
// estimates of their cached tokens: near misses, normalisations, and the
// estimates against the engines' reports.
func (m *Metrics) registerPrompts(reg prometheus.Registerer) {
	m.nearMisses = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "prompt_near_misses_total",
		Help: "Prompts whose first blocks were seen before with the same text up to whitespace, line endings or a byte-order mark, but other bytes: the engine recomputes them. By model.",
	}, []string{"model"})
	m.nearMisses.WithLabelValues("none") // the family is exported before the first near miss
	m.rewrites = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: Namespace, Name: "prompt_normalizations_total",
		Help: "Requests whose prompts --normalize-prompts rewrote (line endings, trailing blanks, byte-order marks outside code blocks).",
	})
	reg.MustRegister(m.nearMisses, m.rewrites)
	est := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "prefix_estimates_total",
		Help: "Router estimates of cached tokens against the engine's report: exact (within 256 tokens), over, under.",
	}, []string{"outcome"})
	m.estExact, m.estOver, m.estUnder = est.WithLabelValues("exact"), est.WithLabelValues("over"), est.WithLabelValues("under")
	reg.MustRegister(m.estTokens, m.engineTokens, est)
}

// Request records one answered request of class index class for model
// (the body's "model", empty when none).
func (m *Metrics) Request(class, code int, model []byte, seconds float64) {
	k := reqKey{class, code, m.modelLabel(model, code < 400)}
	c, ok := m.reqCache.Load(k)
	if !ok {
		c, _ = m.reqCache.LoadOrStore(k, m.requests.WithLabelValues(m.classes[class], strconv.Itoa(code), k.model))
	}
	c.(prometheus.Counter).Inc()
	m.durationByCls[class].Observe(seconds)
}

// modelLabel returns the model label of a request for model (see
// MaxModels); admit lets a name not labelled yet in, while there is room
// (an endpoint served the request).
func (m *Metrics) modelLabel(model []byte, admit bool) string {
	if len(model) == 0 {
		return "none"
	}
	m.modelsMu.RLock()
	l, ok := m.models[string(model)]
	n := len(m.models)
	m.modelsMu.RUnlock()
	switch {
	case ok:
		return l
	case !admit || n >= MaxModels:
		return "other"
	}
	m.modelsMu.Lock()
	defer m.modelsMu.Unlock()
	if l, ok := m.models[string(model)]; ok {
		return l
	}
	if len(m.models) >= MaxModels {
		return "other"
	}
	l = string(model)
	m.models[l] = l
	return l
}

// NearMiss counts a prompt whose normalised prefix was seen before with
// other bytes (see prefix.Normalizer), by model.
func (m *Metrics) NearMiss(model []byte) {
	m.nearMisses.WithLabelValues(m.modelLabel(model, false)).Inc()
}

// PromptRewrite counts a request whose prompts --normalize-prompts
// rewrote.
func (m *Metrics) PromptRewrite() { m.rewrites.Inc() }

// ChunkGap records the time between two chunks of a streamed answer as
// the router received them: the engine's inter-token gaps, batched by its
// stream interval, plus the network.
func (m *Metrics) ChunkGap(seconds float64) { m.chunkGap.Observe(seconds) }

// Migration counts a streamed answer whose endpoint failed mid-stream, by
// cause and outcome.
func (m *Metrics) Migration(cause, outcome string) {
	m.migrations.WithLabelValues(cause, outcome).Inc()
}

// PromptHold counts one request held back for a busy copy of its prompt,
// by outcome (ended, timeout).
func (m *Metrics) PromptHold(outcome string) { m.holds.WithLabelValues(outcome).Inc() }

// MigrationGap records the time from a stream's failure to its
// continuation's first event written to the client.
func (m *Metrics) MigrationGap(seconds float64) { m.migrGap.Observe(seconds) }

// AccessLogDropped counts n access-log lines dropped.
func (m *Metrics) AccessLogDropped(n int) { m.logDropped.Add(float64(n)) }

// FirstByte records the time to the first response byte for class index class.
func (m *Metrics) FirstByte(class int, seconds float64) {
	m.ttfbByCls[class].Observe(seconds)
}

// InFlight adds d to the number of requests being proxied.
func (m *Metrics) InFlight(d float64) { m.inFlight.Add(d) }

// UpstreamError counts one failed upstream attempt of the given kind.
func (m *Metrics) UpstreamError(kind string) { m.upstreamErrs.WithLabelValues(kind).Inc() }

// Decision counts one routing decision: its reason, the request's prompt
// tokens and the tokens the chosen endpoint is believed to hold.
func (m *Metrics) Decision(reason string, promptTokens, cachedTokens int) {
	child(&m.decisionCache, m.decisions, reason).Inc()
	if promptTokens > 0 {
		m.promptTokens.Add(float64(promptTokens))
		m.hitTokens.Add(float64(cachedTokens))
	}
}

// child returns vec's counter for label, resolved once through cache (a
// bounded label set: a map lookup per request rather than hashing the
// label values).
func child(cache *sync.Map, vec *prometheus.CounterVec, label string) prometheus.Counter {
	c, ok := cache.Load(label)
	if !ok {
		c, _ = cache.LoadOrStore(label, vec.WithLabelValues(label))
	}
	return c.(prometheus.Counter)
}

// CacheReport compares the router's estimate of a request's cached prompt
// tokens with the engine's report.
func (m *Metrics) CacheReport(estimated, engine int) {
	m.estTokens.Add(float64(estimated))
	m.engineTokens.Add(float64(engine))
	switch d := estimated - engine; {
	case d > 256:
		m.estOver.Inc()
	case d < -256:
		m.estUnder.Inc()
	default:
		m.estExact.Inc()
	}
}

func readCounter(c prometheus.Counter) float64 {
	var d dto.Metric
	_ = c.Write(&d)
	return d.GetCounter().GetValue()
}

// IndexSample is the prefix index's size and counters, read at scrape time.
type IndexSample struct {
	Endpoints, Hashes, Entries, Bytes int
	Evictions, Expiries               uint64
	Homes                             int     // recurring prefix keys (homed by the balanced assignment)
	Foreign                           float64 // learned share of the engines' requests not this router's
}

// RegisterIndex reports the prefix index through read at each scrape.
func RegisterIndex(reg prometheus.Registerer, read func() IndexSample) {
	reg.MustRegister(&indexCollector{read: read})
}

var (
	descIndexEntries   = prometheus.NewDesc(Namespace+"_prefix_index_entries", "(block, endpoint) entries in the prefix index.", nil, nil)
	descIndexHashes    = prometheus.NewDesc(Namespace+"_prefix_index_blocks", "Distinct block hashes in the prefix index.", nil, nil)
	descIndexBytes     = prometheus.NewDesc(Namespace+"_prefix_index_bytes", "Estimated heap bytes of the prefix index.", nil, nil)
	descIndexEvictions = prometheus.NewDesc(Namespace+"_prefix_index_evictions_total", "Entries evicted by an endpoint's capacity.", nil, nil)
	descIndexExpiries  = prometheus.NewDesc(Namespace+"_prefix_index_expiries_total", "Blocks expired by the TTL.", nil, nil)
	descHomes          = prometheus.NewDesc(Namespace+"_prefix_homes", "Recurring prefix keys (seen at least twice within the TTL), homed by balanced rendezvous hashing.", nil, nil)
	descForeign        = prometheus.NewDesc(Namespace+"_prefix_foreign_share", "Learned share of the engines' running and waiting requests that are not this router's (other router replicas, clients bypassing kvroute); at 0.25 or more the prefix policy acts as one of several routers.", nil, nil)
)

type indexCollector struct{ read func() IndexSample }

func (c *indexCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descIndexEntries
	ch <- descIndexHashes
	ch <- descIndexBytes
	ch <- descIndexEvictions
	ch <- descIndexExpiries
	ch <- descHomes
	ch <- descForeign
}

func (c *indexCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.read()
	ch <- prometheus.MustNewConstMetric(descIndexEntries, prometheus.GaugeValue, float64(s.Entries))
	ch <- prometheus.MustNewConstMetric(descIndexHashes, prometheus.GaugeValue, float64(s.Hashes))
	ch <- prometheus.MustNewConstMetric(descIndexBytes, prometheus.GaugeValue, float64(s.Bytes))
	ch <- prometheus.MustNewConstMetric(descIndexEvictions, prometheus.CounterValue, float64(s.Evictions))
	ch <- prometheus.MustNewConstMetric(descIndexExpiries, prometheus.CounterValue, float64(s.Expiries))
	ch <- prometheus.MustNewConstMetric(descHomes, prometheus.GaugeValue, float64(s.Homes))
	ch <- prometheus.MustNewConstMetric(descForeign, prometheus.GaugeValue, s.Foreign)
}

// latencyHistogram registers a histogram of latencyBuckets on reg.
func latencyHistogram(reg prometheus.Registerer, name, help string) prometheus.Histogram {
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, Buckets: latencyBuckets})
	reg.MustRegister(h)
	return h
}

// registerStreams registers the collectors of streamed answers: the gaps
// between their writes and their mid-stream failovers.
func (m *Metrics) registerStreams(reg prometheus.Registerer) {
	hist := func(name, help string) prometheus.Histogram { return latencyHistogram(reg, name, help) }
	m.chunkGap = hist(Namespace+"_stream_chunk_gap_seconds",
		"Time between two successive writes of a streamed answer (server-sent events) to the client: the endpoint's gaps between tokens as the router forwarded them (events that arrived together leave in one write).")
	m.migrGap = hist(Namespace+"_migration_gap_seconds",
		"Streamed answers continued on another endpoint after theirs failed mid-stream: time from the failure to the continuation's first event written to the client.")
	m.migrations = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "migrations_total",
		Help: "Streamed answers whose endpoint failed mid-stream, by cause (cut: the connection failed or closed early; timeout: the stream-idle timeout; error: the engine sent an error event; drained: the endpoint left discovery or drains; preempted: the queue took its place back for a tenant below its share or a higher class) and outcome (continued on another endpoint; failed: the continuation could not start; not_continued: the answer could not be continued faithfully, or the migrations or the retry budget were spent).",
	}, []string{"cause", "outcome"})
	reg.MustRegister(m.migrations)
	m.holds = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "prompt_holds_total",
		Help: "Requests held back from a slot engine (llama.cpp, Ollama) whose slots keeping their prompt were all busy with this router's requests, rather than computing the prompt afresh in another slot, by outcome (ended: one of them ended; timeout: none ended within the prompt's cold prefill and a turn).",
	}, []string{"outcome"})
	reg.MustRegister(m.holds)
	for _, c := range []string{"cut", "timeout", "error", "drained", "preempted"} {
		for _, o := range []string{"continued", "failed", "not_continued"} {
			m.migrations.WithLabelValues(c, o)
		}
	}
}

// registerPD registers the end-to-end histogram and the collectors of
// prefill/decode disaggregation.
func (m *Metrics) registerPD(reg prometheus.Registerer) {
	hist := func(name, help string) prometheus.Histogram { return latencyHistogram(reg, name, help) }
	m.e2e = hist("llm_request_e2e_seconds",
		"Time from reading an inference request (completions, chat, responses) to the end of its response, every stage included.")
	m.prefillQueue = hist("llm_prefill_queue_seconds",
		"Disaggregated requests: time from reading the request to the prefill pod's answer (pick, the prefill pod's queue and prefill); the decode leg starts then.")
	m.prefillLeg = hist(Namespace+"_pd_prefill_leg_seconds",
		"Disaggregated requests: duration of each prefill leg, from sending it to its whole answer.")
	m.handoff = hist(Namespace+"_pd_handoff_to_first_byte_seconds",
		"Disaggregated requests: time from the prefill leg's answer to the decode leg's first body byte (KV transfer, decode queue, one step).")
	m.decodeTTFB = hist(Namespace+"_pd_decode_first_byte_seconds",
		"Disaggregated requests: time from sending the decode leg to its first body byte.")
	m.pdDecisions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "pd_decisions_total",
		Help: "Requests routed to a decode endpoint, by decision: disaggregated, decode_only (too few uncached tokens), single_only (vLLM protocol: several prompts or n>1), client_kv (a trusted client's own transfer parameters), or fallback_* (decode alone after no_prefill, prefill_failed, no_reference).",
	}, []string{"decision"})
	m.pdStranded = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "pd_stranded_prefills_total",
		Help: "Prefill legs that succeeded but whose decode never delivered (the prefill pod holds the KV until its timeout), by cause: decode_failed, client_gone, superseded.",
	}, []string{"cause"})
	for _, c := range []string{"decode_failed", "client_gone", "superseded"} {
		m.pdStranded.WithLabelValues(c)
	}
	reg.MustRegister(m.pdDecisions, m.pdStranded)
}

// RequestEnd records the end-to-end duration of an inference request.
func (m *Metrics) RequestEnd(seconds float64) { m.e2e.Observe(seconds) }

// PDDecision counts one disaggregation decision.
func (m *Metrics) PDDecision(decision string) { child(&m.pdCache, m.pdDecisions, decision).Inc() }

// PDStranded counts one prefill whose KV no decode leg used.
func (m *Metrics) PDStranded(cause string) { m.pdStranded.WithLabelValues(cause).Inc() }

// PrefillLeg records one prefill leg's duration and, for the leg whose
// answer starts the decode leg, the request's time to it (queue >= 0).
func (m *Metrics) PrefillLeg(seconds, queue float64) {
	m.prefillLeg.Observe(seconds)
	if queue >= 0 {
		m.prefillQueue.Observe(queue)
	}
}

// DecodeFirstByte records a disaggregated request's decode leg's first
// byte: the time since the leg was sent and since the prefill's answer.
func (m *Metrics) DecodeFirstByte(sinceSent, sincePrefill float64) {
	m.decodeTTFB.Observe(sinceSent)
	m.handoff.Observe(sincePrefill)
}

// Retry counts one retry.
func (m *Metrics) Retry() { m.retries.Inc() }

// RetryDenied counts one retry the budget did not allow.
func (m *Metrics) RetryDenied() { m.retryDenied.Inc() }

// Cancelled counts one upstream request cancelled for a client that left.
func (m *Metrics) Cancelled() { m.cancelled.Inc() }

// Queued moves the number of requests waiting for a saturated fleet by d.
func (m *Metrics) Queued(d float64) { m.queued.Add(d) }

// Overloaded counts one request rejected with 429 for overload.
func (m *Metrics) Overloaded() { m.overloaded.Inc() }

// endpointCollector reports per-endpoint atomics at scrape time, so the
// request path pays nothing for per-endpoint series.
type endpointCollector struct {
	each func(yield func(EndpointSample))
}

var (
	descEndpointInFlight = prometheus.NewDesc(Namespace+"_endpoint_in_flight_requests",
		"Requests in flight to the endpoint from this router.", []string{"endpoint", "role"}, nil)
	descEndpointPending = prometheus.NewDesc(Namespace+"_endpoint_pending_prefill_tokens",
		"Prompt tokens of this router's in-flight requests to the endpoint that it has not answered yet (its prefill queue as the router sees it).", []string{"endpoint", "role"}, nil)
	descEndpointPeerInFlight = prometheus.NewDesc(Namespace+"_endpoint_peer_in_flight_requests",
		"Requests in flight to the endpoint from the other router replicas, as their gossip last told (with --peers).", []string{"endpoint", "role"}, nil)
	descEndpointRequests = prometheus.NewDesc(Namespace+"_endpoint_requests_total",
		"Requests dispatched to the endpoint (attempts, retries included).", []string{"endpoint", "role"}, nil)
	descEndpointFailures = prometheus.NewDesc(Namespace+"_endpoint_failures_total",
		"Failed attempts on the endpoint (connection errors, timeouts, 5xx).", []string{"endpoint", "role"}, nil)
	descPrefillRate = prometheus.NewDesc(Namespace+"_endpoint_prefill_tokens_per_second",
		"Learned prefill rate of the endpoint: the slope of its TTFT in the prompt tokens to compute.", []string{"endpoint", "role"}, nil)
	descLoadRate = prometheus.NewDesc(Namespace+"_endpoint_load_tokens_per_second",
		"Learned rate at which the endpoint loads cached tokens held on a slower tier than the GPU (CPU, storage; engine KV events): the slope of its TTFT in those tokens, the prior until such loads are seen.", []string{"endpoint", "role"}, nil)
	descFixed = prometheus.NewDesc(Namespace+"_endpoint_ttft_fixed_seconds",
		"Learned part of the endpoint's TTFT that no load explains (network, tokenisation, first step).", []string{"endpoint", "role"}, nil)
	descDecodeStep = prometheus.NewDesc(Namespace+"_endpoint_decode_step_seconds",
		"Learned decode step of the endpoint: its engine's mean inter-token latency.", []string{"endpoint", "role"}, nil)
	descDecode = prometheus.NewDesc(Namespace+"_endpoint_decode_seconds",
		"Learned mean time from a stream's first byte to its end on the endpoint.", []string{"endpoint", "role"}, nil)
	descBatchLimit = prometheus.NewDesc(Namespace+"_endpoint_batch_limit",
		"Learned batch limit of the endpoint: the most requests its engine ran while others waited.", []string{"endpoint", "role"}, nil)
	descKVUsage = prometheus.NewDesc(Namespace+"_endpoint_kv_cache_usage_ratio",
		"KV-cache usage of the endpoint's engine, 0-1, from its last fresh scrape (every role; llm_decode_kv_cache_usage_percent is that of every endpoint that decodes, in percent).", []string{"endpoint", "role"}, nil)
	descDecodeKVUsage = prometheus.NewDesc("llm_decode_kv_cache_usage_percent",
		"KV-cache usage of the engine of an endpoint that decodes (mixed and decode roles: not a prefill pool's), 0-100, from its last fresh scrape.", []string{"endpoint"}, nil)
	descCalibrationSamples = prometheus.NewDesc(Namespace+"_endpoint_calibration_samples",
		"Observations behind the endpoint's learned costs, by kind (ttft, decode, decode_step, batch_limit).", []string{"endpoint", "role", "kind"}, nil)
)

func (c *endpointCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descEndpointInFlight
	ch <- descEndpointPending
	ch <- descEndpointPeerInFlight
	ch <- descEndpointRequests
	ch <- descEndpointFailures
	ch <- descKVUsage
	ch <- descDecodeKVUsage
	for _, d := range []*prometheus.Desc{descPrefillRate, descLoadRate, descFixed, descDecodeStep, descDecode, descBatchLimit, descCalibrationSamples} {
		ch <- d
	}
}

func (c *endpointCollector) Collect(ch chan<- prometheus.Metric) {
	c.each(func(s EndpointSample) {
		ch <- prometheus.MustNewConstMetric(descEndpointInFlight, prometheus.GaugeValue, float64(s.InFlight), s.URL, s.Role)
		ch <- prometheus.MustNewConstMetric(descEndpointPending, prometheus.GaugeValue, float64(s.PendingPrefill), s.URL, s.Role)
		if s.PeerInFlight >= 0 {
			ch <- prometheus.MustNewConstMetric(descEndpointPeerInFlight, prometheus.GaugeValue, float64(s.PeerInFlight), s.URL, s.Role)
		}
		ch <- prometheus.MustNewConstMetric(descEndpointRequests, prometheus.CounterValue, float64(s.Requests), s.URL, s.Role)
		ch <- prometheus.MustNewConstMetric(descEndpointFailures, prometheus.CounterValue, float64(s.Failures), s.URL, s.Role)
		if s.KVUsage >= 0 {
			ch <- prometheus.MustNewConstMetric(descKVUsage, prometheus.GaugeValue, s.KVUsage, s.URL, s.Role)
			if s.Role != "prefill" { // every endpoint that decodes
				ch <- prometheus.MustNewConstMetric(descDecodeKVUsage, prometheus.GaugeValue, 100*s.KVUsage, s.URL)
			}
		}
		if c := s.Costs; c != nil {
			gauge := func(d *prometheus.Desc, v float64, labels ...string) {
				ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, append([]string{s.URL, s.Role}, labels...)...)
			}
			gauge(descPrefillRate, c.PrefillTokensPerSec)
			gauge(descLoadRate, c.LoadTokensPerSec)
			gauge(descFixed, c.FixedSec)
			gauge(descDecodeStep, c.DecodeStepSec)
			gauge(descDecode, c.DecodeSec)
			gauge(descBatchLimit, float64(c.BatchLimit))
			gauge(descCalibrationSamples, float64(c.TTFTSamples), "ttft")
			gauge(descCalibrationSamples, float64(c.DecodeSamples), "decode")
			gauge(descCalibrationSamples, float64(c.StepSamples), "decode_step")
			gauge(descCalibrationSamples, float64(c.LimitSamples), "batch_limit")
		}
	})
}

// RegisterBuildInfo exports kvroute_build_info: 1, labelled with the
// build's version, VCS revision and Go version.
func RegisterBuildInfo(reg prometheus.Registerer, version, revision, goVersion string) {
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: Namespace, Name: "build_info",
		Help:        "kvroute's build: 1, labelled with its version, VCS revision and Go version.",
		ConstLabels: prometheus.Labels{"version": version, "revision": revision, "goversion": goVersion},
	})
	g.Set(1)
	reg.MustRegister(g)
}
