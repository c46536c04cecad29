// Package proxy is kvroute's data plane: a fasthttp server that reads each
// request once, parses inference bodies into a routing.Request, asks a
// Picker for an endpoint, forwards the request, and streams the response
// back with a flush per chunk. It owns retries, the mapping of failures to
// statuses, header hygiene, the access log and the admin listener.
package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"slices"
	"strings"
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
// tokens the policy had estimated.
type Learner interface {
	Learn(d routing.Decision, promptBytes, enginePromptTokens, engineCachedTokens int) (estimated int)
}

// Classes are the path-class labels of the metrics, indexed by routing.Kind.
var Classes = []string{
	routing.KindOther:       routing.KindOther.String(),
	routing.KindCompletions: routing.KindCompletions.String(),
	routing.KindChat:        routing.KindChat.String(),
	routing.KindResponses:   routing.KindResponses.String(),
	routing.KindEmbeddings:  routing.KindEmbeddings.String(),
}

// Limits bound a Server's requests and upstream connections; Config and
// Options share them. Zero durations mean "no limit", except
// UpstreamIdleTimeout; in Options, zero sizes and UpstreamIdleTimeout take
// DefaultConfig's values.
type Limits struct {
	// MaxBodyBytes caps request bodies (413 beyond).
	MaxBodyBytes int
	// Retries is how many times a request may be re-sent to another
	// endpoint before its first response byte.
	Retries int
	// ConnectTimeout bounds dialing an endpoint.
	ConnectTimeout time.Duration
	// ResponseHeaderTimeout bounds the wait from sending a request to the
	// first response byte.
	ResponseHeaderTimeout time.Duration
	// StreamIdleTimeout bounds the gap between two reads of a response body.
	StreamIdleTimeout time.Duration
	// UpstreamIdleTimeout closes idle upstream keep-alive connections
	// (see discovery.EngineIdleTimeout).
	UpstreamIdleTimeout time.Duration
	// ClientIdleTimeout closes idle client keep-alive connections.
	ClientIdleTimeout time.Duration
	// MaxConnsPerEndpoint caps upstream connections per endpoint; every
	// streaming request holds one for its whole life. An endpoint at the
	// cap is busy, not broken: the request goes elsewhere or waits.
	MaxConnsPerEndpoint int
	// ClientHeaderTimeout bounds reading a request's header block from
	// its first byte (on a new connection, from the accept).
	ClientHeaderTimeout time.Duration
	// ClientBodyTimeout bounds every read of a request body: a body may
	// arrive slowly, but not stop.
	ClientBodyTimeout time.Duration
	// MaxHeaderBytes caps a request's header block (431 beyond).
	MaxHeaderBytes int
	// MaxPromptTokens caps the token ids of a request's prompt (a
	// context-length error beyond); the router's memory for a request
	// stays a small multiple of its body.
	MaxPromptTokens int
	// RetryBudget is the share of recent requests that may be retries
	// (over a sliding window of 10 s); at least MinRetries retries
	// per window are always allowed. 0: no budget.
	RetryBudget float64
	// MinRetries: see RetryBudget.
	MinRetries int
	// QueueTimeout is how long a request waits in kvroute when every
	// eligible endpoint is saturated, before a 429; 0 answers at once.
	QueueTimeout time.Duration
	// MaxQueue caps the requests waiting; beyond it, 429 at once.
	MaxQueue int
	// MaxInFlightPerEndpoint caps this router's requests in flight per
	// endpoint (0: none but MaxConnsPerEndpoint): an endpoint at the cap
	// is saturated.
	MaxInFlightPerEndpoint int
}

// DefaultLimits returns the limits and timeouts kvroute runs with unless
// configured otherwise (the flags' defaults); New takes a zero size from
// them.
func DefaultLimits() Limits {
	return Limits{
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
	}
}

// Defaults of Options.BlockSize and Options.MaxBlocks.
const (
	// DefaultBlockBytes: 1 KiB of rendering ≈ 256 tokens.
	DefaultBlockBytes = 1024
	// DefaultMaxBlocks: 256 blocks cover ≈ 64k tokens.
	DefaultMaxBlocks = 256
)

// Options configure a Server.
type Options struct {
	Limits
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
	// AccessLog writes one Info line per request to Logger, but for the
	// share AccessLogSkip of successful ones (status < 400), at random.
	AccessLog     bool
	AccessLogSkip float64
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
	Tokenizer *Tokenizer
	// PD configures prefill/decode disaggregation.
	PD PDOptions
}

