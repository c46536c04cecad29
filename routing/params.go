package routing

import "strconv"

// PrefixParams are the prefix policy's tunables. They may be replaced at
// run time (SetParams) without a restart. Times are in seconds of engine
// time, so they hold whatever the engine's speed.
//
// The wait model's four engine constants (PrefillTokensPerSec,
// DecodeCostSec, QueueCostSec, BatchLimit) are priors: each endpoint's own
// values are learned from what kvroute observes (discovery.Costs) and
// replace them as they are measured, unless Pinned names them.
type PrefixParams struct {
	// PrefillTokensPerSec is the prior prefill rate: 20,000 tokens/s for an
	// 8B model on one H100 (16 GFLOP per token at about a third of its 989
	// bf16 TFLOPS). It turns prompt tokens still to compute into seconds.
	// Learned per endpoint as the slope of its TTFT in the tokens to
	// compute.
	PrefillTokensPerSec float64 `json:"prefill_tokens_per_sec"`
	// DecodeCostSec is the prior cost of one more in-flight request on an
	// endpoint: one decode step. A new request waits for the steps of the
	// requests running beside it, and slows each of them by its own share of
	// every step. Learned per endpoint as the engine's mean inter-token latency
	// (its scraped histogram); the 10 ms prior is an 8B model's on an H100 at
	// moderate batch (BENCHMARKS.md, "Measurements behind the code").
	DecodeCostSec float64 `json:"decode_cost_sec"`
	// BatchLimit is the prior number of requests an endpoint runs at once
	// (vLLM's max_num_seqs, or fewer when its KV cache fills); past it a
	// new request waits for a place, each request beyond costing the
	// endpoint's mean decode time ÷ the limit. 0: unknown until learned,
	// per endpoint, as the most requests the engine was seen running while
	// others waited.
	BatchLimit int `json:"batch_limit"`
	// SpillMarginSec is how much longer the wait behind the warm endpoint
	// may be than the best idle endpoint's (recompute included) before the
	// request spills there. Larger is stickier: more hits, longer queues
	// (the default's measurements: BENCHMARKS.md, "Measurements behind the code").
	SpillMarginSec float64 `json:"spill_margin_sec"`
	// SpillRatio makes the margin grow with load: the warm endpoint keeps
	// the request while its wait is at most SpillRatio × the best idle
	// endpoint's wait + SpillMarginSec. Only idle endpoints (nothing
	// queued: scraped num_requests_waiting 0, or without a fresh scrape
	// less than SpillMarginSec of prefill pending) take spills, so when
	// every endpoint queues nothing spills — a spill then only adds a
	// recompute (the affinity collapse of routers that flip to least-load
	// under load).
	SpillRatio float64 `json:"spill_ratio"`
	// SpillMaxKVUsage: a freshly scraped endpoint takes spills only while its
	// engine's KV usage (blocks held by running requests) is below this. Above
	// it, the spilled prompt is cached by evicting the prefixes homed there, so a
	// saturated fleet would trade its hit rate for spills that only move the
	// queue (BENCHMARKS.md, "Measurements behind the code"). An endpoint idle
	// enough to be worth spilling to runs a few requests and sits far below 0.8.
	SpillMaxKVUsage float64 `json:"spill_max_kv_usage"`
	// MinMatchBlocks is the least match that makes an endpoint warm. It is
	// also the depth of the block that keys rendezvous hashing, so a
	// shared prefix shorter than MinMatchBlocks blocks is invisible to the
	// policy: with 1 KiB blocks and 2, prompts sharing 380 tokens (about
	// 1.8 KiB) all had keys of their own and every decision was cold, down
	// to least-request's hit rate under cache pressure on both engines
	// (0.16 against fixed affinity's 0.54-0.61, issue #24); with 1, 0.54
	// and 0.58. A short prefix every endpoint holds does not pin the
	// fleet: it is balanced by load (picks.preferHome).
	MinMatchBlocks int `json:"min_match_blocks"`
	// TieSec: endpoints whose costs differ by less are tied; ties go to the
	// rendezvous-hash winner, so replicas agree and prefixes spread.
	TieSec float64 `json:"tie_sec"`
	// QueueCostSec is the prior wait one request queued in the engine
	// (scraped num_requests_waiting) adds: about one typical prefill, 2k
	// tokens at 20k tokens/s. The engine's queue includes other routers'
	// requests, which the in-flight counters cannot see. Learned per
	// endpoint as the mean prefill time of its requests, or the time a
	// place in its batch takes to free up, whichever is longer.
	QueueCostSec float64 `json:"queue_cost_sec"`
	// KVCostSec is the wait added at a full KV cache (scraped usage 1.0),
	// linearly: a full cache admits new prompts only as sequences finish and
	// evicts cached prefixes to do so.
	KVCostSec float64 `json:"kv_cost_sec"`
	// HomeLoadFactor bounds how unevenly recurring prefixes are homed: no
	// endpoint homes more than HomeLoadFactor × the mean (see homes). 1
	// balances exactly and moves the most prefixes off their rendezvous
	// winner; rendezvous alone is the limit of a large factor. 1.1 puts at
	// most 9 of 64 prefixes on any of 8 endpoints, where rendezvous alone
	// put 12 or 13 on one.
	HomeLoadFactor float64 `json:"home_load_factor"`
	// Pinned names the constants that are not learned: each stays at its
	// value here on every endpoint. Names are the JSON field names:
	// prefill_tokens_per_sec, decode_cost_sec, queue_cost_sec, batch_limit.
	Pinned []string `json:"pinned,omitempty"`
}

