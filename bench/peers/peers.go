// Package peers reimplements the routing policies of kvroute's peers, from
// their published designs and source (each type names the repository
// and file it follows), as routing.Pickers, so the benchmark
// can put each of them behind kvroute's own proxy and compare them with the
// prefix policy on the same fleet, workload and seed. Each type documents
// where the emulation necessarily differs from the original.
package peers

import (
	"math/rand/v2"
	"sync"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// Reasons of the peer policies.
const (
	ReasonCacheHit = "peer-cache-hit"
	ReasonBalance  = "peer-balance"
	ReasonBlend    = "peer-blend"
	ReasonSticky   = "peer-sticky"
	ReasonUnsticky = "peer-unsticky"
)

// matchScratch pools the match slices of all peers.
var matchScratch = sync.Pool{New: func() any { s := make([]prefix.Match, 0, 16); return &s }}

// matchedBlocks returns, aligned with set.Mixed, how many leading blocks
// of r each endpoint holds in idx, into dst.
func matchedBlocks(idx *prefix.Index, r *routing.Request, set *discovery.Set, dst []int) []int {
	sp := matchScratch.Get().(*[]prefix.Match)
	ms := idx.Match(r.Hashes, *sp)
	dst = dst[:0]
	for _, e := range set.Mixed {
		n := 0
		for _, m := range ms {
			if m.ID == e.ID {
				n = m.Blocks
				break
			}
		}
		dst = append(dst, n)
	}
	*sp = ms[:0]
	matchScratch.Put(sp)
	return dst
}

// CacheAware is SGLang's router cache_aware policy
// (sgl-model-gateway/src/policies/cache_aware.rs), with its Python-CLI
// defaults: load is the router's own in-flight count per worker; when
// max−min > BalanceAbs and max > min × BalanceRel the least-loaded worker
// gets the request; otherwise the worker with the deepest prefix match gets
// it if matched/total > CacheThreshold, else the least-loaded worker; the
// prompt is then inserted under the chosen worker.
//
// Differences from the original: SGLang matches characters in a radix tree
// per worker; this emulation matches kvroute's chained 1 KiB blocks (the
// ratio is matched blocks / prompt blocks), and its per-worker tree is an
// LRU of blocks capped at MaxTreeBlocks instead of a tree pruned every 120 s
// to max_tree_size characters. Ties among least-loaded workers go to the
// first in Set order where SGLang takes the first in its worker list.
type CacheAware struct {
	idx            *prefix.Index
	CacheThreshold float64
	BalanceAbs     int64
	BalanceRel     float64
}

// NewCacheAware returns SGLang's cache_aware with its Python-CLI defaults:
// cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5,
// max_tree_size 2^26 characters (≈ 65,536 blocks of 1 KiB).
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
	if !imbalanced && len(r.Hashes) > 0 {
		var buf [64]int
		depth := matchedBlocks(p.idx, r, set, buf[:0])
		best := -1
		for i, e := range set.Mixed {
			if routing.Usable(r, e) && depth[i] > 0 && (best < 0 || depth[i] > depth[best]) {
				best = i
			}
		}
		if best >= 0 && float64(depth[best])/float64(len(r.Hashes)) > p.CacheThreshold {
			chosen, reason = set.Mixed[best], ReasonCacheHit
		}
	}
	p.idx.Record(chosen.ID, r.Hashes)
	return routing.Decision{Endpoint: chosen, Reason: reason, Prefill: r.PromptTokens}
}

// Blend is the Gateway API Inference Extension's classic scorer blend (GIE
// v1.2, as llm-d shipped it): the weighted sum of a prefix score
// (matched blocks / prompt blocks), a queue score (maxQ−q)/(maxQ−minQ) (1
// when all are equal) and a KV score (1 − KV-cache usage), weights 3, 2, 2;
// the highest total wins, ties at random; the pick is recorded at once.
//
// Differences from the original: GIE hashes 64-byte blocks (≤ 256 per
// request, an LRU of 31,250 per pod); this emulation uses kvroute's 1 KiB
// blocks with the same bytes per pod (1,953 blocks). GIE polls engine
// metrics every 50 ms; here they are kvroute's scrapes (every second by
// default), and when none is fresh the queue is the router's own in-flight
// count and the KV score a constant.
type Blend struct {
	idx                  *prefix.Index
	PrefixW, QueueW, KVW float64
	mu                   sync.Mutex
	rnd                  *rand.Rand
}

// queue is the engine's waiting queue when freshly scraped, else the
// router's own in-flight count.
func (p *Blend) queue(e *discovery.Endpoint) float64 {
	if s := e.Engine(); s != nil {
		return float64(s.Waiting)
	}
	return float64(e.InFlight())
}

// kvUsage is the engine's KV-cache usage when freshly scraped.
func (p *Blend) kvUsage(e *discovery.Endpoint) (float64, bool) {
	if s := e.Engine(); s != nil {
		return s.KVUsage, true
	}
	return 0, false
}

