package proxy

import (
	"bytes"
	"fmt"
	"time"

	"github.com/valyala/fasthttp"
	"github.com/valyala/fastjson"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

// vLLM's NixlConnector protocol (pd.go): the prefill leg first, then the
// decode leg with the prefill answer's kv_transfer_params.

// vllmHandoff is vLLM's protocol.
type vllmHandoff struct{}

func (vllmHandoff) prefillOnly() bool { return false }

// prefill: a reference already obtained serves one more decode endpoint
// (the first failed before its first byte); otherwise prefill endpoints
// are tried in turn (a connection error, a 5xx or 429 or the prefill
// timeout moves to another, within --retries), and when none answers, or
// the answer has no reference, the decode endpoint computes the prompt
// alone. A 4xx answer is the request's answer, returned with st.lease
// holding the prefill endpoint's lease.
func (vllmHandoff) prefill(s *Server, ctx *fasthttp.RequestCtx, st *reqState, set *discovery.Set) (*fasthttp.Response, error) {
	p := &st.pd
	if len(p.ref) > 0 && p.refUses < 2 && !p.delivered {
		s.setDecodeBody(ctx, st)
		return nil, nil
	}
	s.strand(st, strandDecodeFailed) // two decode legs failed with it
	body := s.vllmPrefillBody(st)
	for tries := 0; tries <= s.opt.Retries; tries++ {
		pd := s.pickPrefill(st, set)
		pe := pd.Endpoint
		if pe == nil {
			break
		}
		lease := pe.Acquire(pd.Prefill)
		a := s.beginAttempt(st, ctx.Conn(), "kvroute.prefill", pe)
		req := s.legRequest(ctx, st, pe, a.id, body)
		resp, took, err := s.sendPrefill(req, pe, a)
		fasthttp.ReleaseRequest(req)
		switch code := statusOrZero(resp); {
		case err != nil && a.clientGone():
			lease.Release()
			return nil, fmt.Errorf("%w: during the prefill leg: %v", ErrClientGone, err)
		case err != nil || code >= 500 || code == fasthttp.StatusTooManyRequests:
			lease.Release()
			st.req.Tried = append(st.req.Tried, pe)
			if code != fasthttp.StatusTooManyRequests {
				pe.ReportFailure()
			}
			s.opt.Logger.Warn("prefill leg failed", zap.ByteString("request_id", ctx.Request.Header.PeekBytes(headerRequestID)),
				zap.String("endpoint", pe.URL), zap.Int("status", code), zap.Error(err))
			s.opt.Metrics.UpstreamError(failPrefill)
			if resp != nil {
				fasthttp.ReleaseResponse(resp)
			}
			continue
		case code >= 400:
			// The client's mistake (an unknown model, a context overflow):
			// its answer, as the engine gave it.
			pe.ReportSuccess()
			lease.FirstByte(false)
			st.lease.Release()
			st.lease, p.prefill = lease, pd
			resp.SetBodyStream(bytes.NewReader(resp.Body()), len(resp.Body()))
			return resp, nil
		default:
			pe.ReportSuccess()
			lease.FirstByte(true) // the answer came once the prompt was computed
			prompt, cached := s.extractRef(st, resp.Body())
			computed := discovery.Uncomputed
			if prompt > 0 && cached >= 0 {
				computed = max(0, prompt-cached)
				if s.opt.Learner != nil {
					// The prefill pod's report is about its own cache (a
					// decode leg's counts the pulled KV as cached).
					s.opt.Learner.Learn(pd, st.req.PromptBytes, prompt, cached)
				}
			}
			lease.Complete(computed)
			fasthttp.ReleaseResponse(resp)
			p.prefilled, p.prefill = time.Now(), pd
			s.opt.Metrics.PrefillLeg(took.Seconds(), p.prefilled.Sub(p.start).Seconds())
			if len(p.ref) == 0 {
				p.decision, p.split = routing.PDNoReference, false
			}
			s.setDecodeBody(ctx, st)
			return nil, nil
		}
	}
	p.decision, p.split = routing.PDNoPrefill, false
	if st.req.Tried[len(st.req.Tried)-1].Role == discovery.RolePrefill {
		p.decision = routing.PDPrefillFailed // the last one tried failed
	}
	s.opt.Logger.Info("decode endpoint computes the prompt alone", zap.ByteString("request_id", ctx.Request.Header.PeekBytes(headerRequestID)),
		zap.String("cause", p.decision))
	s.setDecodeBody(ctx, st)
	return nil, nil
}

// vllmPrefillBody returns the prefill leg's body: the client's, with
// kv_transfer_params asking for a remote decode, no stream, one token
// (REFERENCE: vLLM's toy proxy). It edits st.root, which is not read
// again.
func (s *Server) vllmPrefillBody(st *reqState) []byte {
	a, v := &st.pd.arena, st.root
	kv := a.NewObject()
	kv.Set("do_remote_decode", a.NewTrue())
	kv.Set("do_remote_prefill", a.NewFalse())
	for _, k := range [...]string{"remote_engine_id", "remote_block_ids", "remote_host", "remote_port"} {
		kv.Set(k, a.NewNull())
	}
	v.Set("kv_transfer_params", kv)
	v.Set("stream", a.NewFalse())
	v.Del("stream_options")
	one := a.NewNumberInt(1)
	v.Set("max_tokens", one)
	if v.Exists("max_completion_tokens") {
		v.Set("max_completion_tokens", one)
	}
	v.Del("min_tokens")
	v.Del("min_completion_tokens")
	st.pd.body = v.MarshalTo(st.pd.body[:0])
	return st.pd.body
}

// extractRef keeps the prefill answer's kv_transfer_params in st.pd.ref
// (empty when absent or null) and returns its usage's prompt tokens (0
// when absent) and cached tokens (-1 when absent).
func (s *Server) extractRef(st *reqState, answer []byte) (prompt, cached int) {
	p := &st.pd
	p.ref, p.refUses, p.delivered = p.ref[:0], 0, false
	v, err := p.parser.ParseBytes(answer)
	if err != nil {
		return 0, -1
	}
	if kv := v.Get("kv_transfer_params"); kv != nil && kv.Type() != fastjson.TypeNull {
		// MarshalTo writes strings and numbers as the engine wrote them.
		p.ref = kv.MarshalTo(p.ref)
	}
	cached = -1
	if c := v.Get("usage", "prompt_tokens_details", "cached_tokens"); c != nil && c.Type() == fastjson.TypeNumber {
		cached = c.GetInt()
	}
	return v.GetInt("usage", "prompt_tokens"), cached
}

// setDecodeBody puts the decode leg's body on ctx.Request: the client's,
// with the reference when there is one (vLLM), else as it came.
func (s *Server) setDecodeBody(ctx *fasthttp.RequestCtx, st *reqState) {
	p := &st.pd
	if !p.split || len(p.ref) == 0 {
		ctx.Request.SetBody(p.orig)
		return
	}
	p.refUses++
	p.body = appendMembers(p.body[:0], p.orig, func(b []byte) []byte {
		b = append(b, `"kv_transfer_params":`...)
		return append(b, p.ref...)
	})
	ctx.Request.SetBody(p.body)
}
