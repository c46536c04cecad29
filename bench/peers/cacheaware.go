package peers

import (
	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// CacheAware is SGLang's router cache_aware policy
// (sgl-project/sglang sgl-model-gateway/src/policies/cache_aware.rs and
// tree.rs), with the defaults of its Python CLI (RouterArgs in
// sglang_router's router_args.py). Load is the router's own in-flight
// count per worker. When max−min > BalanceAbs and max > min × BalanceRel
// the least-loaded worker gets the request (the first of the list on a
// tie, Rust's min_by_key). Otherwise the approximate radix tree of all
// workers' past prompts is matched: if the matched share of the prompt
// exceeds CacheThreshold, the request goes to a worker holding the deepest
// match, else to the least-loaded worker. Either way the prompt is then
// inserted under the chosen worker. Safe for concurrent use.
//
// Differences from the original:
//   - SGLang matches characters in one radix tree; this emulation matches
//     kvroute's chained 1 KiB blocks (the ratio is matched blocks / prompt
//     blocks, the proxy hashing at most 256 blocks), and each worker's
//     share of the tree is an LRU of blocks capped at 2^26 characters
//     instead of being pruned every 120 s down to max_tree_size.
//   - When several workers hold the deepest match, SGLang returns the first
//     tenant of the deepest tree node's map: an order fixed per node and
//     unrelated to load or to the worker list. The emulation keeps that
//     property by ranking the tied endpoints on a hash of the deepest
//     matched block and the endpoint.
//   - SGLang's min and max load span every worker, healthy or not; the
//     emulation's span the usable ones (routable, not already tried), and
//     it never falls back to the first healthy worker because the matched
//     one is unhealthy: an unusable endpoint is never matched.
type CacheAware struct {
	idx            *prefix.Index
	CacheThreshold float64
	BalanceAbs     int64
	BalanceRel     float64
}

// NewCacheAware returns SGLang's cache_aware with its Python-CLI defaults:
// cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5,
// max_tree_size 2^26 characters (65,536 blocks of 1 KiB).
func NewCacheAware() *CacheAware {
	return &CacheAware{
		idx:            prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: 1 << 16, MaxEntries: 1 << 24}),
		CacheThreshold: 0.3, BalanceAbs: 64, BalanceRel: 1.5,
	}
}

// Pick implements routing.Picker.
func (p *CacheAware) Pick(r *routing.Request, set *discovery.Set) routing.Decision {
	var least, most *discovery.Endpoint
	for _, e := range set.Mixed {
		if !routing.Usable(r, e) {
			continue
		}
		if least == nil || e.InFlight() < least.InFlight() {
			least = e
		}
		if most == nil || e.InFlight() > most.InFlight() {
			most = e
		}
	}
	if least == nil {
		return routing.Decision{Reason: ReasonBalance}
	}
	chosen, reason := least, ReasonBalance
	lo, hi := least.InFlight(), most.InFlight()
	imbalanced := hi-lo > p.BalanceAbs && float64(hi) > float64(lo)*p.BalanceRel
	if n := len(r.Hashes); !imbalanced && n > 0 {
		var buf [64]int
		depth := matchedBlocks(p.idx, r.Hashes, set, buf[:0])
		var deepest *discovery.Endpoint
		d, rank := 0, uint64(0)
		for i, e := range set.Mixed {
			if !routing.Usable(r, e) || depth[i] == 0 || depth[i] < d {
				continue
			}
			// The node's own order among the workers tied on it.
			k := prefix.Mix64(r.Hashes[depth[i]-1] ^ e.ID)
			if depth[i] > d || k < rank {
				deepest, d, rank = e, depth[i], k
			}
		}
		if deepest != nil && float64(d)/float64(n) > p.CacheThreshold {
			chosen, reason = deepest, ReasonCacheHit
		}
	}
	p.idx.Record(chosen.ID, r.Hashes)
	return routing.Decision{Endpoint: chosen, Reason: reason, Prefill: r.PromptTokens}
}
