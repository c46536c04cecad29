package discovery

import "time"

// An engine's room: how many requests it runs at once (its batch limit,
// as learned or as it says), and whether the requests a router knows of
// (its own and its gossiping peers') fill it. A router holds the requests
// a full fleet cannot start in its own queue, where it can order them
// (proxy's fair queue), rather than in the engines' FIFO queues.

// FullFor bounds a backpressure mark (ReportShed): after it the endpoint
// is offered a request again even if the known load has not fallen (it
// may have fallen elsewhere: another client's requests).
const FullFor = 2 * time.Second

// Load is the requests in flight on the endpoint that the router knows
// of: its own and its gossiping peers' (as they last told).
func (e *Endpoint) Load() int64 { return e.InFlight() + e.PeerInFlight() }

// BatchLimit is the requests the engine runs at once: learned from its
// metrics (Costs.BatchLimit: the most it ran while others waited), else
// as the engine says (llama.cpp's slots); 0 while unknown.
func (e *Endpoint) BatchLimit() int64 {
	if c := e.Costs(); c != nil && c.BatchLimit > 0 {
		return int64(c.BatchLimit)
	}
	if i := e.Info(); i != nil && i.Slots > 0 {
		return int64(i.Slots)
	}
	return 0
}

// Full reports whether the endpoint answered 429 at a load it still has
// (ReportShed's backpressure), within FullFor: it takes no new request
// until a request ends. One atomic load when it is not full.
func (e *Endpoint) Full() bool {
	at := e.fullAt.Load()
	if at == 0 {
		return false
	}
	if time.Now().UnixNano() >= e.fullUntil.Load() {
		e.fullAt.CompareAndSwap(at, 0)
		return false
	}
	return e.Load() >= at
}

// HasRoom reports whether the engine would start a request now: the known
// load is below its room limit and it is not full.
func (e *Endpoint) HasRoom() bool {
	l := e.roomLimit()
	return (l == 0 || e.Load() < l) && !e.Full()
}

// SlowStart is the room limit of an engine whose metrics are read before
// they show its batch limit and before it was seen running anything; then
// the most it was seen running and a third as much again (rampLimit).
// Each time the router's load reaches that limit, the engine is scraped at
// once (rampScrape) rather than at the next round. A fleet's first flood
// so climbs a scrape at a time to the batch limit and learns it there,
// with at most a third of a batch waiting in each engine's queue, where
// the router can no longer order it: one request on an engine of four
// sequences; 16 steps, about 1.6 s, up to an engine of 256. Doubling once
// a scrape round (1 s) from 8 sent a cold router's first flood four
// requests deep into the queues of engines of four sequences, and the
// quiet tenants' requests of its first two seconds waited behind them
// (issue #38, kvsim: TTFT p90 0.4–0.6 s against 0.03 s settled); it also
// held an engine of 256 sequences below its batch for five seconds. An
// engine that queues on its KV cache instead (requests wait with the cache
// full, so no batch limit shows) keeps up to twice the most it ran: held
// at a third more, kvsim's shared-prefix past capacity served 2–3% fewer
// requests.
const SlowStart = 4

// rampLimit is the slow start's room limit after the engine was seen
// running peak requests at most.
func rampLimit(peak int64) int64 { return max(SlowStart, peak+max(1, peak/3)) }

// rampDelay is how long after the router's load reached the slow start's
// limit the engine is scraped: time for the engine to admit what it was
// sent, so that the scrape shows it running or waiting. rampGap is the
// least time between two such scrapes of one endpoint.
const (
	rampDelay = 50 * time.Millisecond
	rampGap   = 100 * time.Millisecond
)

// roomLimit is the known load at which the engine has no room: its batch
// limit; while that is unknown, the slow start's on an engine whose
// metrics are read (or not yet tried) and on a slot engine that has not
// said its slots yet; on one that serves no metrics and says nothing of
// its slots (Ollama), what the router saw it run (seenLimit); none (0)
// without calibration, when the router reads no metrics (--scrape-interval
// 0), or on an engine whose metrics scrape fails (kvroute cannot see it
// queue: a cap would hold its load at the slow start's for good).
func (e *Endpoint) roomLimit() int64 {
	if l := e.BatchLimit(); l > 0 {
		return l
	}
	if e.calib == nil || e.owner != nil && e.owner.o.Scrape.Disabled || e.metricsFailing.Load() {
		return 0
	}
	if e.metricsAbsent() {
		return seenLimit(e.peakRunning.Load())
	}
	c := e.Costs()
	if c == nil {
		return rampLimit(0)
	}
	if c.Queued {
		// It queues on its KV cache: no batch limit shows, and the
		// requests it holds beyond those running start as memory frees.
		return max(SlowStart, 2*int64(c.PeakRunning))
	}
	return rampLimit(int64(c.PeakRunning))
}