// Server is the proxy. Create it with New; it is safe for concurrent use.
type Server struct {
	opt     Options
	srv     *fasthttp.Server
	clients sync.Map // *discovery.Endpoint → *fasthttp.HostClient
	pruned  atomic.Uint64
	states  sync.Pool // *reqState
	bodies  sync.Pool // *upstreamBody
	// idPrefix makes generated request ids unique across router replicas.
	idPrefix [8]byte
	idSeq    atomic.Uint64
	draining atomic.Bool
	attempts attempts           // upstream attempts in flight, and the client watcher
	near     *prefix.NearMisses // the near-identical prompt detector; nil when off
	nearLog  atomic.Int64       // when a near miss was last logged (Unix ns)
	budget   retryBudget        // retries allowed
	queue    waitQueue          // requests waiting for a saturated fleet
	hijacked sync.WaitGroup
	legs     sync.WaitGroup // concurrent prefill legs (SGLang)
	access   accessLog
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
	s := &Server{opt: opt}
	if opt.NearMissBlocks > 0 {
		s.near = prefix.NewNearMisses(nearMissMemory)
	}
	s.access.log = opt.Logger
	s.budget.init(opt.RetryBudget, opt.MinRetries)
	s.queue.init(opt.MaxQueue)
	s.states.New = func() any { return new(reqState) }
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
	s.attempts.start(s.opt.Metrics.Cancelled)
	if s.opt.AccessLog {
		s.access.start()
	}
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

// release returns st to the pool, unless a large body made it large.
func (s *Server) release(st *reqState) {
	if !st.big {
		s.states.Put(st)
	}
}

// handle serves one client request.
func (s *Server) handle(ctx *fasthttp.RequestCtx) {
	start := time.Now()
	st := s.states.Get().(*reqState)
	st.req.Reset()
	st.att, st.root, st.prompts, st.n, st.clientKV = nil, nil, 0, 0, false
	st.span, st.tctx = nil, nil
	st.pd.reset()
	defer s.release(st)
	s.opt.Metrics.InFlight(1)
	// The lease of the endpoint being tried is released here on every
	// exit, panics included, unless the response body took it over.
	defer func() {
		st.lease.Release()
		if p := recover(); p != nil {
			s.opt.Logger.Error("panic serving request", zap.Any("panic", p), zap.Stack("stack"))
			s.answer(ctx, st, ErrInternal, start)
		}
	}()

	kind := kindOf(ctx.Method(), ctx.Path())
	st.req.Kind = kind
	if ctx.Request.Header.ContentLength() == -1 && bytes.Contains(bytes.ToLower(ctx.Request.Header.RawHeaders()), []byte("content-length:")) {
		// Transfer-Encoding and Content-Length together: the framing a
		// request smuggling attempt relies on (RFC 9112 §6.3: an error,
		// and the connection closes).
		s.answer(ctx, st, ErrMalformedRequest, start)
		ctx.SetConnectionClose()
		return
	}
	reqID := s.prepareRequest(ctx)
	tp := ctx.Request.Header.PeekBytes(headerTraceparent)
	valid := st.traceContext(tp)
	if s.opt.Tracer != nil {
		s.startSpan(st, tp, ctx.Request.Header.PeekBytes(headerTracestate), valid, ctx.Method(), ctx.Path())
	}
	st.maxTokens = s.opt.MaxPromptTokens
	if kind != routing.KindOther && len(ctx.Request.Header.ContentEncoding()) == 0 {
		st.nearBlocks = s.opt.NearMissBlocks
		if err := st.parse(kind, ctx.PostBody(), s.opt.BlockSize, s.opt.MaxBlocks); err != nil {
			s.answer(ctx, st, err, start)
			return
		}
		if s.opt.NormalizePrompts && st.root != nil {
			if body := s.normalizePrompts(st); body != nil {
				ctx.Request.SetBody(body)
				if err := st.parse(kind, ctx.PostBody(), s.opt.BlockSize, s.opt.MaxBlocks); err != nil {
					s.answer(ctx, st, err, start)
					return
				}
				s.opt.Metrics.PromptRewrite()
			}
		}
		if s.near != nil {
			s.checkNearMiss(st, reqID)
		}
		if st.clientKV && !s.opt.PD.TrustClientKV {
			s.answer(ctx, st, errClientKV, start)
			return
		}
	}
	if kind == routing.KindOther && ctx.IsGet() && string(ctx.Path()) == "/v1/models" && s.answerModels(ctx, st, start) {
		return
	}
	st.uri = append(st.uri[:0], ctx.Request.RequestURI()...)
	resp, d, err := s.forward(ctx, st)
	if err != nil {
		s.answer(ctx, st, err, start)
		return
	}
	s.commit(ctx, st, d, resp, reqID, start)
}

// forward sends the request to the endpoints the policy picks, one attempt
// after another, until one answers with a response to pass on. A failed
// attempt releases its lease and counts against the endpoint where the
// endpoint is at fault (a transport failure or a 5xx; never a client's
// mistake, nor a busy endpoint). The request is re-sent elsewhere only
// where it provably never started (neverSent, or a 429/503 answer), within
// --retries and the retry budget, after a jittered pause; otherwise the
// failure is the answer. When every routable endpoint is saturated (at
// --max-in-flight-per-endpoint or out of connections), the request waits
// (wait) and tries again. On success st.lease holds the answering
// endpoint's lease and st.att its attempt.
func (s *Server) forward(ctx *fasthttp.RequestCtx, st *reqState) (*fasthttp.Response, routing.Decision, error) {
	set := s.opt.Pool.Load()
	if v := set.Version; s.pruned.Load() != v {
		s.prune(set)
	}
	if m := st.req.Model; m != "" && !set.Serves(m) {
		return nil, routing.Decision{}, &unknownModelError{strings.Clone(m)}
	}
	st.req.MaxInFlight = int64(s.opt.MaxInFlightPerEndpoint)
	s.budget.request()
	var lastErr error = ErrNoEndpoint
	var busy []*discovery.Endpoint // tried endpoints that had no free connection
	var queued time.Time
	defer func() {
		if !queued.IsZero() {
			s.queue.leave()
			s.opt.Metrics.Queued(-1)
		}
	}()
loop:
	for tries := 0; ; {
		span := s.pickSpan(st)
		d := s.opt.Picker.Pick(&st.req, set)
		endPick(span, d, false)
		ep := d.Endpoint
		if ep == nil {
			if !saturated(set, &st.req, busy) {
				break
			}
			if err := s.wait(ctx, &queued); err != nil {
				return nil, routing.Decision{}, err
			}
			set = s.opt.Pool.Load()
			// The busy may have room now.
			st.req.Tried = slices.DeleteFunc(st.req.Tried, func(e *discovery.Endpoint) bool { return slices.Contains(busy, e) })
			busy = busy[:0]
			continue
		}
		s.opt.Metrics.Decision(d.Reason, d.PromptTokens, d.PromptTokens-d.Prefill)
		st.req.Tried = append(st.req.Tried, ep)
		pd := &st.pd
		pd.split = false
		split := ep.Role == discovery.RoleDecode && s.planPD(st, d)
		own := d.Prefill
		if split {
			own = 0 // the prefill endpoint computes the prompt
		}
		st.lease = ep.Acquire(own)
		if !split {
			st.lease.Loading(d.Loaded)
		}
		if m := ep.Models(); m != nil && m.Adapter(st.req.Model) {
			st.lease.ForAdapter(st.req.Model) // the policy sees which adapters hold ep's slots
		}
		if split {
			ans, err := s.prefillStage(ctx, st, set)
			switch {
			case err != nil:
				st.lease.Release()
				lastErr = err
				break loop
			case ans != nil:
				s.opt.Metrics.PDDecision(pd.decision)
				return ans, pd.prefill, nil
			}
			if !pd.split { // a fallback: the decode endpoint computes the prompt
				st.lease.AddPrefill(d.Prefill)
			}
		}
		if !split && len(pd.orig) > 0 {
			ctx.Request.SetBody(pd.orig) // an earlier attempt's leg body
		}
		if ep.Role == discovery.RoleDecode {
			s.opt.Metrics.PDDecision(pd.decision)
		}
		a := s.beginAttempt(st, ctx.Conn(), attemptSpanName(ep), ep)
		leg := pd.leg
		if leg != nil {
			leg.pair(a)
		}
		s.setUpstream(&ctx.Request, st, ep, a.id)
		resp := fasthttp.AcquireResponse()
		resp.StreamBody = true
		pd.decodeSent()
		err := s.client(ep).Do(&ctx.Request, resp)
		var kindLabel string
		retry := tries < s.opt.Retries
		if leg != nil {
			// A failed prefill leg fails the request: its 4xx answer is
			// the answer, else a 502. (When it aborted this leg it has
			// ended; a prefill leg still running when the decode leg
			// failed is cancelled below, with the decode leg's failure.)
			if ans, lerr := leg.outcome(err != nil && a.wasAborted()); ans != nil || lerr != nil {
				if err == nil {
					s.discard(resp, a)
				}
				s.attempts.end(a)
				fasthttp.ReleaseResponse(resp)
				leg.decodeEnd(false)
				st.lease.Release()
				if ans != nil {
					pd.leg, pd.sent = nil, time.Time{}
					return ans, pd.prefill, nil
				}
				lastErr = lerr
				break
			}
		}
		if err == nil {
			code := resp.StatusCode()
			a.answered(code)
			pd.decodeAnswered(code)
			if !retry || !retryable(code) && !(pd.split && code >= 500) || !s.allowRetry() {
				if code >= 500 {
					ep.ReportFailure()
				} else if code != fasthttp.StatusTooManyRequests {
					ep.ReportSuccess()
				}
				st.att = a
				if pd.split {
					s.strand(st, "decode_failed") // unless this leg took it
				} else {
					s.strand(st, "superseded")
				}
				return resp, d, nil
			}
			s.discard(resp, a)
			err, kindLabel = &statusError{endpoint: ep.URL, code: code}, "status"
			if code >= 500 {
				ep.ReportFailure()
			}
		} else {
			s.opt.Logger.Debug("upstream attempt failed", zap.String("endpoint", ep.URL), zap.Error(err))
			gone := a.clientGone()
			full := !gone && errors.Is(err, fasthttp.ErrNoFreeConns)
			// A decode leg that failed before its first byte is resent:
			// its prompt was computed elsewhere, so it had not started.
			retry = !gone && (full || retry && (neverSent(err, a) || pd.split) && s.allowRetry())
			switch {
			case gone:
				err, kindLabel = fmt.Errorf("%w: %v", ErrClientGone, err), "cancelled"
			case full:
				err, kindLabel = ErrOverloaded, "busy"
				busy = append(busy, ep)
			default:
				err, kindLabel = classifyUpstream(err)
				ep.ReportFailure()
			}
		}
		s.attempts.end(a)
		fasthttp.ReleaseResponse(resp)
		st.lease.Release()
		if leg != nil {
			leg.decodeEnd(false)
			pd.leg = nil
		}
		s.opt.Metrics.UpstreamError(kindLabel)
		lastErr = err
		if !retry {
			break
		}
		if kindLabel != "busy" {
			tries++
			s.opt.Metrics.Retry()
			time.Sleep(backoff(tries))
		}
	}
	if errors.Is(lastErr, ErrClientGone) {
		s.strand(st, "client_gone")
	} else {
		s.strand(st, "decode_failed")
	}
	return nil, routing.Decision{}, lastErr
}

// allowRetry reports whether the retry budget allows one more retry, and
// counts it.
func (s *Server) allowRetry() bool {
	if s.budget.allow() {
		return true
	}
	s.opt.Metrics.RetryDenied()
	return false
}

// saturated reports, once the policy found no endpoint usable for r,
// whether that is because routable endpoints are saturated — at r's
// in-flight cap (not yet tried), or out of connections (busy) — so that
// the request may wait for one, rather than because all failed it.
func saturated(set *discovery.Set, r *routing.Request, busy []*discovery.Endpoint) bool {
	for _, e := range set.Serving {
		if e.Routable() && e.Serves(r.Model) && (!slices.Contains(r.Tried, e) || slices.Contains(busy, e)) {
			return true
		}
	}
	return false
}

// wait holds a request while every routable endpoint is saturated: it
// takes a place in the queue on the first call (ErrOverloaded when the
// queue is full or disabled), then sleeps one poll; ErrOverloaded once the
// queue timeout has passed, ErrClientGone when the client left meanwhile.
func (s *Server) wait(ctx *fasthttp.RequestCtx, queued *time.Time) error {
	now := time.Now()
	if queued.IsZero() {
		if s.opt.QueueTimeout <= 0 || !s.queue.enter() {
			s.opt.Metrics.Overloaded()
			return ErrOverloaded
		}
		*queued = now
		s.opt.Metrics.Queued(1)
	}
	if now.Sub(*queued) >= s.opt.QueueTimeout {
		s.opt.Metrics.Overloaded()
		return ErrOverloaded
	}
	time.Sleep(queuePoll)
	if peerClosed(ctx.Conn()) {
		return ErrClientGone
	}
	return nil
}

// maxDiscard is the most of a retryable error answer's body read so its
// connection can be reused; discardTimeout bounds the reading. A larger or
// slower body closes the connection instead.
const (
	maxDiscard     = 64 << 10
	discardTimeout = time.Second
)

// discard drops a retryable answer's body: it reads at most maxDiscard of
// it within discardTimeout; closing the body then closes the connection
// unless the body was read whole. It ends the attempt first, since its
// connection may then carry another request.
func (s *Server) discard(resp *fasthttp.Response, a *attempt) {
	if rd := resp.BodyStream(); rd != nil {
		a.drainBy(time.Now().Add(discardTimeout))
		_, _ = io.CopyN(io.Discard, rd, maxDiscard)
	}
	s.attempts.end(a)
	_ = resp.CloseBodyStream()
}

// statusError is a retryable status on the last endpoint tried.
type statusError struct {
	endpoint string
	code     int
}

func (e *statusError) Error() string {
	return ErrUpstream.Error() + ": " + e.endpoint + " answered " + fasthttp.StatusMessage(e.code)
}

func (e *statusError) Unwrap() error { return ErrUpstream }

// retryable reports whether an endpoint's status means "try another one":
// it refused the request (overloaded, or not ready), so nothing was
// generated. A 502 or 504 may come from a sidecar in front of an engine
// that started the generation, and is passed on.
func retryable(code int) bool {
	return code == fasthttp.StatusTooManyRequests || code == fasthttp.StatusServiceUnavailable
}

// answer answers the request with kvroute's own error for err and records
// its end.
func (s *Server) answer(ctx *fasthttp.RequestCtx, st *reqState, err error, start time.Time) {
	status := writeError(ctx, err)
	switch {
	case errors.Is(err, ErrOverloaded):
		ctx.Response.Header.Set("Retry-After", "1")
	case errors.Is(err, ErrClientGone):
		ctx.SetConnectionClose()
	}
	s.answered(ctx, st, status, err, start)
}

// answered records the end of a request kvroute answered itself with
// status (err: why it failed, nil if it did not); the answer is written.
func (s *Server) answered(ctx *fasthttp.RequestCtx, st *reqState, status int, err error, start time.Time) {
	rec := record{class: int(st.req.Kind), status: status, attempts: len(st.req.Tried), start: start,
		reqID: ctx.Request.Header.PeekBytes(headerRequestID), method: ctx.Method(), path: ctx.Path(),
		model: []byte(st.req.Model), traceID: st.traceID}
	if len(rec.reqID) > 0 {
		ctx.Response.Header.SetBytesKV(headerRequestID, rec.reqID)
	}
	if s.draining.Load() {
		ctx.SetConnectionClose()
	}
	rec.span, st.span = st.span, nil
	s.end(&rec, err)
}

// record is what the end of a request reports: metrics, the failure log
// and the access log line. Byte slices are only read during end.
type record struct {
	class, status, attempts int
	start                   time.Time
	reqID, method, path     []byte
	model                   []byte     // the body's "model"
	traceID                 [32]byte   // hex, as the upstream traceparent carries it
	span                    trace.Span // with tracing: the request's span, ended by end
	ttfb                    time.Duration
	// The endpoint's answer; zero when kvroute answered itself.
	ep       *discovery.Endpoint
	decision routing.Decision
	bytes    int64
	// The prefix fields of the access log (inference requests the
	// learner follows), with the engine's usage report when it came.
	prefix                     bool
	usage                      bool
	promptTokens, cachedTokens int
	// Disaggregation: the decision, the prefill endpoint whose answer the
	// decode leg followed, when that answer came and when the decode leg
	// was sent (zero without a prefill leg).
	pdDecision      string
	prefill         *discovery.Endpoint
	prefilled, sent time.Time
}

// end records the end of a request, answered by an endpoint or by kvroute
// itself; err is why it failed (nil if it did not). It is the one place a
// request's end is recorded.
func (s *Server) end(r *record, err error) {
	d := time.Since(r.start)
	if r.span != nil {
		endRequestSpan(r, r.start.Add(d))
	}
	s.opt.Metrics.Request(r.class, r.status, r.model, d.Seconds())
	if k := routing.Kind(r.class); k == routing.KindCompletions || k == routing.KindChat || k == routing.KindResponses {
		s.opt.Metrics.RequestEnd(d.Seconds())
	}
	s.opt.Metrics.InFlight(-1)
	if r.ep == nil && r.status >= 500 && err != nil {
		s.opt.Logger.Warn("request failed", zap.ByteString("request_id", r.reqID),
			zap.ByteString("path", r.path), zap.Int("status", r.status), zap.Error(err))
	}
	if !s.opt.AccessLog || r.status < 400 && s.opt.AccessLogSkip > 0 && rand.Float64() < s.opt.AccessLogSkip {
		return
	}
	if !s.opt.Logger.Core().Enabled(zap.InfoLevel) {
		return // the logger drops Info lines: copy nothing
	}
	l := accessLine{at: r.start.Add(d), reqID: string(r.reqID), traceID: string(r.traceID[:]), method: string(r.method),
		path: string(r.path), model: string(r.model), status: r.status, attempts: r.attempts, duration: d, ttfb: r.ttfb,
		pd: r.pdDecision, prefix: r.prefix, home: r.decision.Home, matched: r.decision.MatchedBlocks, prefixKey: r.decision.PrefixKey,
		usage: r.usage, prompt: r.promptTokens, cached: r.cachedTokens}
	if r.ep != nil {
		l.endpoint, l.reason, l.bytes, l.uncached = r.ep.URL, r.decision.Reason, r.bytes, r.decision.Prefill
	}
	if r.prefill != nil {
		l.prefillEndpoint = r.prefill.URL
	}
	if !r.prefilled.IsZero() {
		l.prefill = r.prefilled.Sub(r.start)
	}
	if !r.sent.IsZero() {
		l.decode = d - r.sent.Sub(r.start)
	}
	s.access.add(l)
}

// commit hands the endpoint's response to the client: headers now, the body
// as a stream that fasthttp writes and flushes chunk by chunk. The body
// takes over the request's lease.
func (s *Server) commit(ctx *fasthttp.RequestCtx, st *reqState, d routing.Decision, resp *fasthttp.Response, reqID []byte, start time.Time) {
	// While shutting down, clients reconnect (through the load balancer,
	// elsewhere) rather than keep this connection.
	clientClose := ctx.Request.Header.ConnectionClose() || s.draining.Load()
	resp.Header.CopyTo(&ctx.Response.Header)
	h := &ctx.Response.Header
	removeHopHeaders(h)
	h.ResetConnectionClose()
	if clientClose {
		h.SetConnectionClose()
	}
	h.SetBytesKV(headerRequestID, reqID)

	b := s.bodies.Get().(*upstreamBody)
	b.s, b.resp, b.lease, b.att, b.leg = s, resp, st.lease.Take(), st.att, st.pd.leg
	st.att, st.pd.leg = nil, nil
	b.firstByte, b.readErr, b.last, b.tail, b.lastChunk = false, nil, 0, nil, time.Time{}
	// The engine's usage report (prompt and cached tokens) is read from
	// every inference answer, for the endpoint's calibration and, under a
	// learning policy, for the policy.
	b.scan = resp.StatusCode() == fasthttp.StatusOK &&
		(st.req.Kind == routing.KindCompletions || st.req.Kind == routing.KindChat || st.req.Kind == routing.KindResponses)
	// A decode leg's usage counts the pulled KV as cached: it says
	// nothing of what the endpoint held before.
	b.learn = b.scan && s.opt.Learner != nil && !st.pd.split
	b.promptBytes = st.req.PromptBytes
	b.cached.reset(patCachedTokens)
	b.prompt.reset(patPromptTokens)
	b.rec = record{class: int(st.req.Kind), status: resp.StatusCode(), attempts: len(st.req.Tried), start: start,
		reqID: append(b.rec.reqID[:0], reqID...), method: append(b.rec.method[:0], ctx.Method()...),
		path: append(b.rec.path[:0], ctx.Path()...), model: append(b.rec.model[:0], st.req.Model...), ep: d.Endpoint, decision: d, prefix: b.learn,
		pdDecision: st.pd.decision, prefilled: st.pd.answered, sent: st.pd.sent}
	b.rec.span, st.span, b.rec.traceID = st.span, nil, st.traceID
	if s.opt.Tokenizer != nil && b.scan && !st.pd.split && st.prompts == 1 && st.tokens == 0 &&
		st.req.Kind != routing.KindResponses && d.Endpoint != nil {
		s.opt.Tokenizer.Offer(d.Endpoint, adapterOf(d.Endpoint, st.req.Model), st.req.Hashes, st.req.PromptBytes, ctx.PostBody())
	}
	if st.pd.split || d.Endpoint != nil && d.Endpoint.Role == discovery.RolePrefill {
		b.rec.prefill = st.pd.prefill.Endpoint
	}

	// A streamed answer's first byte is its first token: the lease makes
	// it a TTFT observation of the endpoint's costs, unless a prefill leg
	// computed the prompt.
	b.stream = resp.StatusCode() == fasthttp.StatusOK && isEventStream(resp)
	b.observe = b.stream && !st.pd.split
	rd := resp.BodyStream()
	if rd == nil { // HEAD, 204, 304: no body
		b.markFirstByte()
		b.rd = eofReader{}
		ctx.Response.SetBodyStream(b, 0)
		return
	}
	b.rd = rd
	size := resp.Header.ContentLength()
	if size < 0 || isEventStream(resp) {
		if !ctx.Request.Header.IsHTTP11() {
			s.closeDelimited(ctx, b)
			return
		}
		// Unknown length or SSE: chunked to the client, headers flushed at
		// once and every chunk flushed as it arrives.
		size = -1
		ctx.Response.ImmediateHeaderFlush = true
	}
	ctx.Response.SetBodyStream(b, size)
}

// closeDelimited sends b to an HTTP/1.0 client, which cannot read a
// chunked body: the header without a length, then the body as it arrives,
// then the end of the connection (RFC 9112 §6.3). fasthttp always chunks a
// body of unknown length, so the connection is taken over once the handler
// returns.
func (s *Server) closeDelimited(ctx *fasthttp.RequestCtx, b *upstreamBody) {
	h := &ctx.Response.Header
	h.SetContentLength(-2) // no length, no chunking
	h.SetConnectionClose()
	head := append([]byte(nil), h.Header()...)
	ctx.HijackSetNoResponse(true)
	s.hijacked.Add(1)
	ctx.Hijack(func(c net.Conn) {
		defer s.hijacked.Done()
		_, err := c.Write(head)
		buf := make([]byte, 16<<10)
		for err == nil {
			var n int
			n, err = b.Read(buf)
			if n > 0 {
				if _, werr := c.Write(buf[:n]); werr != nil {
					err = werr
					break
				}
			}
		}
		if err == io.EOF || b.readErr != nil {
			err = nil // the end, or the endpoint's failure that CloseWithError reports
		}
		_ = b.CloseWithError(err)
	})
}

func isEventStream(resp *fasthttp.Response) bool {
	ct := resp.Header.ContentType()
	return len(ct) >= 17 && string(ct[:17]) == "text/event-stream"
}

// upstreamBody is the response body handed to fasthttp: it reads the
// endpoint's stream, notes the first byte, and on close releases the
// endpoint's connection and lease and records the request. It never
// touches the RequestCtx, which fasthttp may have reset by then.
type upstreamBody struct {
	s           *Server
	resp        *fasthttp.Response
	rd          io.Reader
	lease       discovery.Lease
	att         *attempt
	rec         record
	scan        bool // scan the body for the engine's usage
	learn       bool // and report it to the Learner
	cached      numScanner
	prompt      numScanner
	promptBytes int
	stream      bool // a 200 SSE response
	observe     bool // whose first byte is an observation of the endpoint's TTFT
	leg         *sgLeg
	firstByte   bool
	lastChunk   time.Time // a stream's last chunk (for the gaps between chunks)
	readErr     error
	last        uint32 // the last two bytes read (whether an event ended there)
	tail        []byte // after a cut: the error event still to send (empty, not nil, once sent)
}

// Read implements io.Reader.
func (b *upstreamBody) Read(p []byte) (int, error) {
	if b.tail != nil { // the error event that ends a cut stream, then the end
		n := copy(p, b.tail)
		if b.tail = b.tail[n:]; len(b.tail) == 0 {
			return n, io.EOF
		}
		return n, nil
	}
	n, err := b.rd.Read(p)
	if n > 0 {
		if !b.firstByte {
			b.markFirstByte()
		}
		if b.stream {
			now := time.Now()
			if !b.lastChunk.IsZero() {
				b.s.opt.Metrics.ChunkGap(now.Sub(b.lastChunk).Seconds())
			}
			b.lastChunk = now
		}
		b.rec.bytes += int64(n)
		if b.scan {
			b.cached.feed(p[:n])
			b.prompt.feed(p[:n])
		}
		if n > 1 {
			b.last = uint32(p[n-2])<<8 | uint32(p[n-1])
		} else {
			b.last = (b.last&0xff)<<8 | uint32(p[0])
		}
	}
	if err != nil && err != io.EOF {
		b.readErr = err
		if b.stream && !b.att.clientGone() {
			// An event stream the endpoint cut ends, as vLLM ends a stream
			// that failed, with an error event and [DONE]: clients see an
			// error, not a stream that may look complete.
			b.tail = streamCutEvent(b.last&0xffff != '\n'<<8|'\n')
			return n, nil
		}
	}
	return n, err
}

// streamCutEvent is the end of an event stream the endpoint cut; sep
// first ends the event the cut left incomplete.
func streamCutEvent(sep bool) []byte {
	var e []byte
	if sep {
		e = append(e, "\n\n"...)
	}
	return append(e, `data: {"error":{"message":"the model server's stream ended early","type":"BadGatewayError","param":null,"code":"upstream_stream_cut"}}`+"\n\ndata: [DONE]\n\n"...)
}

// markFirstByte records the first response byte: the endpoint has computed
// the prompt, so the lease's pending prefill ends.
func (b *upstreamBody) markFirstByte() {
	b.firstByte = true
	b.lease.FirstByte(b.observe)
	now := time.Now()
	b.rec.ttfb = now.Sub(b.rec.start)
	b.s.opt.Metrics.FirstByte(b.rec.class, b.rec.ttfb.Seconds())
	if !b.rec.sent.IsZero() {
		prefilled := b.rec.prefilled
		if b.leg != nil {
			prefilled = b.rec.sent // the legs run together
		}
		b.s.opt.Metrics.DecodeFirstByte(now.Sub(b.rec.sent).Seconds(), now.Sub(prefilled).Seconds())
	}
}

// CloseWithError is called by fasthttp exactly once when the body is done:
// err is nil after a complete write, or the write error when the client went
// away. An unfinished upstream stream is closed, so the engine sees the
// disconnect and stops generating.
func (b *upstreamBody) CloseWithError(err error) error {
	s, ep := b.s, b.rec.ep
	s.attempts.end(b.att) // before the connection goes back to the pool
	_ = b.resp.CloseBodyStream()
	fasthttp.ReleaseResponse(b.resp)
	if b.leg != nil {
		b.leg.decodeEnd(err == nil && b.readErr == nil && b.rec.status == fasthttp.StatusOK)
	}
	if b.att.clientGone() {
		// The watcher closed the upstream connection for a client that left.
		b.readErr, err = nil, ErrClientGone
	}
	if err == nil && b.readErr == nil {
		computed := discovery.Uncomputed
		if b.scan && b.cached.Found && b.prompt.Found {
			computed = max(0, b.prompt.Value-b.cached.Value)
		}
		b.lease.Complete(computed)
	} else {
		b.lease.Release()
	}
	switch {
	case b.readErr != nil:
		if !b.att.wasAborted() { // not the endpoint's fault when kvroute cut it
			ep.ReportFailure()
		}
		s.opt.Metrics.UpstreamError("body")
		s.opt.Logger.Warn("upstream body failed", zap.ByteString("request_id", b.rec.reqID),
			zap.String("endpoint", ep.URL), zap.Error(b.readErr))
	case err != nil:
		b.rec.status = StatusClientClosedRequest
		s.opt.Logger.Info("client closed the connection", zap.ByteString("request_id", b.rec.reqID),
			zap.String("endpoint", ep.URL), zap.Int64("bytes", b.rec.bytes), zap.NamedError("cause", err))
	}
	if b.learn && err == nil && b.readErr == nil && b.cached.Found {
		est := s.opt.Learner.Learn(b.rec.decision, b.promptBytes, b.prompt.Value, b.cached.Value)
		s.opt.Metrics.CacheReport(est, b.cached.Value)
		b.rec.usage, b.rec.promptTokens, b.rec.cachedTokens = true, b.prompt.Value, b.cached.Value
	}
	s.end(&b.rec, err)
	b.resp, b.rd, b.readErr, b.att, b.leg = nil, nil, nil, nil, nil
	b.rec.ep, b.rec.decision = nil, routing.Decision{}
	s.bodies.Put(b)
	return nil
}

type eofReader struct{}

func (eofReader) Read([]byte) (int, error) { return 0, io.EOF }

var (
	headerTraceparent    = []byte("traceparent")
	headerTracestate     = []byte("tracestate")
	headerRequestID      = []byte("X-Request-Id")
	headerForwardedFor   = []byte("X-Forwarded-For")
	headerForwardedProto = []byte("X-Forwarded-Proto")
)

// hopHeaders are RFC 9110 §7.6.1's connection-specific fields (plus the
// legacy Keep-Alive and Proxy-Connection). fasthttp manages Connection,
// Transfer-Encoding and Content-Length itself.
var hopHeaders = [...]string{
	"Keep-Alive", "Proxy-Connection", "Proxy-Authenticate", "Proxy-Authorization",
	"TE", "Trailer", "Upgrade",
}

type headerDeleter interface {
	Peek(key string) []byte
	Del(key string)
}

// removeHopHeaders deletes hop-by-hop fields, including those named by the
// Connection field.
func removeHopHeaders(h headerDeleter) {
	if c := h.Peek("Connection"); len(c) > 0 {
		for _, tok := range splitTokens(c) {
			if !equalFoldASCII(tok, "close") && !equalFoldASCII(tok, "keep-alive") && !framing(tok) {
				h.Del(string(tok))
			}
		}
	}
	for _, k := range hopHeaders {
		h.Del(k)
	}
}

// framing reports whether a Connection token names a field that frames or
// addresses the message, which a client may not have removed: kvroute sets
// Host itself, and fasthttp owns the rest.
func framing(tok []byte) bool {
	for _, f := range [...]string{"host", "content-length", "transfer-encoding", "content-type", "connection"} {
		if equalFoldASCII(tok, f) {
			return true
		}
	}
	return false
}

// prepareRequest applies header hygiene to the request sent upstream and
// returns its request id (generated when the client sent none).
func (s *Server) prepareRequest(ctx *fasthttp.RequestCtx) []byte {
	h := &ctx.Request.Header
	removeHopHeaders(h)
	h.ResetConnectionClose() // the client's connection choice is not the endpoint's

	var buf [64]byte
	xff := append(buf[:0], h.PeekBytes(headerForwardedFor)...)
	if len(xff) > 0 {
		xff = append(xff, ", "...)
	}
	if ap, ok := netip.AddrFromSlice(ctx.RemoteIP()); ok {
		xff = ap.Unmap().AppendTo(xff)
	}
	h.SetBytesKV(headerForwardedFor, xff)
	if ctx.IsTLS() {
		h.SetBytesKV(headerForwardedProto, []byte("https"))
	} else {
		h.SetBytesKV(headerForwardedProto, []byte("http"))
	}
	if id := h.PeekBytes(headerRequestID); len(id) > 0 {
		return id
	}
	id := s.newRequestID(buf[:0])
	h.SetBytesKV(headerRequestID, id)
	return h.PeekBytes(headerRequestID)
}

// newRequestID appends a process-unique id: 8 random hex digits fixed at
// start-up, then a 16-hex-digit sequence number.
func (s *Server) newRequestID(dst []byte) []byte {
	dst = append(dst, s.idPrefix[:]...)
	dst = append(dst, '-')
	return appendHex16(dst, s.idSeq.Add(1))
}

// client returns the endpoint's HostClient, creating it on first use.
func (s *Server) client(ep *discovery.Endpoint) *fasthttp.HostClient {
	if c, ok := s.clients.Load(ep); ok {
		return c.(*fasthttp.HostClient)
	}
	hc := &fasthttp.HostClient{
		Addr:                          ep.Addr,
		IsTLS:                         ep.TLS,
		NoDefaultUserAgentHeader:      true,
		DisablePathNormalizing:        true,
		DisableHeaderNamesNormalizing: false,
		MaxConns:                      s.opt.MaxConnsPerEndpoint,
		MaxIdleConnDuration:           s.opt.UpstreamIdleTimeout,
		StreamResponseBody:            true,
		ReadBufferSize:                16 << 10,
		Dial:                          s.dial,
		RetryIfErr: func(_ *fasthttp.Request, attempts int, err error) (bool, bool) {
			// A pooled keep-alive connection the endpoint had closed, found
			// so before writing (timedConn.Write): nothing was sent, so
			// resend once on a new one. A connection closed after the
			// request went out is not resent: the engine may have started.
			return false, attempts < 2 && errors.Is(err, errStaleConn)
		},
	}
	c, _ := s.clients.LoadOrStore(ep, hc)
	return c.(*fasthttp.HostClient)
}

// setUpstream points the upstream request at ep: its base path, then the
// client's request URI; its own Host (whatever the client sent, or
// failed to send); and a traceparent whose parent id is the attempt's
// span.
func (s *Server) setUpstream(req *fasthttp.Request, st *reqState, ep *discovery.Endpoint, span uint64) {
	u := append(st.scratch[:0], ep.BasePath...)
	u = append(u, st.uri...)
	req.SetRequestURIBytes(u)
	st.scratch = u
	req.UseHostHeader = true
	req.Header.SetHost(ep.Addr)
	tp := append(st.tp[:0], "00-"...)
	tp = append(tp, st.traceID[:]...)
	tp = append(tp, '-')
	tp = appendHex16(tp, span)
	tp = append(tp, '-')
	tp = append(tp, st.flags[:]...)
	req.Header.SetBytesKV(headerTraceparent, tp)
	st.tp = tp
}

// appendHex16 appends v as 16 lower-case hex digits.
func appendHex16(dst []byte, v uint64) []byte {
	const hex = "0123456789abcdef"
	for i := 15; i >= 0; i-- {
		dst = append(dst, hex[(v>>(4*uint(i)))&15])
	}
	return dst
}

// traceContext sets st's trace id and flags from the client's W3C
// traceparent when it is a valid version-00 one, else to a new trace
// (flags 00: not sampled). tracestate passes through untouched.
func (st *reqState) traceContext(tp []byte) (valid bool) {
	// 00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>
	if len(tp) == 55 && tp[0] == '0' && tp[1] == '0' && tp[2] == '-' && tp[35] == '-' && tp[52] == '-' &&
		isHex(tp[3:35]) && isHex(tp[36:52]) && isHex(tp[53:55]) &&
		!allZero(tp[3:35]) && !allZero(tp[36:52]) {
		copy(st.traceID[:], tp[3:35])
		copy(st.flags[:], tp[53:55])
		return true
	}
	t := appendHex16(appendHex16(st.tp[:0], rand.Uint64()), rand.Uint64()|1)
	copy(st.traceID[:], t)
	st.flags = [2]byte{'0', '0'}
	return false
}

func isHex(b []byte) bool {
	for _, c := range b {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != '0' {
			return false
		}
	}
	return true
}

// prune drops clients of endpoints that left the Set; their open streams
// keep the HostClient they started with.
func (s *Server) prune(set *discovery.Set) {
	old := s.pruned.Load()
	if !s.pruned.CompareAndSwap(old, set.Version) {
		return
	}
	present := make(map[*discovery.Endpoint]bool, len(set.Endpoints))
	for _, e := range set.Endpoints {
		present[e] = true
	}
	s.clients.Range(func(k, v any) bool {
		if !present[k.(*discovery.Endpoint)] {
			s.clients.Delete(k)
			v.(*fasthttp.HostClient).CloseIdleConnections()
		}
		return true
	})
}

// dial connects to an endpoint within ConnectTimeout and wraps the
// connection in a timedConn: response-header and stream-idle timeouts per
// request rather than one deadline over a whole stream, and the link to
// the request's attempt.
func (s *Server) dial(addr string) (net.Conn, error) {
	var c net.Conn
	var err error
	if s.opt.ConnectTimeout > 0 {
		c, err = fasthttp.DialTimeout(addr, s.opt.ConnectTimeout)
	} else {
		c, err = fasthttp.Dial(addr)
	}
	if err != nil {
		return nil, err
	}
	return &timedConn{Conn: c, as: &s.attempts, header: s.opt.ResponseHeaderTimeout, idle: s.opt.StreamIdleTimeout}, nil
}

// answerModels answers GET /v1/models with the union of the model lists
// of the routable serving endpoints (clients call it before anything
// else, and any one endpoint lists only its own); false when no endpoint's
// list is known yet, and the request goes to an endpoint as any other.
func (s *Server) answerModels(ctx *fasthttp.RequestCtx, st *reqState, start time.Time) bool {
	list, ok := s.opt.Pool.Load().Models()
	if !ok {
		return false
	}
	if list == nil {
		list = []discovery.Model{}
	}
	b, err := json.Marshal(struct {
		Object string            `json:"object"`
		Data   []discovery.Model `json:"data"`
	}{"list", list})
	if err != nil {
		return false
	}
	ctx.SetStatusCode(fasthttp.StatusOK)
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
	s.answered(ctx, st, fasthttp.StatusOK, nil, start)
	return true
}

// nearMissMemory is how many normalised blocks the detector remembers
// (16 bytes each in the LRU, plus its list: ≈ 5 MB).
const nearMissMemory = 1 << 16

// nearMissLogEvery bounds the near-miss log lines to one per interval.
const nearMissLogEvery = 10 * time.Second

// checkNearMiss runs the near-identical prompt detector on st's parsed
// prompt: a normalised prefix seen before with other bytes is counted, by
// model, and a sample logged with where the bytes first differ (never the
// text).
func (s *Server) checkNearMiss(st *reqState, reqID []byte) {
	n := &st.norm
	depth, exact, offset := s.near.Observe(n.Hashes(), n.Raw, n.Offsets)
	if exact >= depth {
		return
	}
	s.opt.Metrics.NearMiss([]byte(st.req.Model))
	now := time.Now().UnixNano()
	if last := s.nearLog.Load(); now-last >= int64(nearMissLogEvery) && s.nearLog.CompareAndSwap(last, now) {
		s.opt.Logger.Info("near-identical prompt prefix: the same text up to whitespace, line endings or a byte-order mark, other bytes",
			zap.ByteString("request_id", reqID), zap.String("model", st.req.Model),
			zap.Int("normalised_blocks_matched", depth), zap.Int("exact_blocks_matched", exact),
			zap.Int("first_difference_block_offset", offset))
	}
}
