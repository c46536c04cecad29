package peers

import (
	"math/rand/v2"
	"sync"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// Blend is the Gateway API Inference Extension's default scheduling
// profile, the classic scorer blend llm-d also shipped
// (kubernetes-sigs/gateway-api-inference-extension
// pkg/epp/config/loader/defaults.go). Under
// pkg/epp/framework/plugins/scheduling/scorer/ it sums
//   - the prefix-cache scorer, matched blocks / prompt blocks, weight 3
//     (prefix/plugin.go: blocks of 16 tokens, at most 256 of them, so the
//     first 4,096 tokens; an LRU per pod of the engine's num_gpu_blocks
//     entries with autoTune, 31,250 before a scrape; the pick is recorded
//     in PreRequest, before the response);
//   - the queue scorer, (maxQ−q)/(maxQ−minQ) over the engines' waiting
//     queues, 1 when all are equal, weight 2 (queuedepth/queue.go);
//   - the KV-cache utilization scorer, 1 − KV-cache usage, weight 2
//     (kvcacheutilization/kvcache_utilization.go);
//
// and the max-score picker takes the highest total, shuffling the
// candidates before a stable sort by score, so ties go to one of them at
// random (pkg/epp/scheduling/framework/plugins/picker/max_score_picker.go,
// since GIE's PR #1205). The scorers read each pod's latest scraped
// metrics, which GIE refreshes every 50 ms (pkg/epp/server/options.go,
// --refresh-metrics-interval); the benchmark's gie-blend router scrapes
// that often too. Safe for concurrent use.
//
// Differences from the original:
//   - GIE hashes 16-token blocks; this emulation matches kvroute's chained
//     1 KiB blocks (≈ 256 tokens): the same 4,096 leading tokens (16
//     blocks) and LRUs of the same size in tokens, at a coarser grain.
//   - The latest scrape is the latest one this policy saw fresh (discovery
//     withdraws values older than three scrape intervals); before the
//     first, queues and KV usage read 0, as GIE's zero metrics do.
type Blend struct {
	idx                  *prefix.Index
	tokensPerBlock       int
	maxBlocks            int
	PrefixW, QueueW, KVW float64

	mu   sync.Mutex
	rnd  *rand.Rand
	seen map[uint64]*discovery.EngineStats // the latest scrape per endpoint
	tune autoTune
}

// GIE's prefix-cache scorer defaults (scorer/prefix/plugin.go).
const (
	gieBlockTokens      = 16     // DefaultBlockSizeTokens, vLLM's block size
	gieMaxPrefixBlocks  = 256    // DefaultMaxPrefixBlocks
	gieLRUBlocksPerPod  = 31_250 // DefaultLRUCapacityPerServer: an 8B model's 500k tokens on an H100
	gieMaxPrefixTokens  = gieBlockTokens * gieMaxPrefixBlocks
	gieDefaultLRUTokens = gieBlockTokens * gieLRUBlocksPerPod
)

// NewBlend returns GIE's classic blend with weights prefix 3, queue 2, KV
// 2 for a proxy hashing blockBytes-byte blocks; seed makes its tie-breaks
// reproducible.
func NewBlend(blockBytes int, seed uint64) *Blend {
	tpb := max(1, blockBytes/bytesPerToken)
	return &Blend{
		idx:            prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: max(1, gieDefaultLRUTokens/tpb), MaxEntries: 1 << 24}),
		tokensPerBlock: tpb,
		maxBlocks:      max(1, gieMaxPrefixTokens/tpb),
		PrefixW:        3, QueueW: 2, KVW: 2,
		rnd:  newRand(seed),
		seen: make(map[uint64]*discovery.EngineStats),
		tune: autoTune{},
	}
}

// stats returns the latest scrape of e this policy saw (nil: none yet),
// recording a fresh one. p.mu must be held.
func (p *Blend) stats(e *discovery.Endpoint) *discovery.EngineStats {
	if s := e.Engine(); s != nil {
		p.seen[e.ID] = s
		return s
	}
	return p.seen[e.ID]
}

// Pick implements routing.Picker.
func (p *Blend) Pick(r *routing.Request, set *discovery.Set) routing.Decision {
	hashes := r.Hashes[:min(len(r.Hashes), p.maxBlocks)]
	var buf [64]int
	depth := matchedBlocks(p.idx, hashes, set, buf[:0])
	var qbuf, kvbuf [64]float64
	queue, kv := qbuf[:0], kvbuf[:0]
	p.mu.Lock()
	minQ, maxQ, found := 0.0, 0.0, false
	for _, e := range set.Mixed {
		q, u := 0.0, 0.0
		if s := p.stats(e); s != nil {
			q, u = float64(s.Waiting), s.KVUsage
		}
		queue, kv = append(queue, q), append(kv, u)
		if !routing.Usable(r, e) {
			continue
		}
		if !found || q < minQ {
			minQ = q
		}
		if !found || q > maxQ {
			maxQ = q
		}
		found = true
	}
	if !found {
		p.mu.Unlock()
		return routing.Decision{Reason: ReasonBlend}
	}
	best, bestAt, bestScore, ties := (*discovery.Endpoint)(nil), -1, 0.0, 0
	for i, e := range set.Mixed {
		if !routing.Usable(r, e) {
			continue
		}
		var s float64
		if n := len(hashes); n > 0 {
			s += p.PrefixW * float64(depth[i]) / float64(n)
		}
		if maxQ > minQ {
			s += p.QueueW * (maxQ - queue[i]) / (maxQ - minQ)
		} else {
			s += p.QueueW
		}
		s += p.KVW * (1 - kv[i])
		switch {
		case best == nil || s > bestScore:
			best, bestAt, bestScore, ties = e, i, s, 1
		case s == bestScore: // shuffled, then stably sorted: uniform among the ties
			ties++
			if p.rnd.IntN(ties) == 0 {
				best, bestAt = e, i
			}
		}
	}
	resize := p.tune.resize(best, p.tokensPerBlock)
	p.mu.Unlock()
	record(p.idx, best, resize, hashes)
	return routing.Decision{Endpoint: best, Reason: ReasonBlend, MatchedBlocks: depth[bestAt],
		Prefill: uncached(r, depth[bestAt], p.tokensPerBlock), PromptTokens: r.PromptTokens}
}
