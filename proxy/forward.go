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
// the failure is the answer (the retry rule: mayRetry). A request that
// the fleet cannot start now (routing.Room), that finds others waiting,
// or that must leave the fleet's last places to another tenant (the
// reserve, reserve.go), waits in the queue (queue.go) for its turn; so
// does one whose endpoints are all saturated (full, at
// --max-in-flight-per-endpoint, out of connections, or answering 429 as
// backpressure). On success st.lease holds the answering endpoint's lease
// and st.att its attempt.
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
	defer s.handOff(st)
	var lastErr error = ErrNoEndpoint
	var busy []*discovery.Endpoint // tried endpoints that had no free connection, or were full
	// A new inference request queues behind those waiting, or when the
	// fleet has no room; a continued stream (migrating) does not, nor a
	// request passed on unparsed (a probe through the API port), which
	// takes no place in a batch.
	wait := (!st.migrating || st.resumed) && st.req.Kind != routing.KindOther &&
		(s.queue.busy() || !routing.Room(&st.req, set) || s.queue.reserved(&st.req, flowOf(st.tenant, st.class), st.class)) &&
		saturated(set, &st.req, nil)
	waited := false
	for tries := 0; ; {
		if wait {
			// The busy may have room by its turn (the queue's room test
			// reads Tried too).
			st.req.Tried = slices.DeleteFunc(st.req.Tried, func(e *discovery.Endpoint) bool { return slices.Contains(busy, e) })
			busy = busy[:0]
			if err := s.queueWait(ctx, st, waited); err != nil {
				return nil, routing.Decision{}, err
			}
			wait, waited = false, true
			st.req.StartNow = true // the fleet is saturated: where it starts now
			set = s.opt.Pool.Load()
		}
		if !s.budgets.tryStart(&st.charge, st.tenant) {
			// Its tenant runs its max_concurrency: it waits for one of
			// them to end (the queue grants it no place before).
			s.handOff(st)
			wait = true
			continue
		}
		span := s.pickSpan(st)
		d := s.opt.Picker.Pick(&st.req, set)
		endPick(span, d, false)
		if d.Hold != nil {
			s.budgets.unstart(&st.charge)
			s.hold(st, d)
			set = s.opt.Pool.Load()
			continue
		}
		if d.Endpoint == nil {
			s.handOff(st)
			s.budgets.unstart(&st.charge)
			if !saturated(set, &st.req, busy) {
				break
			}
			wait = true
			continue
		}
		if st.resumed && !st.admitted {
			st.admitted = true // the cut stream runs again
			s.queue.runs.restarted(flowOf(st.tenant, st.class))
		}
		if !st.admitted && !st.migrating && st.req.Kind != routing.KindOther {
			st.admitted = true
			if w := &st.wait; !w.since.IsZero() {
				st.waited = time.Since(w.since)
			}
			st.label = s.tenantLabel(st.tenant)
			s.countAdmitted(st.tenant)
			s.opt.Metrics.TenantAdmitted(st.label, st.class.String(), st.waited.Seconds(), st.waited > 0)
			s.opt.Metrics.TenantInFlight(st.label, 1)
			s.queue.runs.started(flowOf(st.tenant, st.class), s.weightOf(st.tenant), st.class)
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
	s.strandFailed(st, lastErr)
	return nil, routing.Decision{}, lastErr
}

// hold waits, before st's request picks again, for d.Hold (one of the
// requests busy with its prompt's copies on d's endpoint ended) or at most
// d.HoldFor: a cold prefill and a turn, a fraction of a second on the
// engines that hold (the queue's wait watches for a client that left; a
// hold is too short to).
func (s *Server) hold(st *reqState, d routing.Decision) {
	start := time.Now()
	t := time.NewTimer(d.HoldFor)
	defer t.Stop()
	outcome := "ended"
	select {
	case <-d.Hold:
	case <-t.C:
		outcome = "timeout"
	}
	st.req.Held, st.held = true, time.Since(start)
	s.opt.Metrics.PromptHold(outcome)
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
// failure or a 5xx; never a client's mistake, nor a busy endpoint). With a
// decode pool the PD state runs beside it (pd.go): claimPD takes the lease
// and may run a prefill leg first, and the attempt notes its decode leg's
// events.
func (s *Server) try(ctx *fasthttp.RequestCtx, st *reqState, set *discovery.Set, d routing.Decision, tries int) (*fasthttp.Response, routing.Decision, failure) {
	ep := d.Endpoint
	if st.req.Kind != routing.KindOther {
		// A request passed on unparsed (a GET of /metrics or /health
		// through the API port, a router in front probing this one) is
		// no routing decision of the policy's.
		s.opt.Metrics.Decision(d.Reason, d.PromptTokens, d.PromptTokens-d.Prefill)
	}
	st.req.Tried = append(st.req.Tried, ep)
	if s.pd == nil {
		s.acquire(st, ep, d.Prefill, d.Loaded, d.PrefixKey)
	}
	s.handOff(st) // ep counts the request now (claimPD takes its lease at once)
	if s.pd != nil {
		if ans, ansD, f, done := s.claimPD(ctx, st, set, d); done {
			return ans, ansD, f
		}
	}
	pd := &st.pd
	a := s.beginAttempt(st, ctx.Conn(), attemptSpanName(ep), ep)
	s.setUpstream(&ctx.Request, st, ep, a.id)
	resp := fasthttp.AcquireResponse()
	resp.StreamBody = true
	pd.decodeSent(a)
	err := s.client(ep).Do(&ctx.Request, resp)
	// A concurrent prefill leg that failed fails the request: its 4xx
	// answer is the answer, else a 502. (When it aborted this leg it has
	// ended; one still running when this leg failed is cancelled below,
	// with this leg's failure.)
	if ans, ansD, perr := pd.prefillFailure(a, err); ans != nil || perr != nil {
		if err == nil {
			s.discard(resp, a)
		}
		s.attempts.end(a)
		fasthttp.ReleaseResponse(resp)
		st.lease.Release()
		if ans != nil {
			return ans, ansD, failure{}
		}
		return nil, routing.Decision{}, failure{err: perr}
	}
	var f failure
	var kind string
	switch {
	case err == nil && resp.StatusCode() == fasthttp.StatusTooManyRequests && !pd.split && ep.ReportShed(retryAfter(resp)):
		// Backpressure: ep is full, not failing. The request waits for
		// room like one that found the fleet full (no retry: nothing
		// was at fault).
		a.traceStatus(fasthttp.StatusTooManyRequests)
		s.discard(resp, a)
		f, kind = failure{err: &statusError{endpoint: ep.URL, code: fasthttp.StatusTooManyRequests}, retry: true, busy: true}, failFull
	case err == nil && s.isAnswer(st, ep, a, resp, tries):
		perr := s.peekBody(st, resp)
		if perr == nil {
			return resp, d, failure{}
		}
		// Nothing reached the client: the request goes elsewhere whole.
		st.att = nil
		if f, kind = s.failed(ep, a, perr, tries, true); kind == failConnect || kind == failDropped {
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
	pd.decodeFailed()
	s.opt.Metrics.UpstreamError(kind)
	st.failed(kind)
	return nil, routing.Decision{}, f
}

// acquire takes ep's lease for st, with own of the prompt's tokens for ep
// to compute and loaded of them to load from a slower tier (the decision's
// Prefill and Loaded; 0 when a prefill leg computes the prompt), counted
// against the model's adapter when it names one.
func (s *Server) acquire(st *reqState, ep *discovery.Endpoint, own, loaded int, key uint64) {
	st.lease = ep.Acquire(own)
	if st.req.Stream {
		st.lease.Streams()
	}
	st.lease.Loading(loaded)
	if ep.Dialect().Slotted() {
		st.lease.ForPrompt(key) // the policy sees the busy copies of the prompt (Decision.Hold)
	}
	if m := ep.Models(); m != nil && m.Adapter(st.req.Model) {
		st.lease.ForAdapter(st.req.Model) // the policy sees which adapters hold ep's slots
	}
}

// isAnswer reports whether ep's answer resp, on attempt a, is the one to
// pass on (then st.att holds a) rather than one to retry elsewhere (then
// its body is discarded): the retry rule decides (mayRetry).
func (s *Server) isAnswer(st *reqState, ep *discovery.Endpoint, a *attempt, resp *fasthttp.Response, tries int) bool {
	code := resp.StatusCode()
	a.traceStatus(code)
	if code == fasthttp.StatusTooManyRequests && st.pd.split {
		ep.ReportShed(retryAfter(resp)) // a decode pod refusing: it takes no new requests for a while
	}
	// A decode leg's 5xx is resent: its prompt was computed elsewhere, so
	// it had not started.
	if !s.mayRetry(tries, false, false, retryable(code) || st.pd.split && code >= 500) {
		if code >= 500 {
			ep.ReportFailure()
		} else if code != fasthttp.StatusTooManyRequests {
			ep.ReportSuccess()
		}
		st.att = a
		s.answerChosen(st, code)
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

// unanswered reports whether err, returned by the client for a request
// it wrote, is the endpoint closing or resetting the connection before the
// answer's first byte: nothing of an answer can come from there (an engine
// stops what a closed connection asked for: vLLM aborts the request), and
// the client has seen nothing, so the request may go elsewhere whole, as a
// stream that fails after its first byte is continued elsewhere
// (migrate.go). A keep-alive connection the endpoint closes as the request
// is written (the idle-timeout race) and an engine restarting both end so.
// A timeout is not: the engine may still be generating.
func unanswered(err error) bool {
	return errors.Is(err, fasthttp.ErrConnectionClosed) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, io.EOF) // ended within the header
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
	f.retry = s.mayRetry(tries, gone, f.busy || tries < s.opt.Retries && errors.Is(err, syscall.ECONNREFUSED), neverSent(err, a) || resend || unanswered(err))
	switch {
	case gone:
		f.err, kind = fmt.Errorf("%w: %v", ErrClientGone, err), failCancelled
	case f.busy:
		f.err, kind = ErrOverloaded, failBusy
	default:
		kind, f.err = classifyUpstream(err)
		if kind == failConnect && unanswered(err) && !neverSent(err, a) {
			kind = failDropped
		}
		ep.ReportFailure()
	}
	return f, kind
}
