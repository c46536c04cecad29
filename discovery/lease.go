package discovery

import "time"

// Lease is one request's claim on an endpoint. Acquire counts the request
// in the endpoint's in-flight requests and its uncached prompt tokens in
// the endpoint's pending prefill; FirstByte ends the prefill part (the
// endpoint has computed the prompt); Release or Complete ends the claim.
// Every method is idempotent, so a lease is released exactly once whatever
// the path (retries, errors, panics, the client leaving mid-stream). A
// Lease is a value owned by one goroutine at a time: pass it on with Take,
// which leaves the giver's copy empty. The zero Lease holds nothing.
//
// A lease is also how the endpoint learns its costs (Costs): a streamed
// response's time to first byte is a TTFT observation against the load
// found at Acquire, recorded with its decode time when the stream
// completes, when the engine may also have said how many of the prompt's
// tokens it had to compute.
type Lease struct {
	e       *Endpoint
	prefill int64 // pending-prefill tokens still counted; 0 after FirstByte
	// At Acquire: the time, the request's own prefill tokens, and the
	// endpoint's pending prefill and in-flight requests before it.
	start              time.Time
	own, ahead, before int64
	// loaded is the prompt tokens the policy expected the endpoint to
	// load from a slower tier (Loading).
	loaded int64
	// firstByte is when a streamed response's first byte came (zero: not
	// yet, or not streamed).
	firstByte time.Time
	// adapter is the LoRA adapter the request names, counted in the
	// endpoint's adapters in flight ("" for none).
	adapter string
	// key is the prompt key the request counts under (ForPrompt; 0: none).
	key uint64
	// awaiting: a stream counted in the endpoint's awaiting until its
	// first byte (Streams).
	awaiting bool
}

// Uncomputed is Complete's argument when the engine did not report how
// many prompt tokens it computed: the policy's estimate stands.
const Uncomputed = -1

// Acquire claims e for one request that leaves prefillTokens of its prompt
// for the endpoint to compute.
func (e *Endpoint) Acquire(prefillTokens int) Lease {
	p := int64(max(prefillTokens, 0))
	n := e.inFlight.Add(1)
	ahead := e.pendingPrefill.Add(p) - p
	e.requests.Add(1)
	l := Lease{e: e, prefill: p, own: p, ahead: ahead, before: n - 1}
	if e.calib != nil {
		// The load the request meets is the router replicas' together,
		// as the wait model counts it (their gossip).
		l.ahead += e.PeerPrefill()
		l.before += e.PeerInFlight()
		l.start = time.Now()
		e.rampScrape(n)
	}
	return l
}

// FirstByte ends the lease's pending prefill: the endpoint answered, so the
// prompt is computed. The request stays in flight. streamed tells whether
// the response is a stream whose first byte is its first token (an SSE
// response), which makes it a TTFT observation; a whole response's first
// byte comes only after the generation.
func (l *Lease) FirstByte(streamed bool) {
	if l.e == nil || l.prefill < 0 {
		return
	}
	e := l.e
	e.pendingPrefill.Add(-l.prefill)
	l.prefill = -1 // done
	if e.calib != nil && streamed {
		l.firstByte = time.Now()
	}
	if l.awaiting {
		l.awaiting = false
		e.awaiting.Add(-1)
	}
	// What the engine is seen running now: every request in flight but
	// the streams still waiting for their first byte (a whole response is
	// counted from its dispatch, which can only count more).
	run := e.inFlight.Load() + e.peerInFlight.Load() - e.awaiting.Load()
	for p := e.peakRunning.Load(); run > p && !e.peakRunning.CompareAndSwap(p, run); p = e.peakRunning.Load() {
	}
}

// Streams marks the lease's request as a stream: until its first byte the
// engine is not seen running it (seenLimit). Called once, right after
// Acquire.
func (l *Lease) Streams() {
	if l.e == nil || l.awaiting || l.prefill < 0 {
		return
	}
	l.awaiting = true
	l.e.awaiting.Add(1)
}

// Loading notes that the endpoint is expected to load tokens of the
// prompt from a slower tier than the GPU (routing.Decision.Loaded), for the
// TTFT observation.
func (l *Lease) Loading(tokens int) {
	l.loaded = int64(max(tokens, 0))
}

// AddPrefill adds tokens to the prompt the endpoint is to compute, before
// its first byte: a request planned for a prefill leg that the endpoint
// serves alone after all.
func (l *Lease) AddPrefill(tokens int) {
	if l.e == nil || l.prefill < 0 || tokens <= 0 {
		return
	}
	t := int64(tokens)
	l.e.pendingPrefill.Add(t)
	l.prefill += t
	l.own += t
}

