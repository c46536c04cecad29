package proxy

import (
	"bytes"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute/routing"
)

// handle serves one client request.
func (s *Server) handle(ctx *fasthttp.RequestCtx) {
	start := time.Now()
	st := s.states.Get().(*reqState)
	st.reset()
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
	st.tenant = s.tenantOf(&ctx.Request.Header)
	if !s.classOfHeader(&ctx.Request.Header, st) {
		s.answer(ctx, st, &badRequestError{msg: "the priority header must be priority, default or flex"}, start)
		return
	}
	if kind != routing.KindOther {
		if err := s.chargeBudget(st); err != nil {
			s.answer(ctx, st, err, start)
			return
		}
		s.passPriority(ctx, st)
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
