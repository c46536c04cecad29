package discovery

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// ErrBadURL is returned for a backend URL kvroute cannot route to.
var ErrBadURL = errors.New("discovery: bad backend URL")

// Role is the part an endpoint plays in serving.
type Role uint8

// Roles. Mixed endpoints serve whole requests; prefill and decode endpoints
// serve one leg of a disaggregated request.
const (
	RoleMixed Role = iota
	RolePrefill
	RoleDecode
)

// String returns the role's flag spelling.
func (r Role) String() string {
	switch r {
	case RolePrefill:
		return "prefill"
	case RoleDecode:
		return "decode"
	default:
		return "mixed"
	}
}

// Endpoint is one model-server pod. Its identity fields are set once by
// NewEndpoint and never change; its counters are atomics, safe for concurrent
// use, and survive from one Set to the next for as long as the address stays.
type Endpoint struct {
	// URL is the base URL as configured, without a trailing slash
	// (e.g. "http://10.0.0.7:8000").
	URL string
	// Addr is host:port, the dial address.
	Addr string
	// TLS is true for https base URLs.
	TLS bool
	// BasePath is a path prefix prepended to every forwarded path ("" for none).
	BasePath string
	// Role is the endpoint's serving role.
	Role Role
	// BootstrapPort is the port of a prefill endpoint's SGLang bootstrap
	// server, from the URL's "#bootstrap=PORT" fragment; 0: the router's
	// default (--pd-bootstrap-port).
	BootstrapPort int
	// KVEventsPort is the port the endpoint's engine publishes its
	// KV-cache events on, from the URL's "#kv-events=PORT" fragment; 0:
	// the router's --kv-events-port (one port on every pod's own address,
	// as in Kubernetes; pods sharing a host need their own).
	KVEventsPort int
	// ID is a stable 64-bit identity derived from URL (used by rendezvous
	// hashing so independent router replicas agree).
	ID uint64
	// The router's own claims on the endpoint, changed only through Lease
	// (Acquire, FirstByte, Release): inFlight counts the requests
	// dispatched and not yet finished; pendingPrefill the prompt tokens of
	// those requests the endpoint still has to compute (from the pick to
	// the first response byte); requests every request ever dispatched.
	inFlight       atomic.Int64
	pendingPrefill atomic.Int64
	requests       atomic.Uint64
	// awaiting counts the streams in flight whose first byte has not come
	// (Lease.Streams): the engine is not seen running them yet. peakRunning
	// is the most requests it was seen running at once: in flight (the
	// peers' too) less those streams, at a first byte (seenLimit).
	awaiting    atomic.Int64
	peakRunning atomic.Int64
	// peerInFlight is the other router replicas' requests in flight here,
	// as their gossip last told (SetPeerInFlight).
	peerInFlight atomic.Int64
	// peerPrefill is the prompt tokens the replicas' placements here left
	// to compute, as this router estimates them (AddPeerPrefill).
	peerPrefill peerPrefill
	// unheard is the prompt tokens this router expects the replicas to
	// have sent here that their gossip has not told yet (AddUnheardPrefill).
	unheard peerPrefill
	// adapters counts the in-flight requests per LoRA adapter (Lease.
	// ForAdapter); nil until the first.
	adapterMu sync.Mutex
	adapters  map[string]int
	// prompts counts the in-flight requests per prompt key of a slot
	// engine's (Lease.ForPrompt, prompts.go).
	prompts prompts
	// Failures counts upstream failures (connection errors and 5xx).
	Failures atomic.Uint64

	// flags holds the reasons the endpoint is not routable (flagDown,
	// flagEjected, flagDraining); 0 means routable.
	flags atomic.Uint32
	// owner is the Fleet managing the endpoint, set once before the
	// endpoint is first published; nil for endpoints published on a bare
	// Pool (no passive ejection then).
	owner *Fleet
	// calib learns the endpoint's costs from its leases and scrapes, and
	// costs is its latest snapshot; calib is set with owner, and nil when
	// calibration is off or there is no owner.
	calib *calibrator
	costs atomic.Pointer[Costs]

	// Active health: consecutive probe results, written by the one prober
	// worker holding probing.
	probing    atomic.Bool
	probeFails atomic.Int32
	probeOKs   atomic.Int32

	// Passive health: consecutive failures reported by the proxy, and the
	// ejection bookkeeping (the plain fields are guarded by owner.ejectMu).
	passiveFails atomic.Int32
	// Shedding: the endpoint answers 429 ("too many requests"): it takes
	// no new requests until shedUntil (Unix ns; 0: not shedding); sheds
	// counts the 429s in a row.
	shedUntil atomic.Int64
	sheds     atomic.Int32
	// Backpressure (room.go): an engine that answered 429 while it ran
	// others of the known requests is full at that load (fullAt; 0: not
	// full) until fullUntil (Unix ns).
	fullAt       atomic.Int64
	fullUntil    atomic.Int64
	ejectLevel   int           // ejections in a row; the cooldown doubles with each
	cooldown     time.Duration // of the current or last ejection
	ejectedUntil time.Time
	lastReturn   time.Time // when the last ejection ended

	// Engine metrics: fresh is nil while unknown or stale, last keeps the
	// latest successful scrape for introspection. scr is owned by the one
	// scraper worker holding scraping.
	scraping atomic.Bool
	// rampAt is when the scrape the slow start last asked for is due
	// (Unix ns; rampScrape).
	rampAt atomic.Int64
	// cuts learns whether the engine stops a request the router cut
	// (cut.go).
	cuts cutChecks
	// models is the endpoint's model list (nil: not known); listing is
	// held by the models worker reading it.
	models  atomic.Pointer[Models]
	listing atomic.Bool
	fresh   atomic.Pointer[EngineStats]
	last    atomic.Pointer[EngineStats]
	scr     scrapeMemory
	// metricsFailing: the latest scrape failed (the engine's /metrics
	// answered, but not with metrics kvroute reads, or not at all).
	metricsFailing atomic.Bool
	// noMetricsUntil (Unix ns; 0: scrape) is set when the engine serves
	// no /metrics (404, 405, 501; llama.cpp's endpoint_metrics false):
	// the scraper leaves it alone until then.
	noMetricsUntil atomic.Int64

	// Engine dialect (dialect.go): dialect is a Dialect; detected is
	// cleared to detect it again; detecting is held by the one worker
	// detecting; detectedAt is the last detection (Unix ns); info is what
	// the engine said of itself.
	dialect    atomic.Uint32
	detected   atomic.Bool
	detecting  atomic.Bool
	detectedAt atomic.Int64
	info       atomic.Pointer[EngineInfo]
}