// The learnable constants, by JSON name.
const (
	PinPrefillRate = "prefill_tokens_per_sec"
	PinDecodeCost  = "decode_cost_sec"
	PinQueueCost   = "queue_cost_sec"
	PinBatchLimit  = "batch_limit"
)

// pins is the set of pinned constants as bits, computed once per decision
// rather than per endpoint.
type pins uint8

const (
	pinPrefill pins = 1 << iota
	pinDecode
	pinQueue
	pinLimit
)

// pins returns p.Pinned as a set.
func (p *PrefixParams) pins() pins {
	var s pins
	for _, n := range p.Pinned {
		switch n {
		case PinPrefillRate:
			s |= pinPrefill
		case PinDecodeCost:
			s |= pinDecode
		case PinQueueCost:
			s |= pinQueue
		case PinBatchLimit:
			s |= pinLimit
		}
	}
	return s
}

// DefaultPrefixParams returns the documented defaults.
func DefaultPrefixParams() PrefixParams {
	return PrefixParams{
		PrefillTokensPerSec: 20000,
		DecodeCostSec:       0.01,
		SpillMarginSec:      0.05,
		SpillRatio:          1.25,
		SpillMaxKVUsage:     0.8,
		MinMatchBlocks:      1,
		TieSec:              0.001,
		QueueCostSec:        0.1,
		KVCostSec:           0.05,
		HomeLoadFactor:      1.1,
	}
}

// Validate reports a parameter set that cannot be used.
func (p PrefixParams) Validate() error {
	switch {
	case !(p.PrefillTokensPerSec > 0):
		return errBadParam("prefill_tokens_per_sec must be positive")
	case !(p.SpillRatio >= 1):
		return errBadParam("spill_ratio must be at least 1")
	case !(p.SpillMaxKVUsage > 0 && p.SpillMaxKVUsage <= 1):
		return errBadParam("spill_max_kv_usage must be in (0, 1]")
	case !(p.HomeLoadFactor >= 1):
		return errBadParam("home_load_factor must be at least 1")
	case p.DecodeCostSec < 0 || p.SpillMarginSec < 0 || p.TieSec < 0 || p.QueueCostSec < 0 || p.KVCostSec < 0:
		return errBadParam("decode_cost_sec, spill_margin_sec, tie_sec, queue_cost_sec and kv_cost_sec must not be negative")
	case p.MinMatchBlocks < 1:
		return errBadParam("min_match_blocks must be at least 1")
	case p.BatchLimit < 0:
		return errBadParam("batch_limit must not be negative")
	}
	for _, n := range p.Pinned {
		switch n {
		case PinPrefillRate, PinDecodeCost, PinQueueCost, PinBatchLimit:
		default:
			return errBadParam("pinned: unknown constant " + strconv.Quote(n) + " (want prefill_tokens_per_sec, decode_cost_sec, queue_cost_sec or batch_limit)")
		}
	}
	return nil
}

type errBadParam string

func (e errBadParam) Error() string { return "routing: " + string(e) }