// metricsAbsent reports whether the engine serves no metrics to learn its
// batch limit from and says nothing of its slots: Ollama, or an engine
// whose /metrics answered 404 (405, 501), unless it is a llama.cpp server
// that has yet to say its slots.
func (e *Endpoint) metricsAbsent() bool {
	return e.Dialect() == DialectOllama || e.noMetricsUntil.Load() != 0 && (e.Dialect() != DialectLlamaCpp || e.Info() != nil)
}

// seenLimit is the room limit of an engine that publishes no batch limit,
// from the most requests it was seen running at once (peak: this router's
// and its peers' in flight less the streams still waiting for their first
// byte, at a first byte): that and a third as much again, at least one
// more; the slow start's before it was seen running anything. An engine
// with more slots starts more once sent more, so the limit climbs to its
// slots and a third; one with fewer keeps the rest in the router's queue,
// in the router's order. Before it, an Ollama server's room was unknown
// (no bound) once its /metrics had answered 404, else the slow start's
// four for good: which one depended on a race at the router's start. With
// no bound a flood waited in Ollama's own FIFO queue (kvtenants, stock
// Ollama of one slot: quiet tenants' TTFT p90 240–420× their alone, the
// flood's answers a minute late), with four it waited three deep there.
// A whole (unstreamed) response counts from its dispatch, queued or not:
// a fleet of whole responses only ever raises the limit.
func seenLimit(peak int64) int64 {
	if peak <= 0 {
		return SlowStart
	}
	return peak + max(1, peak/3)
}

// rampScrape asks for a scrape of e when the router's load there, n of
// its own requests in flight, has reached the slow start's limit: rampDelay
// from now, or rampGap after the last one it asked for, unless that one is
// still to come (it will see this load). Only while the batch limit is
// unknown and the limit binds: a fleet whose load stays below it, or whose
// batch limits are known, is scraped at its interval only.
func (e *Endpoint) rampScrape(n int64) {
	f := e.owner
	if f == nil || f.ramp == nil || e.BatchLimit() > 0 || e.metricsAbsent() {
		return
	}
	if l := e.roomLimit(); l == 0 || n+e.PeerInFlight() < l {
		return
	}
	now, last := time.Now().UnixNano(), e.rampAt.Load()
	at := max(now+int64(rampDelay), last+int64(rampGap))
	if last > now || !e.rampAt.CompareAndSwap(last, at) {
		return
	}
	e.scrapeIn(time.Duration(at - now))
}

// QueueRoom reports whether a request of a saturated fleet may still go to
// the endpoint to wait in its own queue: the known load is below its room
// limit plus QueueSlack (any load while the limit is unknown) and it is
// not full. A warm endpoint's short queue often beats a cold prefill
// elsewhere: when requests granted from a router's queue could go only
// where they start at once, shared-prefix on llm-d's simulator past its
// capacity fell from 89% of prompt tokens cached to 44%.
func (e *Endpoint) QueueRoom() bool {
	l := e.roomLimit()
	return (l == 0 || e.Load() < l+QueueSlack(l)) && !e.Full()
}

// QueueSlack is the requests a router lets wait in an engine's own queue
// beyond its room limit l once the fleet is saturated: half a batch, at
// least one. The router orders the rest.
func QueueSlack(l int64) int64 { return max(1, l/2) }

// Free is the engine's room limit less the known load — the requests it
// would start now, or, below 0, those waiting in its own queue — at most
// 0 when it is full; and its room limit (0: unknown, no bound the router
// knows of).
func (e *Endpoint) Free() (free, limit int64) {
	l := e.roomLimit()
	if l == 0 {
		return 0, 0
	}
	free = l - e.Load()
	if e.Full() {
		free = min(free, 0)
	}
	return free, l
}
