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
	// no request is disaggregated (the PD state's seam methods find
	// nothing to do).
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

// handoff is a prefill/decode protocol (--pd-protocol): how a decode leg
// gets its prefill leg. New chooses it once (Server.pd); nil without a
// decode pool, and then no request is planned for a prefill leg. A
// protocol is one file (pd_vllm.go, pd_sglang.go) and one case of
// newHandoff; it keeps its per-request state in the request's pdState,
// and a prefill leg that runs beside the decode leg is a concurrentLeg.
// Implementations are stateless values, safe for concurrent use.
type handoff interface {
	// prefill runs before a decode leg that follows a prefill leg (see
	// prefillStage) and sets the decode leg's body on ctx.Request. A
	// response ends the request there; an error fails it. A protocol
	// whose prefill leg runs beside the decode leg starts it here and
	// puts it in st.pd.leg.
	prefill(s *Server, ctx *fasthttp.RequestCtx, st *reqState, set *discovery.Set) (*fasthttp.Response, error)
	// prefillOnly reports whether every prompt on a decode endpoint needs
	// a prefill leg: the decode engine cannot compute one itself.
	prefillOnly() bool
}

// concurrentLeg is a prefill leg that runs beside its decode leg, in a
// goroutine of its own (SGLang's sgLeg; Server.legs counts them); a
// protocol whose prefill leg ends before the decode leg is sent (vLLM's)
// has none. It lives from the protocol's prefill, which starts it, to
// decodeEnd: the request's goroutine pairs the decode leg's attempt with
// it and reads its outcome (pdState's decodeSent, prefillFailure), and
// ends it when the decode leg fails before its answer is passed on
// (prefillFailure, decodeFailed); otherwise the answer's body ends it
// when it closes (handOver). Its methods are safe for concurrent use with
// the leg's own goroutine.
type concurrentLeg interface {
	// pair links the decode leg's attempt a, which the prefill leg aborts
	// if it fails; an attempt paired after the failure is aborted at once.
	pair(a *attempt)
	// outcome waits for the leg when wait is set, and returns the error
	// that fails the request if the leg failed (with a 4xx answer to pass
	// on); (nil, nil) while the leg runs or after it succeeded.
	outcome(wait bool) (*fasthttp.Response, error)
	// decodeEnd notes the end of the decode leg: delivered (ok) or not.
	// It is called once per decode leg, from the request's goroutine or
	// the answer's body.
	decodeEnd(ok bool)
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

// pdState is one request's disaggregation state (in reqState): the plan,
// the prefill leg's decision and reference, the bodies of the legs, and
// the current decode leg's times and concurrent prefill leg. It is owned
// by the request's goroutine and reset with the reqState; commit hands
// what the answer needs of it to the answer's record and body (handOver).
// The plain request path (forward.go, response.go) reads split and calls
// the seam: claimPD with a decode pool, and decodeSent, prefillFailure,
// decodeFailed, answerChosen, strandFailed and handOver, which find
// nothing to do when the request is not disaggregated.
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
	prefilled time.Time     // when the prefill leg that the decode leg follows answered; zero for a concurrent one
	sent      time.Time     // when the current decode leg was sent
	leg       concurrentLeg // the concurrent prefill leg of the current decode leg; nil: none
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

// claimPD is try's claim with a decode pool: it takes d.Endpoint's lease
// for st and, on a decode endpoint, plans the request's disaggregation
// (planPD) and, when it splits, runs the prefill stage. done is set when
// that ended the attempt: with the answer to pass on (a prefill
// endpoint's, and the decision it answers), or with the failure. A request
// that does not split gets the client's body back from an earlier
// attempt's legs.
func (s *Server) claimPD(ctx *fasthttp.RequestCtx, st *reqState, set *discovery.Set, d routing.Decision) (ans *fasthttp.Response, ansD routing.Decision, f failure, done bool) {
	ep := d.Endpoint
	p := &st.pd
	decode := ep.Role == discovery.RoleDecode
	if p.split = decode && s.planPD(st, d); !p.split {
		s.acquire(st, ep, d.Prefill, d.Loaded, d.PrefixKey)
		if len(p.orig) > 0 {
			ctx.Request.SetBody(p.orig) // an earlier attempt's leg body
		}
		if decode {
			s.opt.Metrics.PDDecision(p.decision)
		}
		return nil, routing.Decision{}, failure{}, false
	}
	s.acquire(st, ep, 0, 0, 0) // the prefill endpoint computes the prompt
	ans, err := s.prefillStage(ctx, st, set)
	switch {
	case err != nil:
		st.lease.Release()
		return nil, routing.Decision{}, failure{err: err}, true
	case ans != nil:
		s.opt.Metrics.PDDecision(p.decision)
		return ans, p.prefill, failure{}, true
	}
	if !p.split { // a fallback: the decode endpoint computes the prompt
		st.lease.AddPrefill(d.Prefill)
	}
	s.opt.Metrics.PDDecision(p.decision)
	return nil, routing.Decision{}, failure{}, false
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

// explainPD returns, for /debug/route, the disaggregation decision for st
// picked as d onto a decode endpoint and, when it splits, the prefill
// pick, as claimPD would make them (e explains the picks).
func (s *Server) explainPD(e Explainer, st *reqState, d routing.Decision) *pdExplanation {
	out := &pdExplanation{Protocol: s.opt.PD.Protocol, UncachedTokens: d.Prefill}
	split := s.planPD(st, d)
	out.Decision, out.ThresholdTokens = st.pd.decision, st.pd.threshold
	if !split {
		return out
	}
	st.req.Prefill = true
	pd, terms := e.Explain(&st.req, s.opt.Pool.Load())
	out.PrefillReason, out.PrefillMatched, out.PrefillTokens, out.PrefillPool = pd.Reason, pd.MatchedBlocks, pd.Prefill, terms
	if pd.Endpoint == nil {
		out.Decision = routing.PDNoPrefill
		return out
	}
	out.Prefill = pd.Endpoint.URL
	return out
}

// decodeSent notes that the current decode leg goes out on attempt a: it
// pairs with a concurrent prefill leg, which aborts a if it fails.
func (p *pdState) decodeSent(a *attempt) {
	if p.split {
		p.sent = time.Now()
	}
	if p.leg != nil {
		p.leg.pair(a)
	}
}

// prefillFailure reports, once the decode leg's attempt a returned err,
// whether a concurrent prefill leg failed the request (waiting for the leg
// when it aborted a): with the prefill endpoint's 4xx answer to pass on
// and the decision it answers, or with the error that fails the request.
// The decode leg is then over. All nil when there is no concurrent leg,
// or it runs on, or it succeeded.
func (p *pdState) prefillFailure(a *attempt, err error) (*fasthttp.Response, routing.Decision, error) {
	l := p.leg
	if l == nil {
		return nil, routing.Decision{}, nil
	}
	ans, lerr := l.outcome(err != nil && a.wasAborted())
	if ans == nil && lerr == nil {
		return nil, routing.Decision{}, nil
	}
	l.decodeEnd(false)
	p.leg, p.sent = nil, time.Time{}
	return ans, p.prefill, lerr
}

// decodeFailed notes that the current decode leg failed before its answer
// was passed on: a concurrent prefill leg still running is cancelled, and
// one that succeeded strands its KV.
func (p *pdState) decodeFailed() {
	if p.leg != nil {
		p.leg.decodeEnd(false)
		p.leg = nil
	}
}

// answerChosen notes that the answer of st's current attempt, with status
// code, is the one passed on (isAnswer): a decode leg's 200 delivers the
// reference; a reference no decode leg delivered is stranded, its decode
// legs having failed, or the answer of an endpoint that computed the
// prompt itself superseding it.
func (s *Server) answerChosen(st *reqState, code int) {
	if s.pd == nil {
		return
	}
	p := &st.pd
	switch {
	case !p.split:
		s.strand(st, strandSuperseded)
	case code == fasthttp.StatusOK:
		p.delivered = true
	default:
		s.strand(st, strandDecodeFailed)
	}
}

// strandFailed strands the reference of st, whose request failed with err
// (strand).
func (s *Server) strandFailed(st *reqState, err error) {
	switch {
	case s.pd == nil:
	case errors.Is(err, ErrClientGone):
		s.strand(st, strandClientGone)
	default:
		s.strand(st, strandDecodeFailed)
	}
}

// handOver hands the request's PD state over to r, the record of its
// answer, which answers d: the decision, the prefill endpoint whose answer
// the decode leg followed (or which answered itself), when that answer
// came and when the decode leg was sent. It returns the concurrent prefill
// leg, nil if none, which the answer's body then ends (decodeEnd).
func (p *pdState) handOver(r *record, d routing.Decision) concurrentLeg {
	r.pdDecision, r.prefilled, r.sent = p.decision, p.prefilled, p.sent
	if p.split || d.Endpoint != nil && d.Endpoint.Role == discovery.RolePrefill {
		r.prefill = p.prefill.Endpoint
	}
	l := p.leg
	p.leg = nil
	return l
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
