package proxy

import (
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"
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

// waitQueue bounds the requests waiting in kvroute for a saturated fleet.
type waitQueue struct {
	max int64
	n   atomic.Int64
}

func (q *waitQueue) init(max int) { q.max = int64(max) }

// enter takes a place, or reports false when the queue is full.
func (q *waitQueue) enter() bool {
	if q.n.Add(1) > q.max {
		q.n.Add(-1)
		return false
	}
	return true
}

func (q *waitQueue) leave() { q.n.Add(-1) }

// queuePoll is how often a waiting request looks for an endpoint with room.
const queuePoll = 25 * time.Millisecond
