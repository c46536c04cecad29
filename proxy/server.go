package proxy

import (
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/metrics"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// Picker is the seam between the proxy and a policy (routing.Picker).
type Picker = routing.Picker

// Learner is a policy that learns from the engine's usage report: the
// prompt tokens (0 when absent) and those it served from its prefix cache
// (usage.prompt_tokens_details.cached_tokens) of a request decided as d,
// whose canonical rendering was promptBytes long. Learn returns the cached
// tokens the policy had estimated. LearnTTFT learns from a streamed answer
// whose usage did not say what was cached: from its time to first token
// against the endpoint's predicted TTFT for a number of prompt tokens to
// compute; it reports whether the TTFT contradicts d's estimate of the
// tokens to compute (the answer then does not calibrate the endpoint's
// costs).
type Learner interface {
	Learn(d routing.Decision, promptBytes, enginePromptTokens, engineCachedTokens int) (estimated int)
	LearnTTFT(d routing.Decision, promptBytes int, ttft time.Duration, predict func(own int) time.Duration) (contradicts bool)
}

// Classes are the path-class labels of the metrics, indexed by routing.Kind.
var Classes = []string{
	routing.KindOther:       routing.KindOther.String(),
	routing.KindCompletions: routing.KindCompletions.String(),
	routing.KindChat:        routing.KindChat.String(),
	routing.KindResponses:   routing.KindResponses.String(),
	routing.KindEmbeddings:  routing.KindEmbeddings.String(),
}

// Options configure a Server.
type Options struct {
	Limits
	// Ready, when set, is asked by /readyz: an error keeps the router out
	// of service with its message (the replicas' gossip until it has met
	// a peer).
	Ready   func() error
	Picker  Picker
	Pool    *discovery.Pool
	Metrics *metrics.Metrics
	Logger  *zap.Logger
	// Tracer, when set, makes a span of every request (see tracing.go).
	Tracer trace.Tracer
	// NearMissBlocks is how many leading blocks of every prompt the
	// near-identical prompt detector normalises (0: off).
	NearMissBlocks int
	// NormalizePrompts rewrites prompts to normal form (normalize.go).
	NormalizePrompts bool
	// Budgets are the tenants' budgets in force at start (budgets.go;
	// nil: none); SetBudgets replaces them.
	Budgets *Budgets
	// Cached, when set, estimates how many of a request's prompt tokens
	// the fleet holds (the prefix policy's index): the queue charges a
	// waiting request its uncached tokens and output, not its whole
	// prompt.
	Cached func(r *routing.Request) int
	// Warm, when set, reports whether a request's prompt is cached on
	// set and whether an endpoint holding it has room (the prefix
	// policy's index): the queue gives a freed place to a waiter that
	// starts warm before one of its flow that would recompute its prompt.
	Warm func(r *routing.Request, set *discovery.Set) (placed, room bool)
	// Holding, when set, returns the endpoints holding r's prompt: the
	// queue cuts a stream there first to free a place for r (preempt.go).
	Holding func(r *routing.Request, set *discovery.Set) []*discovery.Endpoint
	// Peers, when set, returns how many other router replicas share the
	// fleet (their gossip): a waiter whose cache has no room then defers
	// its grant a moment, so that a replica with a warm waiter for the
	// freed place takes it first (coldDefer).
	Peers func() int
	// AccessLog, when set, receives one line per request (accesslog.go),
	// but for the share AccessLogSkip of successful ones (status < 400), at
	// random: in zap's production JSON layout, or its console layout with
	// AccessLogConsole.
	AccessLog        io.Writer
	AccessLogConsole bool
	AccessLogSkip    float64
	// AdminToken guards the admin handler's mutating endpoints and pprof
	// (Server.guard); "" turns them off.
	AdminToken string
	// BlockSize and MaxBlocks shape prefix hashing (bytes per block, cap).
	BlockSize, MaxBlocks int
	// Learner, when set, receives the engine's cached-token counts, read
	// from response bodies as they stream past.
	Learner Learner
	// Tokenizer, when set, is offered every answered single-prompt
	// completion or chat that engine truth has not linked yet (off the
	// request path: the offer is a copy and never blocks).
	Tokenizer Tokenizer
	// PD configures prefill/decode disaggregation.
	PD PDOptions
	// Tenants say who asks and how urgently (tenant.go).
	Tenants TenantOptions
}

// Server is the proxy. Create it with New; it is safe for concurrent use.
type Server struct {
	opt     Options
	srv     *fasthttp.Server
	clients sync.Map // *discovery.Endpoint → *fasthttp.HostClient
	// closesEarly holds the endpoints seen closing a pooled connection
	// before kvroute's upstream-idle timeout: their answers' connections
	// are closed, not pooled (*discovery.Endpoint → true).
	closesEarly sync.Map
	// uncached holds the endpoints whose usage reports carry no cached
	// tokens (silentCache; *discovery.Endpoint → true).
	uncached sync.Map
	pruned   atomic.Uint64
	states   sync.Pool // *reqState
	bodies   sync.Pool // *upstreamBody
	// idPrefix makes generated request ids unique across router replicas.
	idPrefix [8]byte
	idSeq    atomic.Uint64
	draining atomic.Bool
	attempts attempts           // upstream attempts in flight, and the client watcher
	near     *prefix.NearMisses // the near-identical prompt detector; nil when off
	nearLog  atomic.Int64       // when a near miss was last logged (Unix ns)
	budget   retryBudget        // retries allowed
	queue    fairQueue          // requests waiting for a saturated fleet
	budgets  budgetState        // the tenants' budgets and their use
	tenants  tenantLabels       // the tenants' metric labels
	// queueOnce starts the queue's dispatcher with the first Serve;
	// Shutdown stops it once the requests have ended.
	queueOnce    sync.Once
	queueRunning bool // set under queueOnce
	hijacked     sync.WaitGroup
	legs         sync.WaitGroup // concurrent prefill legs (SGLang)
	pd           handoff        // the PD protocol; nil without a decode pool
	access       accessLog
}

// New returns a Server. It starts nothing; call Serve.
func New(opt Options) *Server {
	if opt.Logger == nil {
		opt.Logger = zap.NewNop()
	}
	if opt.Metrics == nil {
		opt.Metrics = metrics.New(prometheus.NewRegistry(), Classes, nil)
	}
	// Zero values that cannot mean "no limit" take the defaults.
	d := DefaultLimits()
	if opt.BlockSize <= 0 {
		opt.BlockSize = DefaultBlockBytes
	}
	if opt.MaxBlocks <= 0 {
		opt.MaxBlocks = DefaultMaxBlocks
	}
	for _, f := range []struct{ v, def *int }{{&opt.MaxBodyBytes, &d.MaxBodyBytes}, {&opt.MaxConnsPerEndpoint, &d.MaxConnsPerEndpoint},
		{&opt.MaxHeaderBytes, &d.MaxHeaderBytes}, {&opt.MaxPromptTokens, &d.MaxPromptTokens}} {
		if *f.v <= 0 {
			*f.v = *f.def
		}
	}
	if opt.UpstreamIdleTimeout <= 0 {
		opt.UpstreamIdleTimeout = d.UpstreamIdleTimeout
	}
	dt := DefaultTenantOptions()
	if opt.Tenants.MaxQueue <= 0 || opt.Tenants.FIFO {
		opt.Tenants.MaxQueue = opt.MaxQueue // no bound of a tenant's own
	}
	if opt.Tenants.MetricTenants <= 0 {
		opt.Tenants.MetricTenants = dt.MetricTenants
	}
	s := &Server{opt: opt, pd: newHandoff(opt.PD)}
	if opt.NearMissBlocks > 0 {
		s.near = prefix.NewNearMisses(nearMissMemory)
	}
	s.access.w, s.access.console, s.access.dropped = opt.AccessLog, opt.AccessLogConsole, opt.Metrics.AccessLogDropped
	s.budget.init(opt.RetryBudget, opt.MinRetries)
	s.queue.init(opt.MaxQueue, opt.Tenants.MaxQueue, func(r *routing.Request) bool { return routing.Room(r, s.opt.Pool.Load()) },
		s.budgets.atMax, opt.Metrics.TenantQueued)
	if opt.Warm != nil {
		s.queue.warm = func(r *routing.Request) (bool, bool) { return opt.Warm(r, s.opt.Pool.Load()) }
		s.queue.peers = opt.Peers
	}
	if !opt.Tenants.FIFO {
		s.queue.reserve, s.queue.places = opt.Tenants.Reserve, s.placesOf
		if opt.Tenants.Preempt && opt.MaxMigrations > 0 {
			s.queue.cut = s.cutFor
		}
	}
	s.budgets.cur.Store(opt.Budgets)
	s.tenants.max = opt.Tenants.MetricTenants
	s.states.New = func() any { return &reqState{wait: waiter{ready: make(chan struct{}, 1)}} }
	s.bodies.New = func() any { return new(upstreamBody) }
	const hex = "0123456789abcdef"
	r := rand.Uint64()
	for i := range s.idPrefix {
		s.idPrefix[i] = hex[(r>>(4*i))&15]
	}
	s.srv = &fasthttp.Server{
		Handler:               s.handle,
		ErrorHandler:          s.handleServerError,
		Name:                  "kvroute",
		NoDefaultServerHeader: true,
		NoDefaultContentType:  true,
		NoDefaultDate:         true,
		MaxRequestBodySize:    opt.MaxBodyBytes,
		IdleTimeout:           opt.ClientIdleTimeout,
		// The header block within ClientHeaderTimeout of its first byte;
		// the body's reads are timed by clientListener.
		ReadTimeout:    opt.ClientHeaderTimeout,
		ReadBufferSize: opt.MaxHeaderBytes, // fasthttp's cap on a header block
		WriteTimeout:   0,                  // a stream may last many minutes
		// Parse errors quote the request; kvroute never sends them, and
		// fasthttp must not log them either.
		SecureErrorLogMessage:              true,
		Logger:                             quietLogger{opt.Logger},
		ReduceMemoryUsage:                  false,
		DisablePreParseMultipartForm:       true,
		StreamRequestBody:                  false,
		CloseOnShutdown:                    true,
		SleepWhenConcurrencyLimitsExceeded: 0,
	}
	return s
}

// quietLogger takes fasthttp's connection errors (a client's malformed
// request, a reset) to the Debug level, without their arguments, which
// may quote the request's bytes.
type quietLogger struct{ l *zap.Logger }

func (q quietLogger) Printf(format string, _ ...any) {
	q.l.Debug("client connection error", zap.String("format", format))
}

// Serve accepts client connections on ln until Shutdown.
func (s *Server) Serve(ln net.Listener) error {
	s.attempts.tick = s.checkSet
	s.attempts.closedEarly = func(ep *discovery.Endpoint) { s.closesEarly.Store(ep, true) }
	s.attempts.start(s.opt.Metrics.Cancelled)
	s.access.start()
	s.queueOnce.Do(func() { s.queue.start(); s.queueRunning = true })
	return s.srv.Serve(clientListener{Listener: ln, body: s.opt.ClientBodyTimeout})
}

// Drain marks the server as draining: /readyz answers 503 from now on.
func (s *Server) Drain() { s.draining.Store(true) }

// Shutdown stops accepting connections and waits for in-flight requests,
// streams included (those to HTTP/1.0 clients too), until ctx is done.
func (s *Server) Shutdown(ctx context.Context) error {
	s.Drain()
	err := s.srv.ShutdownWithContext(ctx)
	done := make(chan struct{})
	go func() { s.hijacked.Wait(); s.legs.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		err = errors.Join(err, ctx.Err())
	}
	s.queueOnce.Do(func() {}) // a server that never served has no dispatcher
	if s.queueRunning {
		s.queue.close()
	}
	s.attempts.close()
	s.access.close()
	s.clients.Range(func(_, v any) bool {
		v.(*fasthttp.HostClient).CloseIdleConnections()
		return true
	})
	return err
}

// handleServerError answers errors fasthttp detects before the handler runs
// (oversized or malformed requests) with an OpenAI-style error.
// The answer never quotes fasthttp's error, which may contain the request's
// bytes (credentials included); the log line at Debug does not either.
func (s *Server) handleServerError(ctx *fasthttp.RequestCtx, err error) {
	var small *fasthttp.ErrSmallBuffer
	e := ErrMalformedRequest
	switch {
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		e = ErrBodyTooLarge
	case errors.As(err, &small) || errors.Is(err, fasthttp.ErrSmallReadBuffer):
		e = ErrHeaderTooLarge
	}
	status := writeError(ctx, e)
	id := ctx.Request.Header.PeekBytes(headerRequestID) // when the header was read (413)
	if len(id) == 0 {
		id = s.newRequestID(nil)
	}
	ctx.Response.Header.SetBytesKV(headerRequestID, id)
	ctx.Response.SetConnectionClose() // the stream's framing is unknown after a parse error
	s.opt.Logger.Debug("malformed request", zap.Int("status", status), zap.Stringer("remote", ctx.RemoteAddr()))
	s.opt.Metrics.Request(int(routing.KindOther), status, nil, 0)
}

// Freed tells the queue that places may have freed outside this router:
// another replica's requests at an endpoint ended (its gossiped load
// fell), so that a waiter here takes the place within the exchange rather
// than at the queue's next poll.
func (s *Server) Freed() { s.queue.freed() }