// Release ends the claim: the request leaves the endpoint's in-flight
// count, and its pending prefill too if no byte came back.
func (l *Lease) Release() {
	if l.e == nil {
		return
	}
	if l.prefill > 0 {
		l.e.pendingPrefill.Add(-l.prefill)
	}
	if l.awaiting {
		l.e.awaiting.Add(-1)
	}
	l.e.inFlight.Add(-1)
	if l.adapter != "" {
		e := l.e
		e.adapterMu.Lock()
		if e.adapters[l.adapter]--; e.adapters[l.adapter] <= 0 {
			delete(e.adapters, l.adapter)
		}
		e.adapterMu.Unlock()
	}
	if l.key != 0 {
		l.e.promptEnded(l.key)
	}
	*l = Lease{}
}

// ForAdapter counts the lease's request as one for LoRA adapter name in
// its endpoint's adapters in flight (AdaptersInFlight) until it is
// released. Once per lease.
func (l *Lease) ForAdapter(name string) {
	if l.e == nil || l.adapter != "" || name == "" {
		return
	}
	e := l.e
	e.adapterMu.Lock()
	if e.adapters == nil {
		e.adapters = make(map[string]int)
	}
	e.adapters[name]++
	e.adapterMu.Unlock()
	l.adapter = name
}

// AdaptersInFlight appends to dst the LoRA adapters of this router's
// requests in flight at e (Lease.ForAdapter).
func (e *Endpoint) AdaptersInFlight(dst []string) []string {
	e.adapterMu.Lock()
	defer e.adapterMu.Unlock()
	for a := range e.adapters {
		dst = append(dst, a)
	}
	return dst
}

// Complete is Release for a response delivered in full. A streamed one is
// an observation of the endpoint's costs: its time to first byte and its
// decode time. computed is the prompt tokens the engine reported it
// computed (prompt_tokens − cached_tokens of its usage), which replace the
// policy's estimate in the TTFT observation; Uncomputed if it did not say.
func (l *Lease) Complete(computed int) {
	if l.e != nil && !l.firstByte.IsZero() {
		if c := l.e.calib; c != nil {
			own, loaded := l.own, l.loaded
			if computed >= 0 {
				own = int64(computed)
				// What the engine computed beyond the estimate was not
				// loaded either: the slower tier had lost it.
				loaded = max(0, loaded-max(0, own-l.own))
			}
			c.observe(l.firstByte.Sub(l.start), time.Since(l.firstByte), own, loaded, l.ahead, l.before)
		}
	}
	l.Release()
}

// TTFT returns the lease's time to first byte when its response streamed
// (0: not streamed, or no first byte yet).
func (l *Lease) TTFT() time.Duration {
	if l.e == nil || l.firstByte.IsZero() {
		return 0
	}
	return l.firstByte.Sub(l.start)
}

// PredictTTFT returns the time to first byte the endpoint's learned costs
// predict for the lease's request had the endpoint computed own of its
// prompt tokens, with the load it found at Acquire; 0 when the endpoint
// has no costs measured yet.
func (l *Lease) PredictTTFT(own int) time.Duration {
	if l.e == nil {
		return 0
	}
	c := l.e.costs.Load()
	if c == nil || c.TTFTSamples == 0 {
		return 0
	}
	sec := c.FixedSec + float64(own)/c.PrefillTokensPerSec + float64(l.ahead)/c.PendingTokensPerSec + float64(l.before)*c.InFlightSec
	return time.Duration(sec * float64(time.Second))
}

// Take returns the lease and empties l: the new owner releases it.
func (l *Lease) Take() Lease {
	t := *l
	*l = Lease{}
	return t
}

// InFlight returns the requests this router dispatched to e and has not
// finished. One atomic load.
func (e *Endpoint) InFlight() int64 { return e.inFlight.Load() }

// PeerInFlight returns the other router replicas' requests in flight at e,
// as their gossip last told (0 without). One atomic load.
func (e *Endpoint) PeerInFlight() int64 { return e.peerInFlight.Load() }

// SetPeerInFlight sets the other router replicas' requests in flight at e
// (their gossip, summed over them).
func (e *Endpoint) SetPeerInFlight(n int64) { e.peerInFlight.Store(max(n, 0)) }

// PendingPrefill returns the prompt tokens of e's in-flight requests that
// e has not computed yet (this router's requests before their first
// response byte). One atomic load.
func (e *Endpoint) PendingPrefill() int64 { return e.pendingPrefill.Load() }

// Requests returns every request this router dispatched to e.
func (e *Endpoint) Requests() uint64 { return e.requests.Load() }
