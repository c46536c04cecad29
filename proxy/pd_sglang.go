package proxy

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute/discovery"
)

// SGLang's bootstrap protocol (pd.go): both legs at once, meeting in a
// bootstrap room.

// sglangHandoff is SGLang's protocol.
type sglangHandoff struct{}

// prefillOnly: an SGLang decode engine cannot compute a prompt alone.
func (sglangHandoff) prefillOnly() bool { return true }

// prefill starts the concurrent prefill leg (startSGLang).
func (sglangHandoff) prefill(s *Server, ctx *fasthttp.RequestCtx, st *reqState, set *discovery.Set) (*fasthttp.Response, error) {
	return nil, s.startSGLang(ctx, st, set)
}

// sgLeg is a concurrent SGLang prefill leg, the protocol's concurrentLeg.
// Its goroutine sends it and, when it fails, aborts the decode leg it
// pairs with (the decode engine would otherwise wait for the KV until its
// bootstrap timeout); its outcome is read after done.
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
	p.prefill, p.prefilled = pd, time.Time{}
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
		s.opt.Metrics.UpstreamError(failPrefill)
		s.opt.Logger.Warn("prefill leg failed", zap.String("request_id", l.reqID), zap.String("endpoint", l.pe.URL),
			zap.Int("status", l.status), zap.Error(err), zap.Bool("decode_aborted", abort))
	}
	if stranded {
		s.opt.Metrics.PDStranded(strandDecodeFailed)
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
		l.s.opt.Metrics.PDStranded(strandDecodeFailed)
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
