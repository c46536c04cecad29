package proxy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strconv"
	"sync"
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
	answered  time.Time // when the prefill leg that the decode leg follows answered
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
	p.answered, p.sent = time.Time{}, time.Time{}
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
	case s.opt.PD.Protocol == ProtocolSGLang && st.prompts > 0:
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

// prefillStage runs before a decode leg that follows a prefill leg and
// sets the decode leg's body on ctx.Request. vLLM: a reference already
// obtained serves one more decode endpoint (the first failed before its
// first byte); otherwise prefill endpoints are tried in turn (a connection
// error, a 5xx or 429 or the prefill timeout moves to another, within
// --retries), and when none answers, or the answer has no reference, the
// decode endpoint computes the prompt alone. A 4xx answer is the
// request's answer, returned with st.lease holding the prefill
// endpoint's lease. SGLang: starts the concurrent prefill leg.
func (s *Server) prefillStage(ctx *fasthttp.RequestCtx, st *reqState, set *discovery.Set) (*fasthttp.Response, error) {
	p := &st.pd
	if len(p.orig) == 0 {
		p.orig = append(p.orig, ctx.PostBody()...)
		p.start = time.Now()
	}
	if s.opt.PD.Protocol == ProtocolSGLang {
		return nil, s.startSGLang(ctx, st, set)
	}
	if len(p.ref) > 0 && p.refUses < 2 && !p.delivered {
		s.setDecodeBody(ctx, st)
		return nil, nil
	}
	s.strand(st, "decode_failed") // two decode legs failed with it
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
			s.opt.Metrics.UpstreamError("prefill")
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
			p.answered, p.prefill = time.Now(), pd
			s.opt.Metrics.PrefillLeg(took.Seconds(), p.answered.Sub(p.start).Seconds())
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
		a.answered(resp.StatusCode())
		err = readWhole(resp, maxPrefillAnswer)
	}
	s.attempts.end(a)
	if err != nil {
		fasthttp.ReleaseResponse(resp)
		if e, _ := classifyUpstream(err); errors.Is(e, ErrUpstreamTimeout) {
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

// The SGLang protocol.

// sgLeg is a concurrent SGLang prefill leg. Its goroutine sends it and,
// when it fails, aborts the decode leg it pairs with (the decode engine
// would otherwise wait for the KV until its bootstrap timeout); its
// outcome is read after done.
type sgLeg struct {
	s     *Server
	pe    *discovery.Endpoint
	reqID string
	done  chan struct{}
	// The outcome, set under mu and read after done: the answer's status
	// (0: none), the answer of a 4xx, and the error of a failure.
	status int
	answer *fasthttp.Response
	err    error

	pre *attempt // the prefill leg's attempt

	mu           sync.Mutex
	finished     bool     // the outcome is set
	prefillOK    bool     // the prefill leg succeeded
	decode       *attempt // the decode leg's attempt
	decodeOver   bool     // the decode leg ended: nothing to abort any more
	decodeFailed bool
}

// failed reports whether the finished leg failed.
func (l *sgLeg) failed() bool { return l.err != nil || l.status >= 300 }

// startSGLang picks a prefill endpoint, puts the bootstrap fields on the
// decode leg's body and starts the prefill leg with the same body.
func (s *Server) startSGLang(ctx *fasthttp.RequestCtx, st *reqState, set *discovery.Set) error {
	p := &st.pd
	pd := s.pickPrefill(st, set)
	pe := pd.Endpoint
	if pe == nil {
		// An SGLang decode engine cannot compute a prompt alone.
		return fmt.Errorf("%w: no prefill endpoint for the decode endpoint (SGLang protocol)", ErrNoEndpoint)
	}
	port := pe.BootstrapPort
	if port == 0 {
		port = s.opt.PD.BootstrapPort
	}
	host, _, _ := net.SplitHostPort(pe.Addr)
	p.body = appendMembers(p.body[:0], p.orig, func(b []byte) []byte {
		return appendBootstrap(b, host, port, st.prompts)
	})
	ctx.Request.SetBody(p.body)
	p.prefill, p.answered = pd, time.Time{}
	a := s.beginAttempt(st, ctx.Conn(), "kvroute.prefill", pe)
	req := s.legRequest(ctx, st, pe, a.id, p.body)
	l := &sgLeg{s: s, pe: pe, pre: a, reqID: string(ctx.Request.Header.PeekBytes(headerRequestID)), done: make(chan struct{})}
	p.leg = l
	lease := pe.Acquire(pd.Prefill)
	s.legs.Add(1)
	go l.run(req, a, lease, p.start)
	return nil
}

// appendBootstrap appends SGLang's bootstrap members for a request of
// prompts prompts: scalars for one, lists of one element per prompt (each
// its own random room in [0, 2^63-1]) for a batch.
func appendBootstrap(b []byte, host string, port, prompts int) []byte {
	list := func(b []byte, elem func([]byte) []byte) []byte {
		if prompts == 1 {
			return elem(b)
		}
		b = append(b, '[')
		for i := range prompts {
			if i > 0 {
				b = append(b, ',')
			}
			b = elem(b)
		}
		return append(b, ']')
	}
	b = append(b, `"bootstrap_host":`...)
	b = list(b, func(b []byte) []byte { return strconv.AppendQuote(b, host) })
	b = append(b, `,"bootstrap_port":`...)
	b = list(b, func(b []byte) []byte { return strconv.AppendInt(b, int64(port), 10) })
	b = append(b, `,"bootstrap_room":`...)
	return list(b, func(b []byte) []byte { return strconv.AppendUint(b, rand.Uint64()>>1, 10) })
}

// run sends the leg and records its outcome.
func (l *sgLeg) run(req *fasthttp.Request, a *attempt, lease discovery.Lease, start time.Time) {
	s := l.s
	defer s.legs.Done()
	resp, took, err := s.sendPrefill(req, l.pe, a)
	fasthttp.ReleaseRequest(req)
	status := statusOrZero(resp)
	var answer *fasthttp.Response
	cancelled := err != nil && (a.clientGone() || a.wasAborted())
	switch {
	case cancelled: // the client left, or the decode leg failed
		lease.Release()
	case err != nil || status >= 500:
		lease.Release()
		l.pe.ReportFailure()
	case status >= 300:
		lease.Release()
		l.pe.ReportSuccess()
		resp.SetBodyStream(bytes.NewReader(resp.Body()), len(resp.Body()))
		answer, resp = resp, nil
	default:
		l.pe.ReportSuccess()
		lease.FirstByte(true)
		lease.Complete(discovery.Uncomputed)
		s.opt.Metrics.PrefillLeg(took.Seconds(), time.Since(start).Seconds())
	}
	if resp != nil {
		fasthttp.ReleaseResponse(resp)
	}
	l.mu.Lock()
	l.status, l.err, l.answer, l.finished = status, err, answer, true
	failed := l.failed()
	l.prefillOK = !failed
	abort := failed && l.decode != nil && !l.decodeOver
	stranded := l.prefillOK && l.decodeFailed
	if abort {
		l.decode.abort()
	}
	l.mu.Unlock()
	if failed && !cancelled {
		s.opt.Metrics.UpstreamError("prefill")
		s.opt.Logger.Warn("prefill leg failed", zap.String("request_id", l.reqID), zap.String("endpoint", l.pe.URL),
			zap.Int("status", l.status), zap.Error(err), zap.Bool("decode_aborted", abort))
	}
	if stranded {
		s.opt.Metrics.PDStranded("decode_failed")
	}
	close(l.done)
}

// pair links the decode leg's attempt, which the prefill leg aborts if it
// fails; an attempt paired after the failure is aborted at once.
func (l *sgLeg) pair(a *attempt) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.decode = a
	if l.finished && !l.prefillOK {
		a.abort()
	}
}

// decodeEnd notes the end of the decode leg: delivered or not. A failed
// decode leg cancels a prefill leg still running (its KV would wait for a
// decode engine that never comes); one that failed after the prefill leg
// succeeded strands the prefill's KV.
func (l *sgLeg) decodeEnd(ok bool) {
	l.mu.Lock()
	l.decodeOver, l.decodeFailed = true, !ok
	stranded := !ok && l.prefillOK
	if !ok && !l.finished {
		l.pre.abort()
	}
	l.mu.Unlock()
	if stranded {
		l.s.opt.Metrics.PDStranded("decode_failed")
	}
}

// outcome waits for the leg when wait is set, and returns the error that
// fails the request if the leg failed (with a 4xx answer to pass on);
// (nil, nil) while the leg runs or after it succeeded.
func (l *sgLeg) outcome(wait bool) (*fasthttp.Response, error) {
	if wait {
		<-l.done
	}
	select {
	case <-l.done:
	default:
		return nil, nil
	}
	switch {
	case l.answer != nil:
		ans := l.answer
		l.answer = nil
		return ans, nil
	case l.err != nil:
		return nil, fmt.Errorf("prefill leg on %s: %w", l.pe.URL, l.err)
	case l.status >= 300:
		return nil, &statusError{endpoint: l.pe.URL, code: l.status}
	}
	return nil, nil
}
