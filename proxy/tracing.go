package proxy

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"math/rand/v2"
	"net"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

// Tracing. Every upstream request carries a W3C traceparent: the client's
// trace (or a new one), with the attempt's own span id as the parent id, so
// an engine's spans join the client's trace. With --otlp-endpoint, kvroute
// also exports its own spans over OTLP/HTTP: one server span per request
// ("kvroute.request", its parent the client's traceparent), and under it a
// "kvroute.pick" span per routing decision and a client span per upstream
// attempt ("kvroute.upstream", or "kvroute.prefill" and "kvroute.decode"
// for the legs of a disaggregated request) whose span id is the parent id
// its traceparent carries. Without an endpoint no span is made.

// startSpan starts the request's span, its parent the client's traceparent
// tp when valid (with its tracestate), and makes the upstream legs carry
// the span's trace and sampling decision.
func (s *Server) startSpan(st *reqState, tp, tracestate []byte, valid bool, method, path []byte) {
	parent := context.Background()
	if valid {
		var cfg trace.SpanContextConfig
		_, _ = hex.Decode(cfg.TraceID[:], tp[3:35])
		_, _ = hex.Decode(cfg.SpanID[:], tp[36:52])
		var f [1]byte
		_, _ = hex.Decode(f[:], tp[53:55])
		cfg.TraceFlags, cfg.Remote = trace.TraceFlags(f[0]), true
		if len(tracestate) > 0 {
			cfg.TraceState, _ = trace.ParseTraceState(string(tracestate))
		}
		parent = trace.ContextWithRemoteSpanContext(parent, trace.NewSpanContext(cfg))
	}
	ctx, span := s.opt.Tracer.Start(parent, "kvroute.request", trace.WithSpanKind(trace.SpanKindServer),
		trace.WithAttributes(attribute.String("http.request.method", string(method)), attribute.String("url.path", string(path))))
	st.tctx, st.span = ctx, span
	sc := span.SpanContext()
	tid := sc.TraceID()
	hex.Encode(st.traceID[:], tid[:])
	st.flags = [2]byte{'0', '0'}
	if sc.IsSampled() {
		st.flags[1] = '1'
	}
}

// beginAttempt registers an upstream attempt of st on ep; with tracing, it
// is a child span of the request named name, whose span id is the
// attempt's id (the parent id of its traceparent).
func (s *Server) beginAttempt(st *reqState, client net.Conn, name string, ep *discovery.Endpoint) *attempt {
	if st.span == nil {
		return s.attempts.begin(client, 0, ep, nil)
	}
	_, span := s.opt.Tracer.Start(st.tctx, name, trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("server.address", ep.Addr), attribute.String("kvroute.endpoint", ep.URL),
			attribute.String("kvroute.role", ep.Role.String())))
	sid := span.SpanContext().SpanID()
	return s.attempts.begin(client, binary.BigEndian.Uint64(sid[:]), ep, span)
}

// traceStatus records an attempt's HTTP status on its span (nothing
// without tracing).
func (a *attempt) traceStatus(code int) {
	if a.span != nil {
		a.span.SetAttributes(attribute.Int("http.response.status_code", code))
		if code >= 500 {
			a.span.SetStatus(codes.Error, "")
		}
	}
}

// endSpan ends an attempt's span; failed marks it as an error.
func (a *attempt) endSpan(failed bool) {
	if a.span == nil {
		return
	}
	if failed {
		a.span.SetStatus(codes.Error, "")
	}
	a.span.End()
	a.span = nil
}

// pickSpan starts a span for one routing decision (nil without tracing);
// endPick ends it with the decision.
func (s *Server) pickSpan(st *reqState) trace.Span {
	if st.span == nil {
		return nil
	}
	_, span := s.opt.Tracer.Start(st.tctx, "kvroute.pick")
	return span
}

func endPick(span trace.Span, d routing.Decision, prefill bool) {
	if span == nil {
		return
	}
	attrs := []attribute.KeyValue{attribute.String("kvroute.reason", d.Reason), attribute.Bool("kvroute.prefill_pool", prefill)}
	if d.Endpoint != nil {
		attrs = append(attrs, attribute.String("kvroute.endpoint", d.Endpoint.URL),
			attribute.Int("kvroute.matched_blocks", d.MatchedBlocks), attribute.Bool("kvroute.home", d.Home))
	}
	span.SetAttributes(attrs...)
	span.End()
}

// endRequestSpan ends the request's span with its outcome.
func endRequestSpan(r *record, at time.Time) {
	span := r.span
	r.span = nil
	attrs := []attribute.KeyValue{attribute.Int("http.response.status_code", r.status), attribute.Int("kvroute.attempts", r.attempts)}
	if r.ep != nil {
		attrs = append(attrs, attribute.String("kvroute.endpoint", r.ep.URL), attribute.String("kvroute.reason", r.decision.Reason))
	}
	if r.pdDecision != "" {
		attrs = append(attrs, attribute.String("kvroute.pd", r.pdDecision))
	}
	if len(r.model) > 0 {
		attrs = append(attrs, attribute.String("gen_ai.request.model", string(r.model)))
	}
	span.SetAttributes(attrs...)
	if r.status >= 500 {
		span.SetStatus(codes.Error, "")
	}
	span.End(trace.WithTimestamp(at))
}

// attemptSpanName names an attempt's span by the endpoint's pool.
func attemptSpanName(ep *discovery.Endpoint) string {
	if ep.Role == discovery.RoleDecode {
		return "kvroute.decode"
	}
	return "kvroute.upstream"
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
