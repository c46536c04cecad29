package routing

import "github.com/kvroute/kvroute/discovery"

// load is an endpoint's load at decision time, each counter read once.
type load struct {
	inFlight int64                  // this router's requests in flight
	peer     int64                  // the gossiping replicas' requests in flight (their last report)
	pending  int64                  // prefill tokens not yet computed: this router's, its peers' placements' (their gossip), and those not yet told (Endpoint.UnheardPrefill)
	eng      *discovery.EngineStats // the engine's own view; nil unless freshly scraped
	costs    *discovery.Costs       // the endpoint's learned costs; nil until measured
}

func loadOf(e *discovery.Endpoint) load {
	return load{inFlight: e.InFlight(), peer: e.PeerInFlight(), pending: e.PendingPrefill() + e.PeerPrefill() + e.UnheardPrefill(), eng: e.Engine(), costs: e.Costs()}
}

// rates are the wait model's constants for one endpoint: its learned costs
// where measured and not pinned, else the parameters (the priors). The
// fitted fixed latency (discovery.Costs.FixedSec) is left out: it isolates
// the rates in the fit, but per endpoint it also absorbs whatever load the
// fit does not model, so comparing endpoints by it would route by noise.
type rates struct {
	prefill float64 // uncached prompt tokens computed per second
	load    float64 // cached tokens loaded from a slower tier per second
	pending float64 // pending prefill tokens ahead drained per second
	decode  float64 // seconds per request in flight
	queue   float64 // seconds per request waiting in the engine
	slot    float64 // seconds per request beyond the batch limit
	limit   int64   // requests the engine runs at once; 0: unknown
	// turnover is how long a request holds its place in the batch: the
	// measured decode time, the queue cost until measured.
	turnover float64
}

// ratesOf returns the constants for an endpoint whose learned costs are c
// (nil: none yet), with pinned (p.pins()) kept at p's values.
func (p *PrefixParams) ratesOf(c *discovery.Costs, pinned pins) rates {
	r := rates{prefill: p.PrefillTokensPerSec, pending: p.PrefillTokensPerSec, load: p.PrefillTokensPerSec * discovery.LoadSpeedup,
		decode: p.DecodeCostSec, queue: p.QueueCostSec, limit: int64(p.BatchLimit), turnover: p.QueueCostSec}
	if c == nil {
		return r
	}
	if c.DecodeSec > 0 {
		r.turnover = c.DecodeSec
	}
	if pinned&pinPrefill == 0 {
		r.prefill, r.pending = c.PrefillTokensPerSec, c.PendingTokensPerSec
		r.load = c.LoadTokensPerSec
		if r.load <= 0 {
			r.load = r.prefill * discovery.LoadSpeedup
		}
	}
	if pinned&pinDecode == 0 && c.DecodeStepSec > 0 {
		r.decode = c.DecodeStepSec
	}
	if pinned&pinLimit == 0 && c.BatchLimit > 0 {
		r.limit = int64(c.BatchLimit)
	}
	if r.limit > 0 && c.DecodeSec > 0 {
		// A place in the batch frees up every decode time ÷ limit.
		r.slot = c.DecodeSec / float64(r.limit)
	}
	if pinned&pinQueue == 0 && c.PrefillTokens > 0 {
		r.queue = max(c.PrefillTokens/r.prefill, r.slot)
	}
	return r
}

// wait is the wait model of Prefix's doc comment: the seconds until a
// request leaving uncached tokens to compute, and loaded cached tokens to
// load from a slower tier, gets its first token on an endpoint under load
// l with constants r. wait takes the larger of the
// router's and the engine's view of each term; own is the routers' view
// alone: this router's counters and what its gossiping peers reported,
// without the engine's scrape. idle reports whether the endpoint may take
// spills: nothing queued there in either view, a free place in its batch,
// and KV room in the engine's view.
func (p *PrefixParams) wait(l load, r rates, uncached, loaded int) (wait, own float64, idle bool) {
	prefill := float64(uncached)/r.prefill + float64(loaded)/r.load
	queue := float64(l.pending) / r.pending
	var slot float64
	// The gossiping replicas' requests in flight (their reports) count as
	// this router's own: each replica sees a fraction of an endpoint's
	// load, and eight of them, each spilling on its own alone, kept
	// sending a pod more than twice its share while others idled
	// (multi-turn: TTFT p90 0.2 s against 0.04 s for one router).
	mine := l.inFlight + l.peer
	if r.limit > 0 && mine >= r.limit {
		slot = float64(mine-r.limit+1) * r.slot
	}
	own = queue + slot + prefill + float64(mine)*r.decode
	// When every endpoint queues, a spill just adds a recompute.
	idle = queue <= p.SpillMarginSec && (r.limit == 0 || l.inFlight < r.limit)
	eng := l.eng
	if eng == nil && l.peer == 0 {
		return own, own, idle
	}
	// The engine also runs other clients' requests: in the engine's view,
	// those beyond all the routers' at the time of the scrape (clients
	// bypassing kvroute, replicas that do not gossip). They are added to
	// the routers' counters, which are current (the peers' within a tenth
	// of a second), where the scrape is up to an interval old: taking the
	// engine's whole count instead kept a drained endpoint looking busy
	// for an interval, and traffic herded elsewhere meanwhile.
	var foreign, waiting int64
	if eng != nil {
		foreign, waiting = eng.Foreign(), eng.Waiting
	}
	inFlight := mine + foreign
	if r.limit > 0 && inFlight >= r.limit {
		slot = float64(inFlight-r.limit+1) * r.slot
	}
	queue += slot + float64(min(waiting, foreign))*r.queue
	wait = queue + prefill + float64(inFlight)*r.decode
	if l.peer > 0 { // the peers' requests fill the batch too
		idle = idle && (r.limit == 0 || inFlight < r.limit)
	}
	if eng == nil {
		return wait, own, idle
	}
	wait += eng.KVUsage * p.KVCostSec
	// A spilled prompt fills a nearly full cache by evicting the prefixes
	// homed there, whose next requests then recompute.
	idle = idle && eng.Waiting == 0 && eng.KVUsage < p.SpillMaxKVUsage
	return wait, own, idle
}
