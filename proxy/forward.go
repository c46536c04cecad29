package proxy

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

// forward sends the request to the endpoints the policy picks, one attempt
// (try) after another, until one answers with a response to pass on or
// the failure is the answer (the retry rule: mayRetry). When every
// routable endpoint is saturated (at --max-in-flight-per-endpoint or out
// of connections), the request waits (wait) and tries again. On success
// st.lease holds the answering endpoint's lease and st.att its attempt.
func (s *Server) forward(ctx *fasthttp.RequestCtx, st *reqState) (*fasthttp.Response, routing.Decision, error) {
	set := s.opt.Pool.Load()
	if v := set.Version; s.pruned.Load() != v {
		s.prune(set)
	}
	if m := st.req.Model; m != "" && !set.Serves(m) {
		return nil, routing.Decision{}, &unknownModelError{strings.Clone(m)}
	}
	st.req.MaxInFlight = int64(s.opt.MaxInFlightPerEndpoint)
	if !st.migrating {
		s.budget.request()
	}
	var lastErr error = ErrNoEndpoint
	var busy []*discovery.Endpoint // tried endpoints that had no free connection
	var queued time.Time
	defer func() {
		if !queued.IsZero() {
			s.queue.leave()
			s.opt.Metrics.Queued(-1)
		}
	}()
	for tries := 0; ; {
		span := s.pickSpan(st)
		d := s.opt.Picker.Pick(&st.req, set)
		endPick(span, d, false)
		if d.Endpoint == nil {
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
		resp, answered, f := s.try(ctx, st, set, d, tries)
		if resp != nil {
			return resp, answered, nil
		}
		lastErr = f.err
		if !f.retry {
			break
		}
		if f.busy {
			busy = append(busy, d.Endpoint) // not a retry: no endpoint was at fault
			continue
		}
		tries++
		s.opt.Metrics.Retry()
		time.Sleep(backoff(tries))
	}
	if s.pd != nil {
		if errors.Is(lastErr, ErrClientGone) {
			s.strand(st, strandClientGone)
		} else {
			s.strand(st, strandDecodeFailed)
		}
	}
	return nil, routing.Decision{}, lastErr
}

// failure is a failed attempt: its error, and whether the request goes on
// to another endpoint (retry; busy: the endpoint had no free connection).
type failure struct {
	err         error
	retry, busy bool
}

// try sends the request to d.Endpoint, the tries-th retry, and returns the
// response to pass on with the decision it answers (which may be a
// prefill leg's), or the failure. A failed attempt releases its lease and
// counts against the endpoint where the endpoint is at fault (a transport
// failure or a 5xx; never a client's mistake, nor a busy endpoint).
func (s *Server) try(ctx *fasthttp.RequestCtx, st *reqState, set *discovery.Set, d routing.Decision, tries int) (*fasthttp.Response, routing.Decision, failure) {
	ep := d.Endpoint
	s.opt.Metrics.Decision(d.Reason, d.PromptTokens, d.PromptTokens-d.Prefill)
	st.req.Tried = append(st.req.Tried, ep)
	if ans, ansD, f, done := s.claim(ctx, st, set, d); done {
		return ans, ansD, f
	}
	pd := &st.pd
	a := s.beginAttempt(st, ctx.Conn(), attemptSpanName(ep), ep)
	leg := pd.leg
	if leg != nil {
		leg.pair(a)
	}
	s.setUpstream(&ctx.Request, st, ep, a.id)
	resp := fasthttp.AcquireResponse()
	resp.StreamBody = true
	if s.pd != nil {
		pd.decodeSent()
	}
	err := s.client(ep).Do(&ctx.Request, resp)
	if leg != nil {
		// A failed prefill leg fails the request: its 4xx answer is the
		// answer, else a 502. (When it aborted this leg it has ended; a
		// prefill leg still running when the decode leg failed is
		// cancelled below, with the decode leg's failure.)
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
				return ans, pd.prefill, failure{}
			}
			return nil, routing.Decision{}, failure{err: lerr}
		}
	}
	var f failure
	var kind string
	switch {
	case err == nil && s.isAnswer(st, ep, a, resp, tries):
		perr := s.peekBody(st, resp)
		if perr == nil {
			return resp, d, failure{}
		}
		// Nothing reached the client: the request goes elsewhere whole.
		st.att = nil
		if f, kind = s.failed(ep, a, perr, tries, true); kind == failConnect {
			kind = failBody // the connection failed after the answer's header
		}
	case err == nil:
		f, kind = failure{err: &statusError{endpoint: ep.URL, code: resp.StatusCode()}, retry: true}, failStatus
	default:
		f, kind = s.failed(ep, a, err, tries, pd.split)
	}
	s.attempts.end(a)
	fasthttp.ReleaseResponse(resp)
	st.lease.Release()
	if leg != nil {
		leg.decodeEnd(false)
		pd.leg = nil
	}
	s.opt.Metrics.UpstreamError(kind)
	return nil, routing.Decision{}, f
}

