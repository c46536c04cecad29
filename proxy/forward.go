package proxy

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

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
