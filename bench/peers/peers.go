// Package peers reimplements the routing policies of kvroute's peers, from
// their source (each type names the repository and files it follows), as
// routing.Pickers, so the benchmark can put each of them behind kvroute's
// own proxy and compare them with the prefix policy on the same fleet,
// workload and seed. Each type documents where the emulation necessarily
// differs from the original; their randomness is seeded, so a rerun with
// the same order of requests draws the same picks.
package peers

import (
	"math/rand/v2"
	"sync"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// Reasons of the peer policies. The token-load configuration's mirror the
// outcomes llm-d's prefix-cache-affinity filter counts.
const (
	ReasonCacheHit = "peer-cache-hit" // SGLang: the deepest match
	ReasonBalance  = "peer-balance"   // SGLang: the least-loaded worker
	ReasonBlend    = "peer-blend"     // GIE: the highest weighted score
	// ReasonSticky: the filter kept only the sticky endpoints.
	ReasonSticky = "peer-sticky"
	// ReasonNoMatch: no endpoint was sticky; all were kept.
	ReasonNoMatch = "peer-no-match"
	// ReasonLoadOverride: the load gate opened; all were kept.
	ReasonLoadOverride = "peer-load-override"
	// ReasonNotApplicable: one candidate or none; nothing to filter.
	ReasonNotApplicable = "peer-not-applicable"
)

// bytesPerToken is kvroute's estimate of a prompt's bytes per token
// (routing.Request.PromptTokens is PromptBytes/4); the peers convert index
// blocks to tokens with it.
const bytesPerToken = 4

// matchScratch pools the match slices of all peers.
var matchScratch = sync.Pool{New: func() any { s := make([]prefix.Match, 0, 16); return &s }}

// matchedBlocks returns, aligned with set.Mixed, how many leading blocks
// of hashes each endpoint holds in idx, into dst.
func matchedBlocks(idx *prefix.Index, hashes []uint64, set *discovery.Set, dst []int) []int {
	sp := matchScratch.Get().(*[]prefix.Match)
	ms := idx.Match(hashes, *sp)
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

// uncached is the prompt tokens of r an endpoint holding its first matched
// blocks still has to compute (what llm-d's in-flight-load producer counts:
// the prompt minus the matched blocks' tokens).
func uncached(r *routing.Request, matched, tokensPerBlock int) int {
	return max(0, r.PromptTokens-matched*tokensPerBlock)
}

// newRand returns a PCG source seeded from seed, as routing's policies are.
func newRand(seed uint64) *rand.Rand {
	return rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
}

// autoTune sizes an index's per-endpoint LRU from the engine's scraped KV
// capacity, as GIE's and llm-d's approximate prefix index do with
// autoTune (their default): an LRU of num_gpu_blocks entries per pod.
// Until a scrape reports a capacity the index's default applies. It keeps
// per endpoint the capacity it applied last; not safe for concurrent use
// (its owner's mutex guards it).
type autoTune map[uint64]int64

// resize returns the LRU capacity in blocks e's index entry should take
// now, or 0 if it is unchanged: e's freshly scraped KV capacity, if it
// changed since the last call.
func (a autoTune) resize(e *discovery.Endpoint, tokensPerBlock int) int {
	s := e.Engine()
	if s == nil || s.KVCapacityTokens <= 0 || a[e.ID] == s.KVCapacityTokens {
		return 0
	}
	a[e.ID] = s.KVCapacityTokens
	return max(1, int(s.KVCapacityTokens/int64(tokensPerBlock)))
}

// record records in idx that e now holds hashes, first sizing e's LRU to
// blocks if positive (autoTune.resize).
func record(idx *prefix.Index, e *discovery.Endpoint, blocks int, hashes []uint64) {
	if blocks > 0 {
		idx.SetCapacity(e.ID, blocks)
	}
	idx.Record(e.ID, hashes)
}