// claim takes d.Endpoint's lease for st and, for a decode endpoint, runs
// the prefill stage. done is set when that ended the attempt: with the
// answer to pass on (a prefill endpoint's, and the decision it answers),
// or with the failure.
func (s *Server) claim(ctx *fasthttp.RequestCtx, st *reqState, set *discovery.Set, d routing.Decision) (ans *fasthttp.Response, ansD routing.Decision, f failure, done bool) {
	ep := d.Endpoint
	pd := &st.pd
	split := false
	if s.pd != nil {
		pd.split = false
		split = ep.Role == discovery.RoleDecode && s.planPD(st, d)
	}
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
			return nil, routing.Decision{}, failure{err: err}, true
		case ans != nil:
			s.opt.Metrics.PDDecision(pd.decision)
			return ans, pd.prefill, failure{}, true
		}
		if !pd.split { // a fallback: the decode endpoint computes the prompt
			st.lease.AddPrefill(d.Prefill)
		}
	}
	if s.pd != nil {
		if !split && len(pd.orig) > 0 {
			ctx.Request.SetBody(pd.orig) // an earlier attempt's leg body
		}
		if ep.Role == discovery.RoleDecode {
			s.opt.Metrics.PDDecision(pd.decision)
		}
	}
	return nil, routing.Decision{}, failure{}, false
}

// isAnswer reports whether ep's answer resp, on attempt a, is the one to
// pass on (then st.att holds a) rather than one to retry elsewhere (then
// its body is discarded): the retry rule decides (mayRetry).
func (s *Server) isAnswer(st *reqState, ep *discovery.Endpoint, a *attempt, resp *fasthttp.Response, tries int) bool {
	pd := &st.pd
	code := resp.StatusCode()
	a.traceStatus(code)
	if code == fasthttp.StatusTooManyRequests {
		ep.ReportShed(retryAfter(resp)) // it takes no new requests for a while
	}
	if s.pd != nil {
		pd.decodeAnswered(code)
	}
	// A decode leg's 5xx is resent: its prompt was computed elsewhere, so
	// it had not started.
	if !s.mayRetry(tries, false, false, retryable(code) || pd.split && code >= 500) {
		if code >= 500 {
			ep.ReportFailure()
		} else if code != fasthttp.StatusTooManyRequests {
			ep.ReportSuccess()
		}
		st.att = a
		if s.pd != nil {
			if pd.split {
				s.strand(st, strandDecodeFailed) // unless this leg took it
			} else {
				s.strand(st, strandSuperseded)
			}
		}
		return true
	}
	s.discard(resp, a)
	if code >= 500 {
		ep.ReportFailure()
	}
	return false
}

// peekBody reads the first bytes of a whole (not streamed) answer before
// anything of it reaches the client, into st.pre: an endpoint that fails
// between its header and its body is then a failed attempt, and the
// request is sent elsewhere whole, instead of the client getting a header
// and a cut body.
func (s *Server) peekBody(st *reqState, resp *fasthttp.Response) error {
	rd := resp.BodyStream()
	if rd == nil || st.pd.split || resp.StatusCode() != fasthttp.StatusOK || isEventStream(resp) {
		return nil
	}
	st.pre = st.pre[:cap(st.pre)]
	if len(st.pre) == 0 {
		st.pre = make([]byte, 512)
	}
	n, err := rd.Read(st.pre)
	st.pre = st.pre[:n]
	if err != nil && err != io.EOF {
		return err
	}
	return nil
}

// retryAfter is a 429 answer's Retry-After in seconds (RFC 9110 §10.2.3;
// an HTTP date, or none, is 0).
func retryAfter(resp *fasthttp.Response) time.Duration {
	v := resp.Header.Peek("Retry-After")
	n, err := strconv.Atoi(string(v))
	if err != nil || n < 0 {
		return 0
	}
	return time.Duration(min(n, 3600)) * time.Second
}

// failed is attempt a's transport failure err on ep, the tries-th retry,
// as a failure and its metric kind. resend: the request may be re-sent
// whole although it was sent (a decode leg that followed a prefill leg;
// an answer that failed before its body, peekBody).
func (s *Server) failed(ep *discovery.Endpoint, a *attempt, err error, tries int, resend bool) (f failure, kind string) {
	s.opt.Logger.Debug("upstream attempt failed", zap.String("endpoint", ep.URL), zap.Error(err))
	gone := a.clientGone()
	f.busy = !gone && errors.Is(err, fasthttp.ErrNoFreeConns)
	// A decode leg that failed before its first byte is resent: its prompt
	// was computed elsewhere, so it had not started.
	// A refused connection, like a busy endpoint, cost no engine anything:
	// its retry is outside the retry budget (not outside --retries).
	f.retry = s.mayRetry(tries, gone, f.busy || tries < s.opt.Retries && errors.Is(err, syscall.ECONNREFUSED), neverSent(err, a) || resend)
	switch {
	case gone:
		f.err, kind = fmt.Errorf("%w: %v", ErrClientGone, err), failCancelled
	case f.busy:
		f.err, kind = ErrOverloaded, failBusy
	default:
		kind, f.err = classifyUpstream(err)
		ep.ReportFailure()
	}
	return f, kind
}