// NewBlend returns GIE's classic blend with weights prefix 3, queue 2, KV 2.
// seed makes its tie-breaks reproducible.
func NewBlend(seed uint64) *Blend {
	return &Blend{
		idx:     prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: 31_250 * 64 / 1024, MaxEntries: 1 << 24}),
		PrefixW: 3, QueueW: 2, KVW: 2,
		rnd: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
	}
}

// Pick implements routing.Picker.
func (p *Blend) Pick(r *routing.Request, set *discovery.Set) routing.Decision {
	var buf [64]int
	depth := matchedBlocks(p.idx, r, set, buf[:0])
	minQ, maxQ := 0.0, 0.0
	first := true
	for _, e := range set.Mixed {
		if !routing.Usable(r, e) {
			continue
		}
		q := p.queue(e)
		if first || q < minQ {
			minQ = q
		}
		if first || q > maxQ {
			maxQ = q
		}
		first = false
	}
	if first {
		return routing.Decision{Reason: ReasonBlend}
	}
	var best *discovery.Endpoint
	bestScore, ties := -1.0, 0
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, e := range set.Mixed {
		if !routing.Usable(r, e) {
			continue
		}
		var s float64
		if n := len(r.Hashes); n > 0 {
			s += p.PrefixW * float64(depth[i]) / float64(n)
		}
		if maxQ > minQ {
			s += p.QueueW * (maxQ - p.queue(e)) / (maxQ - minQ)
		} else {
			s += p.QueueW
		}
		if kv, ok := p.kvUsage(e); ok {
			s += p.KVW * (1 - kv)
		} else {
			s += p.KVW
		}
		switch {
		case s > bestScore+1e-12:
			best, bestScore, ties = e, s, 1
		case s > bestScore-1e-12: // a tie: reservoir-sample uniformly
			ties++
			if p.rnd.IntN(ties) == 0 {
				best = e
			}
		}
	}
	p.idx.Record(best.ID, r.Hashes)
	return routing.Decision{Endpoint: best, Reason: ReasonBlend, Prefill: r.PromptTokens}
}

// Sticky is llm-d's sticky-until-saturated prefix-cache-affinity filter
// (llm-d-router, 2026): keep the endpoints whose prefix score (matched /
// prompt blocks) is at least StickyScore (all if none); estimate each
// endpoint's wait as its in-flight uncached tokens ÷ PeakPrefill; if the best
// sticky endpoint's wait exceeds the best other endpoint's by more than
// PenaltySec, drop stickiness; then pick the lowest in-flight-uncached load.
//
// Differences from the original: prefix scores use kvroute's 1 KiB blocks
// and approximate index instead of llm-d's 64-token blocks; in-flight
// uncached tokens are kvroute's own counter (the same quantity); the penalty
// keeps llm-d's default of 18 s, which was set for 32B models and long
// prompts and rarely opens on an 8B fleet.
type Sticky struct {
	idx            *prefix.Index
	tokensPerBlock int
	StickyScore    float64
	PeakPrefill    float64
	PenaltySec     float64
}

// NewSticky returns llm-d's filter with its defaults: score 0.8, penalty
// 18 s, and the peak prefill rate of an 8B model on one H100 (20k tok/s).
// blockBytes is the proxy's hashing block size; blocksPerEndpoint sizes the
// index like the engines' KV caches.
func NewSticky(blockBytes, blocksPerEndpoint int) *Sticky {
	return &Sticky{
		idx:            prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: blocksPerEndpoint, MaxEntries: 1 << 24}),
		tokensPerBlock: blockBytes / 4,
		StickyScore:    0.8, PeakPrefill: 20000, PenaltySec: 18,
	}
}

// Pick implements routing.Picker.
func (p *Sticky) Pick(r *routing.Request, set *discovery.Set) routing.Decision {
	var buf [64]int
	depth := matchedBlocks(p.idx, r, set, buf[:0])
	wait := func(e *discovery.Endpoint) float64 { return float64(e.PendingPrefill()) / p.PeakPrefill }
	var bestSticky, bestOther *discovery.Endpoint
	for i, e := range set.Mixed {
		if !routing.Usable(r, e) {
			continue
		}
		sticky := len(r.Hashes) > 0 && float64(depth[i])/float64(len(r.Hashes)) >= p.StickyScore
		if sticky {
			if bestSticky == nil || wait(e) < wait(bestSticky) {
				bestSticky = e
			}
		} else if bestOther == nil || wait(e) < wait(bestOther) {
			bestOther = e
		}
	}
	chosen, reason := bestOther, ReasonUnsticky
	if bestSticky != nil && (bestOther == nil || wait(bestSticky) <= wait(bestOther)+p.PenaltySec) {
		chosen, reason = bestSticky, ReasonSticky
	}
	if chosen == nil {
		return routing.Decision{Reason: ReasonUnsticky}
	}
	uncached := r.PromptTokens
	for i, e := range set.Mixed {
		if e == chosen {
			uncached = max(0, r.PromptTokens-depth[i]*p.tokensPerBlock)
		}
	}
	p.idx.Record(chosen.ID, r.Hashes)
	return routing.Decision{Endpoint: chosen, Reason: reason, Prefill: uncached}
}
