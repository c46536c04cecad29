package discovery

import (
	"sync"
	"time"
)

// Whether an engine stops a request the router cut. A router that cuts a
// stream to give its place to another request (the proxy's preemption)
// frees a place only where the engine stops generating when its client
// leaves: vLLM, SGLang, llama.cpp, Ollama and kvsim do; llm-d's inference
// simulator goes on to the end of the answer, and the request sent into
// the "freed" place waits in its queue behind the cut one. The router
// learns which. Each cut asks for a scrape cutDelay later; an engine that
// then runs or queues more than the requests the router knows of
// (EngineStats.Foreign) kept the cut request. (Measured against the
// excess before the cut, an engine still running an earlier cut request
// read as one that stopped the next, and llm-d's simulator took cuts
// again.) An engine shared with other clients so reads as one that keeps
// cut requests and is not cut: the safe side. An engine's first cut is a
// probe: no other is made there before a scrape settles it. An engine
// that kept more cut requests than it stopped takes no cut for cutForget;
// then it is tried again (an engine restarted as another version, or a
// verdict that a foreign client's request misled). A check no scrape
// settled within cutUnsettled (the engine's metrics failed meanwhile) is
// dropped: it no longer holds the engine's cuts back.

const (
	cutDelay     = 50 * time.Millisecond
	cutForget    = 10 * time.Minute
	cutUnsettled = 5 * time.Second
)

// cutChecks is an endpoint's record of its cuts.
type cutChecks struct {
	mu     sync.Mutex
	due    time.Time // a check is pending: the first scrape completed after due settles it
	kept   int
	freed  int
	refuse time.Time // no cut before this
}

// Cut tells the endpoint that the router cut one of its requests to give
// its place to another; the next scrape after cutDelay checks whether the
// engine stopped it.
func (e *Endpoint) Cut() {
	if f := e.owner; f == nil || f.ramp == nil || e.metricsFailing.Load() || e.noMetricsUntil.Load() != 0 {
		return // no scrape will tell: presumed to stop
	}
	c := &e.cuts
	c.mu.Lock()
	pending := c.pending(time.Now())
	if !pending {
		c.due = time.Now().Add(cutDelay)
	}
	c.mu.Unlock()
	if !pending {
		e.scrapeIn(cutDelay)
	}
}

// TakesBack reports whether a cut of one of its requests frees the
// engine's place: not while the engine is known to go on with what it was
// cut from, nor while its first cut is not settled. An engine whose
// metrics the router does not read is presumed to stop (every real engine
// kvroute speaks to does).
func (e *Endpoint) TakesBack() bool {
	c := &e.cuts
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now()
	if c.freed == 0 && c.pending(now) {
		return false // the probe
	}
	return c.refuse.IsZero() || now.After(c.refuse)
}

// pending reports whether a check waits for a scrape, dropping one that
// waited cutUnsettled; c.mu is held.
func (c *cutChecks) pending(now time.Time) bool {
	if !c.due.IsZero() && now.Sub(c.due) > cutUnsettled {
		c.due = time.Time{}
	}
	return !c.due.IsZero()
}

// scraped settles a pending check with the scrape st.
func (c *cutChecks) scraped(st *EngineStats) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.due.IsZero() || st.At.Before(c.due) {
		return
	}
	c.due = time.Time{}
	if st.Foreign() > 0 {
		c.kept++
	} else {
		c.freed++
	}
	if c.kept > c.freed {
		c.refuse = st.At.Add(cutForget)
		c.kept, c.freed = 0, 0
	}
}

// scrapeIn asks the scraper for a scrape of e in d (dropped when the
// scraper is behind: its next round comes anyway); its fleet scrapes.
func (e *Endpoint) scrapeIn(d time.Duration) {
	f := e.owner
	time.AfterFunc(d, func() {
		select {
		case f.ramp <- e:
		default:
		}
	})
}
