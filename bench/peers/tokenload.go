package peers

import (
	"math"
	"math/rand/v2"
	"sync"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// TokenLoad is llm-d's token-load configuration, "sticky until saturated":
// the scheduling profile of the llm-d/llm-d guide optimized-baseline
// (guides/optimized-baseline/router/optimized-baseline.values.yaml), a
// filter, one scorer and the default max-score picker of llm-d/llm-d-router,
// fed by its in-flight-load and approximate-prefix producers. Per request,
// with paths under llm-d-router's pkg/epp/framework/plugins/:
//
//  1. prefix-cache-affinity filter
//     (scheduling/filter/prefixcacheaffinity/plugin.go, README.md): with
//     fewer than two candidates it keeps them. An endpoint is sticky when
//     its prefix score (matched blocks / prompt blocks) is at least
//     AffinityThreshold; with none sticky, all are kept. Each endpoint's
//     TTFT is estimated as its in-flight tokens ÷ PeakPrefill; if the best
//     sticky endpoint's exceeds the best other's by more than
//     MaxTTFTPenaltyMs, the load gate opens and all are kept. Otherwise
//     only the sticky endpoints are.
//  2. token-load scorer (scheduling/scorer/tokenload/token_load.go):
//     load = the endpoint's in-flight tokens + this request's tokens the
//     endpoint has not cached; score = 1 − min(load, QueueThresholdTokens)
//     ÷ QueueThresholdTokens (1 when load is 0).
//  3. max-score picker (scheduling/picker/maxscore/picker.go,
//     scheduling/picker/common.go): one endpoint of the highest score; ties
//     among the top scorers are broken by a round-robin counter shared
//     across picks (rotation = counter mod ties, reset when it reaches the
//     tie count), as llm-d-router does since its PRs #2515 and #2709
//     (2026); with ShuffleTies, uniformly at random instead, as GIE's
//     max-score picker and earlier llm-d-router releases do.
//
// In-flight tokens are the in-flight-load producer's
// (requestcontrol/dataproducer/inflightload/producer.go, README.md): per
// endpoint, the sum over its requests of the prompt tokens it had not
// cached at the pick (the prompt minus the matched blocks' tokens), each
// released when the response's first chunk arrives; here that is
// kvroute's own pending-prefill counter, which this policy's decisions
// feed with exactly that quantity. The approximate prefix index
// (requestcontrol/dataproducer/approximateprefix/README.md) records the
// chosen endpoint at once, before the response, and sizes each pod's LRU
// from the engine's num_gpu_blocks (autoTune). Safe for concurrent use.
//
// Differences from the original:
//   - Prefix scores use kvroute's chained 1 KiB blocks (≈ 256 tokens, at
//     most 256 of them) and token counts kvroute's estimate of 4 bytes per
//     token, where llm-d hashes the token ids of a tokenizer (or of its
//     own estimate) in blocks of the engine's block size, usually 16, up
//     to 131,072 tokens.
//   - PeakPrefill is calibrated for the simulated engine (see
//     NewTokenLoad), as the guide asks of every deployment; llm-d's
//     default, 15,928 tokens/s, is for Qwen3-32B on two H100s. It is not
//     recalibrated for a fleet running at another time scale.
//   - No exploration (explorationProbability, default 0) and no sharing
//     of in-flight load between router replicas.
type TokenLoad struct {
	idx            *prefix.Index
	tokensPerBlock int
	// AffinityThreshold is the prefix score at and above which an
	// endpoint is sticky (affinityThreshold, default 0.80).
	AffinityThreshold float64
	// MaxTTFTPenaltyMs is how much longer, in ms, the best sticky
	// endpoint's estimated TTFT may be than the best other's before the
	// load gate opens; 0 always sticks (maxTTFTPenaltyMs, default 18,000).
	MaxTTFTPenaltyMs float64
	// PeakPrefill is the peak prefill throughput in tokens/s that turns
	// in-flight tokens into a TTFT (peakPrefillThroughput).
	PeakPrefill float64
	// QueueThresholdTokens normalises the token-load score
	// (queueThresholdTokens, default 4,194,304: 128 requests of 32k).
	QueueThresholdTokens float64
	// ShuffleTies breaks score ties at random (seeded) instead of by the
	// round-robin counter.
	ShuffleTies bool

	mu   sync.Mutex
	rnd  *rand.Rand
	turn int // the picker's round-robin counter
	tune autoTune
}

// NewTokenLoad returns llm-d's token-load configuration with its defaults
// (threshold 0.80, penalty 18,000 ms, queue threshold 4,194,304 tokens)
// and the peak prefill throughput of the simulated engine calibrated as
// llm-d's recipe does, one unloaded chunk of max_num_batched_tokens:
// 8,192 tokens in 0.3 + 6.5 + 13 ms of step overheads plus 8,192/20,000 s
// of compute, ≈ 19,000 tokens/s (bench/sim's Llama-3.1-8B-on-H100 cost
// model at time scale 1). blockBytes is the proxy's hashing block size;
// blocksPerEndpoint sizes each endpoint's index LRU until the engine's KV
// capacity is scraped; seed makes ShuffleTies reproducible.
func NewTokenLoad(blockBytes, blocksPerEndpoint int, seed uint64) *TokenLoad {
	return &TokenLoad{
		idx:               prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: blocksPerEndpoint, MaxEntries: 1 << 24}),
		tokensPerBlock:    max(1, blockBytes/bytesPerToken),
		AffinityThreshold: 0.80, MaxTTFTPenaltyMs: 18_000, PeakPrefill: 19_000,
		QueueThresholdTokens: 4_194_304,
		rnd:                  newRand(seed),
		tune:                 autoTune{},
	}
}