// Reasons an endpoint is not routable, bits of Endpoint.flags.
const (
	flagDown     uint32 = 1 << iota // active probes failed FailThreshold times in a row
	flagEjected                     // passive ejection, until its cooldown ends
	flagDraining                    // left the Set; in-flight requests finish
)

// Routable reports whether the endpoint may take a new request: it is not
// down (active probes), not ejected (passive failures) and not draining.
// One atomic load; safe for concurrent use. Every policy must skip an
// endpoint that is not routable.
func (e *Endpoint) Routable() bool { return e.flags.Load() == 0 }

// State is an endpoint's health as shown by introspection and metrics.
type State uint8

// States, from the most to the least serious reason; an endpoint in
// several (say down and draining) reports the first that applies:
// draining, down, ejected, up.
const (
	StateUp State = iota
	StateDown
	StateEjected
	StateDraining
)

// String returns the state's label: up, down, ejected or draining.
func (s State) String() string {
	switch s {
	case StateDown:
		return "down"
	case StateEjected:
		return "ejected"
	case StateDraining:
		return "draining"
	default:
		return "up"
	}
}

// MarshalText makes State a JSON string.
func (s State) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// State returns the endpoint's current state. Safe for concurrent use.
func (e *Endpoint) State() State {
	f := e.flags.Load()
	switch {
	case f&flagDraining != 0:
		return StateDraining
	case f&flagDown != 0:
		return StateDown
	case f&flagEjected != 0:
		return StateEjected
	default:
		return StateUp
	}
}

// ReportSuccess tells passive health checking that a request to e
// succeeded (a response other than a connection failure or 5xx); it resets
// the run of consecutive failures. It costs one atomic load when there is
// nothing to reset, so the proxy may call it on every response. Safe for
// concurrent use.
func (e *Endpoint) ReportSuccess() {
	if e.passiveFails.Load() != 0 {
		e.passiveFails.Store(0)
	}
	if e.sheds.Load() != 0 {
		e.sheds.Store(0)
	}
}

// Shedding backoff: an endpoint that answered 429 with none of the known
// requests in flight (it refuses everything) takes no new requests for
// ShedFirst, doubling with each 429 in a row up to ShedMax, or for its
// Retry-After when longer (capped at ShedMax).
const (
	ShedFirst = 250 * time.Millisecond
	ShedMax   = 8 * time.Second
)

// ReportShed tells the endpoint's users that it answered 429, with the
// Retry-After it gave (0: none), while the request it refused held a
// lease on it. When it ran others of the known requests (Load) it is full,
// not failing: backpressure (true) — it takes no new request until that
// load falls (Full). Otherwise it refuses everything: policies skip it,
// like a saturated endpoint, for a backoff that doubles with each 429 in
// a row (Shedding), so that it cannot absorb the fleet's traffic. Neither
// is a failure (neither ejects). Safe for concurrent use.
func (e *Endpoint) ReportShed(retryAfter time.Duration) (backpressure bool) {
	if load := e.Load() - 1; load > 0 {
		e.fullAt.Store(load)
		e.fullUntil.Store(time.Now().Add(FullFor).UnixNano())
		return true
	}
	n := min(e.sheds.Add(1), 16)
	d := min(max(ShedFirst<<(n-1), retryAfter), ShedMax)
	e.shedUntil.Store(time.Now().Add(d).UnixNano())
	return false
}

