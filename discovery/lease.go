package discovery

// Lease is one request's claim on an endpoint. Acquire counts the request
// in the endpoint's in-flight requests and its uncached prompt tokens in
// the endpoint's pending prefill; FirstByte ends the prefill part (the
// endpoint has computed the prompt); Release ends the claim. Every method
// is idempotent, so a lease is released exactly once whatever the path
// (retries, errors, panics, the client leaving mid-stream). A Lease is a
// value owned by one goroutine at a time: pass it on with Take, which
// leaves the giver's copy empty. The zero Lease holds nothing.
type Lease struct {
	e       *Endpoint
	prefill int64 // pending-prefill tokens still counted; 0 after FirstByte
}

// Acquire claims e for one request that leaves prefillTokens of its prompt
// for the endpoint to compute.
func (e *Endpoint) Acquire(prefillTokens int) Lease {
	p := int64(max(prefillTokens, 0))
	e.inFlight.Add(1)
	e.pendingPrefill.Add(p)
	e.requests.Add(1)
	return Lease{e: e, prefill: p}
}

// Endpoint returns the leased endpoint (nil for the zero Lease).
func (l *Lease) Endpoint() *Endpoint { return l.e }

// Held reports whether the lease still claims its endpoint.
func (l *Lease) Held() bool { return l.e != nil }

// FirstByte ends the lease's pending prefill: the endpoint answered, so the
// prompt is computed. The request stays in flight.
func (l *Lease) FirstByte() {
	if l.e != nil && l.prefill != 0 {
		l.e.pendingPrefill.Add(-l.prefill)
		l.prefill = 0
	}
}

// Release ends the claim: the request leaves the endpoint's in-flight
// count, and its pending prefill too if no byte came back.
func (l *Lease) Release() {
	if l.e == nil {
		return
	}
	l.FirstByte()
	l.e.inFlight.Add(-1)
	l.e = nil
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

// PendingPrefill returns the prompt tokens of e's in-flight requests that
// e has not computed yet (this router's requests before their first
// response byte). One atomic load.
func (e *Endpoint) PendingPrefill() int64 { return e.pendingPrefill.Load() }

// Requests returns every request this router dispatched to e.
func (e *Endpoint) Requests() uint64 { return e.requests.Load() }
