package proxy

import (
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/valyala/fasthttp"
	"github.com/valyala/fastjson"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

// Prefill/decode disaggregation. A request picked onto a decode endpoint
// (routing.Request groups decode endpoints with the mixed ones: both
// answer clients) may get a prefill leg on a prefill endpoint first:
//
//   - vLLM's NixlConnector protocol (sequential; the toy proxy of vLLM's
//     tests/v1/kv_connector/nixl_integration and llm-d's routing sidecar
//     drive it the same way): the client's body with
//     kv_transfer_params {do_remote_decode: true, ...}, stream false and
//     one token goes to the prefill endpoint; its answer's
//     kv_transfer_params, passed on as the engine wrote it, goes into the
//     client's own body for the decode leg, whose answer the client gets.
//   - SGLang's bootstrap protocol (concurrent; SGLang's PD router and
//     llm-d's sidecar with --connector=sglang): bootstrap_host,
//     bootstrap_port and a random bootstrap_room are added to the client's
//     body, which goes to the prefill and the decode endpoint at once; the
//     engines meet in the room and move the KV; the client gets the
//     decode answer, and the prefill answer is only checked for errors.

// Handoff protocols (--pd-protocol).
const (
	ProtocolVLLM   = "vllm"
	ProtocolSGLang = "sglang"
)

// PDOptions configure prefill/decode disaggregation. They matter only when
// the Set has decode endpoints.
type PDOptions struct {
	// Protocol is ProtocolVLLM (the default) or ProtocolSGLang.
	Protocol string
	// Decider decides which requests on a decode endpoint get a prefill
	// leg (vLLM: an SGLang decode engine cannot compute a prompt itself,
	// so there every request on a decode endpoint gets one).
	Decider routing.PDDecider
	// PrefillTimeout bounds a prefill leg from sending it to the end of
	// its answer; 0: no bound but the response-header timeout.
	PrefillTimeout time.Duration
	// BootstrapPort is the prefill endpoints' SGLang bootstrap port, for
	// those whose URL does not name one (#bootstrap=PORT).
	BootstrapPort int
	// Disaggregated is set when the router has a decode pool: without it
	// no request is disaggregated, nor calls into PD code.
	Disaggregated bool
	// TrustClientKV lets a client send its own kv_transfer_params or
	// bootstrap_* fields: the request is then forwarded as it is, without
	// a prefill leg. Off, such a request is refused (400): the fields make
	// a decode engine connect where they say.
	TrustClientKV bool
}

// errClientKV refuses a client's own transfer parameters.
var errClientKV = &badRequestError{param: "kv_transfer_params",
	msg: "kv_transfer_params and bootstrap_host, bootstrap_port, bootstrap_room are set by the router for prefill/decode disaggregation; a client may not send them (start kvroute with --trust-client-kv-params to forward them)"}

// maxPrefillAnswer caps the prefill answer read into memory: a one-token
// answer, unless it carries prompt logprobs.
const maxPrefillAnswer = 8 << 20

// pdState is one request's disaggregation state (in reqState).
type pdState struct {
	decision  string // the routing.PD* label; "" when the request is not on a decode endpoint
	threshold int    // the uncached tokens the decision was held against
	split     bool   // the current decode leg follows a prefill leg
	prefill   routing.Decision
	ref       []byte // vLLM: the prefill's kv_transfer_params, as the engine wrote it
	refUses   int    // decode legs sent with ref
	delivered bool   // a decode leg with ref answered 200
	orig      []byte // the client's body
	body      []byte // the body of the legs
	start     time.Time
	prefilled time.Time // when the prefill leg that the decode leg follows answered
	sent      time.Time // when the current decode leg was sent
	leg       *sgLeg    // SGLang: the concurrent prefill leg of the current decode leg
	arena     fastjson.Arena
	parser    fastjson.Parser
}

// reset clears p for a new request, keeping its buffers.
func (p *pdState) reset() {
	p.decision, p.threshold, p.split, p.prefill = "", 0, false, routing.Decision{}
	p.ref, p.refUses, p.delivered, p.leg = p.ref[:0], 0, false, nil
	p.orig, p.body = p.orig[:0], p.body[:0]
	p.prefilled, p.sent = time.Time{}, time.Time{}
	p.arena.Reset()
}

// planPD decides, for a request picked onto decode endpoint d.Endpoint,
// whether it gets a prefill leg, and records why in st.pd.
func (s *Server) planPD(st *reqState, d routing.Decision) bool {
	p := &st.pd
	p.split = false
	switch {
	case st.clientKV:
		p.decision = routing.PDClientKV
	case s.pd.prefillOnly() && st.prompts > 0:
		// An SGLang decode engine cannot compute a prompt alone; a batch
		// gets one room per prompt.
		p.decision, p.split = routing.PDSplit, true
	case st.prompts != 1 || st.n > 1:
		p.decision = routing.PDSingleOnly
	default:
		p.split, p.threshold = s.opt.PD.Decider.Split(d)
		p.decision = routing.PDShort
		if p.split {
			p.decision = routing.PDSplit
		}
	}
	return p.split
}

// handoff is a prefill/decode protocol (--pd-protocol): how a decode leg
// gets its prefill leg. New chooses it once (Server.pd); nil without a
// decode pool, and then no request calls into PD code.
type handoff interface {
	// prefill runs before a decode leg that follows a prefill leg (see
	// prefillStage) and sets the decode leg's body on ctx.Request. A
	// response ends the request there; an error fails it.
	prefill(s *Server, ctx *fasthttp.RequestCtx, st *reqState, set *discovery.Set) (*fasthttp.Response, error)
	// prefillOnly reports whether every prompt on a decode endpoint needs
	// a prefill leg: the decode engine cannot compute one itself.
	prefillOnly() bool
}

// newHandoff returns the handoff of opt, nil when opt has no decode pool.
func newHandoff(opt PDOptions) handoff {
	switch {
	case !opt.Disaggregated:
		return nil
	case opt.Protocol == ProtocolSGLang:
		return sglangHandoff{}
	}
	return vllmHandoff{}
}

// prefillStage runs before a decode leg that follows a prefill leg: it
// keeps the client's body for the legs and hands over to the protocol
// (pd_vllm.go, pd_sglang.go).
func (s *Server) prefillStage(ctx *fasthttp.RequestCtx, st *reqState, set *discovery.Set) (*fasthttp.Response, error) {
	p := &st.pd
	if len(p.orig) == 0 {
		p.orig = append(p.orig, ctx.PostBody()...)
		p.start = time.Now()
	}
	return s.pd.prefill(s, ctx, st, set)
}

// pickPrefill picks a prefill endpoint (the policy, over the prefill pool
// without those that failed this request).
func (s *Server) pickPrefill(st *reqState, set *discovery.Set) routing.Decision {
	st.req.Prefill = true
	span := s.pickSpan(st)
	d := s.opt.Picker.Pick(&st.req, set)
	endPick(span, d, true)
	st.req.Prefill = false
	return d
}

func statusOrZero(resp *fasthttp.Response) int {
	if resp == nil {
		return 0
	}
	return resp.StatusCode()
}

// appendMembers appends to dst the JSON object obj with the members add
// appends (without a leading comma) inserted before its closing brace.
// obj is a valid JSON object (the parse checked it) that has none of them.
func appendMembers(dst, obj []byte, add func([]byte) []byte) []byte {
	end := len(obj) - 1
	for end > 0 && obj[end] != '}' {
		end--
	}
	inner := end - 1
	for inner > 0 && isSpace(obj[inner]) {
		inner--
	}
	dst = append(dst, obj[:end]...)
	if obj[inner] != '{' {
		dst = append(dst, ',')
	}
	dst = add(dst)
	return append(dst, obj[end:]...)
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

// legRequest builds a leg's own upstream request to ep: ctx.Request's
// headers (X-Request-Id included, the same on both legs) with ep's URI and
// Host, the attempt's span in traceparent, and body.
func (s *Server) legRequest(ctx *fasthttp.RequestCtx, st *reqState, ep *discovery.Endpoint, span uint64, body []byte) *fasthttp.Request {
	req := fasthttp.AcquireRequest()
	ctx.Request.Header.CopyTo(&req.Header)
	s.setUpstream(req, st, ep, span)
	req.SetBody(body)
	return req
}

// sendPrefill sends a prefill leg on attempt a and reads its whole answer,
// within PrefillTimeout. The answer is nil only with an error.
func (s *Server) sendPrefill(req *fasthttp.Request, pe *discovery.Endpoint, a *attempt) (*fasthttp.Response, time.Duration, error) {
	start := time.Now()
	if t := s.opt.PD.PrefillTimeout; t > 0 {
		a.deadline(start.Add(t))
	}
	resp := fasthttp.AcquireResponse()
	resp.StreamBody = true
	err := s.client(pe).Do(req, resp)
	if err == nil {
		a.traceStatus(resp.StatusCode())
		err = readWhole(resp, maxPrefillAnswer)
	}
	s.attempts.end(a)
	if err != nil {
		fasthttp.ReleaseResponse(resp)
		if _, e := classifyUpstream(err); errors.Is(e, ErrUpstreamTimeout) {
			err = fmt.Errorf("%w: prefill leg: %v", ErrUpstreamTimeout, err)
		}
		return nil, time.Since(start), err
	}
	return resp, time.Since(start), nil
}

// readWhole reads a streamed response body into the response, at most
// limit bytes.
func readWhole(resp *fasthttp.Response, limit int) error {
	rd := resp.BodyStream()
	if rd == nil {
		return nil
	}
	b, err := io.ReadAll(io.LimitReader(rd, int64(limit)+1))
	_ = resp.CloseBodyStream()
	if err == nil && len(b) > limit {
		err = fmt.Errorf("prefill answer larger than %d bytes", limit)
	}
	resp.SetBodyRaw(b)
	return err
}

// strand counts the reference of st as stranded (no decode leg delivered
// with it: its prefill endpoint holds the KV until its timeout) and
// forgets it.
func (s *Server) strand(st *reqState, cause string) {
	p := &st.pd
	if len(p.ref) == 0 || p.delivered {
		return
	}
	s.opt.Metrics.PDStranded(cause)
	s.opt.Logger.Info("prefill KV stranded", zap.String("cause", cause), zap.String("prefill_endpoint", endpointURL(p.prefill.Endpoint)),
		zap.Int("decode_legs", p.refUses))
	p.ref = p.ref[:0]
}

func endpointURL(e *discovery.Endpoint) string {
	if e == nil {
		return ""
	}
	return e.URL
}

// decodeSent notes that a decode leg is being sent.
func (p *pdState) decodeSent() {
	if p.split {
		p.sent = time.Now()
	}
}

// decodeAnswered notes that the decode leg answered with code; a 200 means
// it took the reference.
func (p *pdState) decodeAnswered(code int) {
	if p.split && code == fasthttp.StatusOK {
		p.delivered = true
	}
}