// Shedding reports whether the endpoint answered 429 recently enough
// that it takes no new requests (ReportShed). One atomic load when it
// does not shed: a backoff found over is cleared.
func (e *Endpoint) Shedding() bool {
	until := e.shedUntil.Load()
	if until == 0 {
		return false
	}
	if time.Now().UnixNano() < until {
		return true
	}
	e.shedUntil.CompareAndSwap(until, 0)
	return false
}

// ReportFailure tells passive health checking that a request to e failed
// (connection error, timeout, or a 5xx status from the engine) and counts it
// in Failures. After PassiveConfig.Failures consecutive failures a Fleet
// ejects e for a cooldown that doubles on repeated ejections. Safe for
// concurrent use.
func (e *Endpoint) ReportFailure() {
	e.Failures.Add(1)
	n := e.passiveFails.Add(1)
	if f := e.owner; f != nil {
		f.passiveFailure(e, int(n))
	}
}

// Engine returns the engine's own view of its load from the latest scrape
// of its /metrics, or nil when no scrape succeeded yet or the latest
// success is older than ScrapeConfig.StaleAfter, so that routing never acts
// on stale values. The result is immutable. One atomic load; safe for
// concurrent use.
func (e *Endpoint) Engine() *EngineStats { return e.fresh.Load() }

// Costs returns the endpoint's learned serving costs, nil before the first
// observation or without calibration. The result is immutable. One atomic
// load; safe for concurrent use.
func (e *Endpoint) Costs() *Costs { return e.costs.Load() }

// SetCosts replaces the endpoint's learned costs with c, for an embedder
// with measurements of its own, and tests; the endpoint's calibration
// replaces them again at its next observation.
func (e *Endpoint) SetCosts(c *Costs) { e.costs.Store(c) }

// SetEngine records st as the endpoint's latest engine metrics, fresh until
// the scraper finds them older than its stale-after limit. The scraper calls
// it; so may an embedder with its own metrics source, and tests.
func (e *Endpoint) SetEngine(st *EngineStats) {
	e.last.Store(st)
	e.fresh.Store(st)
	e.cuts.scraped(st)
}

// NewEndpoint parses a base URL ("http://host:port[/base]", or "host:port",
// which means http) into an Endpoint with zeroed counters. The one fragment
// allowed, "#bootstrap=PORT", sets BootstrapPort; it is not part of the
// endpoint's URL or identity; nor is "#kv-events=PORT", which sets
// KVEventsPort. Both may be given, joined by "&".
func NewEndpoint(raw string, role Role) (*Endpoint, error) {
	s := strings.TrimSpace(raw)
	if s == "" {
		return nil, fmt.Errorf("%w: empty", ErrBadURL)
	}
	if !strings.Contains(s, "://") {
		s = "http://" + s
	}
	u, err := url.Parse(s)
	if err != nil {
		return nil, fmt.Errorf("%w: %q: %v", ErrBadURL, raw, err)
	}
	var tls bool
	switch u.Scheme {
	case "http":
	case "https":
		tls = true
	default:
		return nil, fmt.Errorf("%w: %q: scheme must be http or https", ErrBadURL, raw)
	}
	if u.Host == "" || u.Hostname() == "" {
		return nil, fmt.Errorf("%w: %q: no host", ErrBadURL, raw)
	}
	if u.RawQuery != "" || u.User != nil {
		return nil, fmt.Errorf("%w: %q: query and user info are not allowed", ErrBadURL, raw)
	}
	var bootstrap, kvEvents int
	for f := range strings.SplitSeq(u.Fragment, "&") {
		if f == "" {
			continue
		}
		k, v, _ := strings.Cut(f, "=")
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 65535 || (k != "bootstrap" && k != "kv-events") {
			return nil, fmt.Errorf("%w: %q: the fragments allowed are #bootstrap=PORT (an SGLang prefill endpoint's bootstrap port) and #kv-events=PORT (its engine's KV-event publisher), ports 1-65535, joined by &", ErrBadURL, raw)
		}
		if k == "bootstrap" {
			bootstrap = n
		} else {
			kvEvents = n
		}
	}
	port := u.Port()
	if port == "" {
		port = "80"
		if tls {
			port = "443"
		}
	}
	base := strings.TrimRight(u.EscapedPath(), "/")
	ep := &Endpoint{
		Addr:          net.JoinHostPort(u.Hostname(), port),
		TLS:           tls,
		BasePath:      base,
		Role:          role,
		BootstrapPort: bootstrap,
		KVEventsPort:  kvEvents,
	}
	ep.URL = u.Scheme + "://" + ep.Addr + base
	ep.ID = hashString(ep.URL)
	return ep, nil
}

// String returns the endpoint's URL.
func (e *Endpoint) String() string { return e.URL }

// hashString is FNV-1a 64, a fixed function so IDs agree across processes.
func hashString(s string) uint64 {
	h := uint64(14695981039346656037)
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= 1099511628211
	}
	return h
}
