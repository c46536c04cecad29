package proxy

import (
	"io"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
)

// retryBudget allows retries up to a share of recent requests, Envoy's
// retry budget: over a sliding window of retryWindow (in one-second
// buckets), retries ≤ max(min, share × requests). A fleet failing as a
// whole then sees at most share more load from retries, instead of a
// multiple of it. Safe for concurrent use.
type retryBudget struct {
	share float64
	min   int64
	mu    sync.Mutex
	sec   int64 // unix second of the newest bucket
	reqs  [retryWindow]int64
	tries [retryWindow]int64
	now   func() time.Time
}

// retryWindow is the budget's window in seconds.
const retryWindow = 10

func (b *retryBudget) init(share float64, min int) {
	b.share, b.min, b.now = share, int64(min), time.Now
}

// roll advances the window to now and returns the newest bucket's index.
func (b *retryBudget) roll() int {
	s := b.now().Unix()
	if d := s - b.sec; d > 0 {
		for i := int64(1); i <= min(d, retryWindow); i++ {
			j := (b.sec + i) % retryWindow
			b.reqs[j], b.tries[j] = 0, 0
		}
		b.sec = s
	}
	return int(b.sec % retryWindow)
}

// request counts one request.
func (b *retryBudget) request() {
	if b.share <= 0 {
		return
	}
	b.mu.Lock()
	b.reqs[b.roll()]++
	b.mu.Unlock()
}

// allow reports whether one more retry fits the budget, and counts it if
// so.
func (b *retryBudget) allow() bool {
	if b.share <= 0 {
		return true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	i := b.roll()
	var reqs, tries int64
	for j := range b.reqs {
		reqs += b.reqs[j]
		tries += b.tries[j]
	}
	if tries >= max(b.min, int64(b.share*float64(reqs))) {
		return false
	}
	b.tries[i]++
	return true
}

// Backoff before a retry: full jitter over an exponential bound (Envoy's
// defaults: 25 ms base, 250 ms cap), so that retries of a burst that
// failed together do not arrive together.
const (
	retryBackoffBase = 25 * time.Millisecond
	retryBackoffMax  = 250 * time.Millisecond
)

// backoff returns the pause before retry n (1, 2, ...).
func backoff(n int) time.Duration {
	bound := min(retryBackoffMax, retryBackoffBase<<min(n-1, 8))
	return rand.N(bound + 1)
}

// mayRetry is the retry rule: whether a request whose tries-th retry
// failed is sent to another endpoint. Never when the client has gone; always
// when the endpoint had no free connection or refused the connection
// (free: nothing was sent, no engine did any work, and that is no retry);
// otherwise only when nothing of an answer can come from there (resend: a
// connection refused, or closed before the request was written; a 429 or
// 503 answer; a decode leg's failure; a connection closed or reset before
// the answer's first byte, unanswered), within --retries and the retry
// budget.
func (s *Server) mayRetry(tries int, gone, free, resend bool) bool {
	switch {
	case gone:
		return false
	case free:
		return true
	case tries >= s.opt.Retries || !resend:
		return false
	}
	return s.allowRetry()
}

// allowRetry reports whether the retry budget allows one more retry, and
// counts it.
func (s *Server) allowRetry() bool {
	if s.budget.allow() {
		return true
	}
	s.opt.Metrics.RetryDenied()
	return false
}

// maxDiscard is the most of a retryable error answer's body read so its
// connection can be reused; discardTimeout bounds the reading. A larger or
// slower body closes the connection instead.
const (
	maxDiscard     = 64 << 10
	discardTimeout = time.Second
)

// discard drops a retryable answer's body: it reads at most maxDiscard of
// it within discardTimeout; closing the body then closes the connection
// unless the body was read whole. It ends the attempt first, since its
// connection may then carry another request.
func (s *Server) discard(resp *fasthttp.Response, a *attempt) {
	if rd := resp.BodyStream(); rd != nil {
		a.drainBy(time.Now().Add(discardTimeout))
		_, _ = io.CopyN(io.Discard, rd, maxDiscard)
	}
	s.attempts.end(a)
	_ = resp.CloseBodyStream()
}

// statusError is a retryable status on the last endpoint tried.
type statusError struct {
	endpoint string
	code     int
}

func (e *statusError) Error() string {
	return ErrUpstream.Error() + ": " + e.endpoint + " answered " + fasthttp.StatusMessage(e.code)
}

// Unwrap makes an engine's 429 kvroute's own overload (429, with
// Retry-After) and its 503 no endpoint available (503): never a 502.
func (e *statusError) Unwrap() error {
	switch e.code {
	case fasthttp.StatusTooManyRequests:
		return ErrOverloaded
	case fasthttp.StatusServiceUnavailable:
		return ErrNoEndpoint
	}
	return ErrUpstream
}

// retryable reports whether an endpoint's status means "try another one":
// it refused the request (overloaded, or not ready), so nothing was
// generated. A 502 or 504 may come from a sidecar in front of an engine
// that started the generation, and is passed on.
func retryable(code int) bool {
	return code == fasthttp.StatusTooManyRequests || code == fasthttp.StatusServiceUnavailable
}