// Pick implements routing.Picker.
func (p *TokenLoad) Pick(r *routing.Request, set *discovery.Set) routing.Decision {
	var dbuf, cbuf [64]int
	depth := matchedBlocks(p.idx, r.Hashes, set, dbuf[:0])
	cand := cbuf[:0]
	for i, e := range set.Mixed {
		if routing.Usable(r, e) {
			cand = append(cand, i)
		}
	}
	kept, reason := p.filter(r, set, depth, cand)
	if len(kept) == 0 {
		return routing.Decision{Reason: reason}
	}
	p.mu.Lock()
	at := p.pick(r, set, depth, kept)
	e := set.Mixed[at]
	resize := p.tune.resize(e, p.tokensPerBlock)
	p.mu.Unlock()
	record(p.idx, e, resize, r.Hashes)
	return routing.Decision{Endpoint: e, Reason: reason, MatchedBlocks: depth[at],
		Prefill: uncached(r, depth[at], p.tokensPerBlock), PromptTokens: r.PromptTokens}
}

// filter is the prefix-cache-affinity filter: it narrows cand (indices
// into set.Mixed, overwritten) to the sticky endpoints unless there is
// nothing to filter, none is sticky or the load gate opens, and says
// which.
func (p *TokenLoad) filter(r *routing.Request, set *discovery.Set, depth, cand []int) ([]int, string) {
	if len(cand) <= 1 || p.AffinityThreshold <= 0 {
		return cand, ReasonNotApplicable
	}
	n := len(r.Hashes)
	sticky := func(i int) bool { return n > 0 && float64(depth[i])/float64(n) >= p.AffinityThreshold }
	bestSticky, bestOther, nSticky := math.Inf(1), math.Inf(1), 0
	for _, i := range cand {
		ttft := p.ttftMs(set.Mixed[i])
		if sticky(i) {
			nSticky++
			bestSticky = min(bestSticky, ttft)
		} else {
			bestOther = min(bestOther, ttft)
		}
	}
	switch {
	case nSticky == 0:
		return cand, ReasonNoMatch
	case p.MaxTTFTPenaltyMs > 0 && nSticky < len(cand) && bestSticky-bestOther > p.MaxTTFTPenaltyMs:
		return cand, ReasonLoadOverride
	}
	kept := cand[:0]
	for _, i := range cand {
		if sticky(i) {
			kept = append(kept, i)
		}
	}
	return kept, ReasonSticky
}

// ttftMs is the filter's TTFT estimate for e in ms: its in-flight
// uncached tokens over the peak prefill throughput.
func (p *TokenLoad) ttftMs(e *discovery.Endpoint) float64 {
	return float64(e.PendingPrefill()) / p.PeakPrefill * 1000
}

// score is the token-load scorer's score of e for r when e holds r's
// first matched blocks.
func (p *TokenLoad) score(r *routing.Request, e *discovery.Endpoint, matched int) float64 {
	load := float64(e.PendingPrefill()) + float64(uncached(r, matched, p.tokensPerBlock))
	if load <= 0 {
		return 1
	}
	return 1 - min(load, p.QueueThresholdTokens)/p.QueueThresholdTokens
}

// pick is the max-score picker over kept (indices into set.Mixed, in Set
// order): the index of the endpoint it picks. p.mu must be held.
func (p *TokenLoad) pick(r *routing.Request, set *discovery.Set, depth, kept []int) int {
	var tbuf [64]int
	ties, best := tbuf[:0], math.Inf(-1)
	for _, i := range kept {
		switch s := p.score(r, set.Mixed[i], depth[i]); {
		case s > best:
			best, ties = s, append(ties[:0], i)
		case s == best:
			ties = append(ties, i)
		}
	}
	switch {
	case len(ties) == 1:
		return ties[0]
	case p.ShuffleTies:
		return ties[p.rnd.IntN(len(ties))]
	}
	k := p.turn % len(ties)
	if p.turn++; p.turn >= len(ties) {
		p.turn = 0
	}
	return ties[k]
}
