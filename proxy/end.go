package proxy

import (
	"errors"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/valyala/fasthttp"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

// answer answers the request with kvroute's own error for err and records
// its end.
func (s *Server) answer(ctx *fasthttp.RequestCtx, st *reqState, err error, start time.Time) {
	status := writeError(ctx, err)
	var rl *rateLimitError
	var shed *overloadedError
	switch {
	case errors.As(err, &rl):
		ctx.Response.Header.Set("Retry-After", strconv.Itoa(rl.retryAfterSeconds()))
		s.opt.Metrics.TenantShed(s.tenantLabel(st.tenant), st.class.String(), "rate_limit")
	case errors.As(err, &shed):
		ctx.Response.Header.Set("Retry-After", strconv.Itoa(shed.retry))
	case errors.Is(err, ErrOverloaded):
		ctx.Response.Header.Set("Retry-After", "1")
	case errors.Is(err, ErrClientGone):
		ctx.SetConnectionClose()
	}
	s.endOwnAnswer(ctx, st, status, err, start)
}

// endOwnAnswer records the end of a request kvroute answered itself with
// status (err: why it failed, nil if it did not); the answer is written.
func (s *Server) endOwnAnswer(ctx *fasthttp.RequestCtx, st *reqState, status int, err error, start time.Time) {
	rec := record{class: int(st.req.Kind), status: status, attempts: len(st.req.Tried), start: start,
		reqID: ctx.Request.Header.PeekBytes(headerRequestID), method: ctx.Method(), path: ctx.Path(),
		model: []byte(st.req.Model), traceID: st.traceID}
	st.stamp(&rec)
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
	fails                   []byte // the kinds of the attempts that failed, comma-separated
	start                   time.Time
	reqID, method, path     []byte
	model                   []byte     // the body's "model"
	traceID                 [32]byte   // hex, as the upstream traceparent carries it
	span                    trace.Span // with tracing: the request's span, ended by end
	ttfb                    time.Duration
	migrations              int // times the streamed answer continued on another endpoint
	// Who asked (a hash; 0 the default tenant), the class, and how long
	// the request waited in the queue.
	tenant uint64
	tier   class
	queued time.Duration
	held   time.Duration // its wait for a busy copy of its prompt
	// admitted: it went to the fleet, its tenant labelled label; charge:
	// its tenant's budget, settled at the end to spent, the tokens the
	// engine reported (-1: none).
	admitted bool
	label    string
	charge   budgetCharge
	spent    int
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
	if r.admitted {
		s.opt.Metrics.TenantInFlight(r.label, -1)
		s.queue.runs.ended(flowOf(r.tenant, r.tier))
	}
	s.budgets.settle(&r.charge, r.ep != nil, r.spent)
	s.queue.freed() // its endpoint's place (if it had one), and its tenant's, are free now
	if r.ep == nil && r.status >= 500 && err != nil {
		s.opt.Logger.Warn("request failed", zap.ByteString("request_id", r.reqID),
			zap.ByteString("path", r.path), zap.Int("status", r.status), zap.Error(err))
	}
	if s.opt.AccessLog == nil || r.status < 400 && s.opt.AccessLogSkip > 0 && rand.Float64() < s.opt.AccessLogSkip {
		return
	}
	s.access.add(r, d)
}

// stamp notes st's tenant, class and queue wait in r.
func (st *reqState) stamp(r *record) {
	r.tenant, r.tier, r.queued, r.held = st.tenant, st.class, 0, st.held
	r.admitted, r.label, r.charge, r.spent = st.admitted, st.label, st.charge, -1
	r.fails = append(r.fails[:0], st.fails...)
	if w := &st.wait; !w.since.IsZero() {
		r.queued = time.Since(w.since)
		if st.admitted {
			r.queued = st.waited
		}
	}
}
