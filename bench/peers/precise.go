package peers

import (
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"
	"github.com/zeebo/xxh3"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/kvevents"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// ReasonPrecise labels every decision of the llm-d precise configuration:
// the highest weighted score of its three scorers.
const ReasonPrecise = "peer-precise"

// Precise is llm-d's precise prefix-cache routing as llm-d-router v0.10.0
// ships it (llm-d/llm-d-router deploy/config/epp-precise-prefix-cache-config.yaml):
// a token-producer that tokenizes every request through a vLLM server, the
// decode-filter, then under pkg/epp/framework/plugins/scheduling/ the sum of
//   - the precise prefix-cache scorer, weight 2
//     (scorer/preciseprefixcache/precise_prefix_cache.go, utils.go): the
//     request's tokens are cut into blocks of block-size tokens (a trailing
//     partial block dropped) and chained into block keys
//     (llm-d/llm-d-kv-cache pkg/kvcache/kvblock/token_processor.go); each
//     pod's raw score is its longest run of consecutive keys from the first
//     found in the KV-block index, each block counting the highest weight of
//     the tiers the pod holds it on (pkg/kvcache/kvblock_scorer.go,
//     LongestPrefixScorer; pkg/kvcache/backend.go: gpu 1.0, cpu 0.8, any
//     other medium 1.0); the score is raw ÷ total blocks, clipped to 1
//     (absoluteScoredPods, since llm-d-router PR #1107 of May 2026; before
//     it, a min-max over the pods), and 0 for every pod when the prompt
//     has no whole block or could not be tokenized;
//   - the KV-cache utilization scorer, 1 − KV-cache usage, weight 1
//     (scorer/kvcacheutilization/kvcache_utilization.go);
//   - the queue scorer, (maxQ − q)/(maxQ − minQ) over the engines' waiting
//     queues, 1 when all are equal, weight 1 (scorer/queuedepth/queue.go);
//     both load scorers leave a pod whose metrics were never scraped
//     unscored (0), and out of the queue's min and max;
//
// and the max-score picker takes the highest total; v0.10.0 shuffles the
// candidates before a stable sort by score, so ties go to one of them at
// random (picker/maxscore/picker.go; llm-d-router's PRs #2515 and #2709,
// after v0.10.0, rotate ties round-robin instead).
//
// The index is fed by the engines' KV events, as llm-d-kv-cache's event
// pool applies them (pkg/kvevents/pool.go): a BlockStored chains its
// blocks' keys from its parent's key (the root, seeded by the adapter, for
// a chain's first block; an event whose parent is unknown is dropped); a
// store without tokens adds a tier to blocks already known; a BlockRemoved
// takes the pod off the block on that tier. Precise is that sink
// (kvevents.Sink) and keeps per endpoint the token keys it holds and
// their tiers. No speculative entries are added at a pick (the sample
// config leaves speculativeIndexing off): a prefix counts once its
// engine has announced it. Safe for concurrent use.
//
// Differences from the original:
//   - Tokens come from the engines' own /tokenize (vLLM's and the
//     simulator's, fed the request body as forwarded; a chat body is
//     rendered through its chat template as vLLM's render endpoints do),
//     asked of the first usable endpoint of the request's group with a
//     TokenizeTimeout of 1 s, where llm-d asks a render sidecar
//     (/v1/completions/render, /v1/chat/completions/render) with a 5 s
//     timeout. Only completions and chat bodies are tokenized, as llm-d's
//     token-producer does. Tokenizations are cached by the body's xxh3
//     hash (a few million tokens, the least recently used half dropped at
//     a time): llm-d v0.10.0 renders every request anew (its older
//     llm-d-kv-cache-manager kept an LRU of tokenizations,
//     pkg/tokenization/prefixstore/lru_store.go); only identical bodies
//     (retries) hit, so it spares the pods and changes no decision.
//   - Keys are kvroute's prefix.TokenKey chain from prefix.TokenRoot(adapter)
//     (the adapter when the endpoint lists the model as a LoRA adapter, ""
//     for the base model), where llm-d hashes CBOR [parent, tokens, extra]
//     with FNV-64a from a root seeded by the model name; blocks are the
//     events' block size (16 until an event states one), where llm-d's is
//     configured (64 in the sample, which must then match the engines',
//     or realigns engine blocks to it). Multimodal extra keys and hybrid
//     models' KV-cache groups are not told apart; data-parallel ranks of
//     one endpoint share its view.
//   - AllBlocksCleared, and a KVReset of any cause (engine restart,
//     unfillable gap, lost publisher), forget what the endpoint held; llm-d
//     only logs AllBlocksCleared and keeps its entries through gaps and
//     reconnects.
//   - The tiers are discovery's: TierCPU weighs 0.8 for every host-memory
//     medium, where llm-d gives 0.8 to "cpu" alone and 1.0 to the other
//     names (cpu_tier1, pinned, ...); TierStorage weighs 1.0, as llm-d's
//     unlisted media do.
//   - The index is per endpoint, bounded only by the engines' removals (a
//     view past maxPreciseBlocks ignores further stores); llm-d's
//     in-memory index is an LRU of 10^8 keys of up to 10 pods each.
//   - Metrics are the latest scrape this policy saw fresh (discovery
//     withdraws stale ones); the candidates are the usable endpoints of the
//     request's group (routable, serving the model, not saturated, not
//     tried), standing for the decode-filter's.
type Precise struct {
	// PrefixW, KVW and QueueW weigh the three scorers (2, 1, 1).
	PrefixW, KVW, QueueW float64
	// TokenizeTimeout bounds one /tokenize call on the request path.
	TokenizeTimeout time.Duration

	client *fasthttp.Client
	cache  tokenCache

	// blockSize is the tokens per block, from the events.
	blockSize atomic.Int64

	mu    sync.Mutex
	rnd   *rand.Rand
	views map[uint64]*preciseView           // endpoint id → what its engine announced
	seen  map[uint64]*discovery.EngineStats // the latest scrape per endpoint
}

// Tuning of Precise.
const (
	// preciseTokenizeTimeout bounds a tokenization on the request path: a
	// loopback call to a pod, well above its milliseconds; llm-d's
	// token-producer allows 5 s for a sidecar.
	preciseTokenizeTimeout = time.Second
	// maxPreciseBlocks bounds one endpoint's view (an engine announces at
	// most its num_gpu_blocks plus its offload tiers; 4M blocks of 16
	// tokens are 64M tokens, a hundred H100s' KV caches).
	maxPreciseBlocks = 4 << 20
	// preciseCacheTokens bounds the tokenization cache, in tokens (16 MB
	// of token ids).
	preciseCacheTokens = 4 << 20
)

// tierWeights are llm-d-kv-cache's backend weights by kvevents.Tier: gpu
// 1.0, cpu 0.8, and 1.0 for a medium it does not list.
var tierWeights = [3]float64{kvevents.TierGPU: 1.0, kvevents.TierCPU: 0.8, kvevents.TierStorage: 1.0}

// preciseView is one endpoint's announced blocks.
type preciseView struct {
	keys map[uint64]uint64 // engine block hash → token key
	held map[uint64]uint8  // token key → the tiers holding it (bit per kvevents.Tier)
}

// NewPrecise returns llm-d's precise configuration with weights prefix 2,
// KV utilization 1, queue 1; seed makes its tie-breaks reproducible.
func NewPrecise(seed uint64) *Precise {
	p := &Precise{
		PrefixW: 2, KVW: 1, QueueW: 1,
		TokenizeTimeout: preciseTokenizeTimeout,
		client: &fasthttp.Client{
			Name:                     "kvroute-bench-precise",
			NoDefaultUserAgentHeader: true,
			MaxIdleConnDuration:      30 * time.Second,
		},
		cache: newTokenCache(preciseCacheTokens),
		rnd:   newRand(seed),
		views: make(map[uint64]*preciseView),
		seen:  make(map[uint64]*discovery.EngineStats),
	}
	p.blockSize.Store(prefix.DefaultTokenBlock)
	return p
}

// KVBatch implements kvevents.Sink: it applies e's events to e's view.
func (p *Precise) KVBatch(e *discovery.Endpoint, b *kvevents.Batch) {
	p.mu.Lock()
	defer p.mu.Unlock()
	v := p.views[e.ID]
	if v == nil {
		v = &preciseView{keys: make(map[uint64]uint64), held: make(map[uint64]uint8)}
		p.views[e.ID] = v
	}
	for i := range b.Events {
		ev := &b.Events[i]
		switch ev.Kind {
		case kvevents.BlockStored:
			p.stored(v, ev)
		case kvevents.BlockRemoved:
			bit := uint8(1) << min(ev.Tier, kvevents.TierStorage)
			for _, h := range ev.BlockHashes {
				key, ok := v.keys[h]
				if !ok {
					continue
				}
				if t := v.held[key] &^ bit; t != 0 {
					v.held[key] = t
					continue
				}
				delete(v.held, key)
				delete(v.keys, h)
			}
		case kvevents.AllCleared:
			clear(v.keys)
			clear(v.held)
		}
	}
}

// stored applies one BlockStored event to v; p.mu is held.
func (p *Precise) stored(v *preciseView, ev *kvevents.Event) {
	bit := uint8(1) << min(ev.Tier, kvevents.TierStorage)
	if len(ev.TokenIDs) == 0 {
		// A copy to another tier: the blocks are known by their hashes.
		for _, h := range ev.BlockHashes {
			if key, ok := v.keys[h]; ok {
				v.held[key] |= bit
			}
		}
		return
	}
	bs := ev.BlockSize
	if bs <= 0 {
		bs = int(p.blockSize.Load())
	}
	if len(ev.TokenIDs)/bs != len(ev.BlockHashes) {
		return // tokens and blocks do not line up: not indexable
	}
	p.blockSize.Store(int64(bs))
	key := prefix.TokenRoot(ev.LoRA)
	if ev.HasParent {
		k, ok := v.keys[ev.Parent]
		if !ok {
			return // llm-d drops an event whose parent it does not know
		}
		key = k
	}
	for i, h := range ev.BlockHashes {
		key = prefix.TokenKey(key, ev.TokenIDs[i*bs:(i+1)*bs])
		if len(v.held) >= maxPreciseBlocks {
			if _, ok := v.held[key]; !ok {
				return
			}
		}
		v.keys[h] = key
		v.held[key] |= bit
	}
}

// KVReset implements kvevents.Sink: whatever the cause
// (kvevents.ResetRestart, ResetGap, ResetLost), e's view is
// forgotten until its next events.
func (p *Precise) KVReset(e *discovery.Endpoint, cause string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.views, e.ID)
}

// Pick implements routing.Picker.
func (p *Precise) Pick(r *routing.Request, set *discovery.Set) routing.Decision {
	eps := set.Serving
	if r.Prefill {
		eps = set.Prefill
	}
	var first *discovery.Endpoint
	for _, e := range eps {
		if routing.Usable(r, e) {
			first = e
			break
		}
	}
	if first == nil {
		return routing.Decision{Reason: ReasonPrecise}
	}
	tokens := p.tokenize(r, first)
	lora := ""
	if m := first.Models(); m != nil && m.Adapter(r.Model) {
		lora = r.Model
	}

	bs := int(p.blockSize.Load())
	var kbuf [256]uint64
	keys := kbuf[:0]
	key := prefix.TokenRoot(lora)
	for i := 0; i+bs <= len(tokens); i += bs {
		key = prefix.TokenKey(key, tokens[i:i+bs])
		keys = append(keys, key)
	}

	p.mu.Lock()
	defer p.mu.Unlock()
	minQ, maxQ, scraped := int64(0), int64(0), false
	for _, e := range eps {
		if !routing.Usable(r, e) {
			continue
		}
		if s := p.stats(e); s != nil {
			if !scraped || s.Waiting < minQ {
				minQ = s.Waiting
			}
			if !scraped || s.Waiting > maxQ {
				maxQ = s.Waiting
			}
			scraped = true
		}
	}
	var best *discovery.Endpoint
	bestScore, bestBlocks, ties := 0.0, 0, 0
	for _, e := range eps {
		if !routing.Usable(r, e) {
			continue
		}
		blocks, weighted := p.views[e.ID].match(keys)
		var s float64
		if len(keys) > 0 {
			s += p.PrefixW * min(1, weighted/float64(len(keys)))
		}
		if st := p.seen[e.ID]; st != nil {
			s += p.KVW * (1 - st.KVUsage)
			if maxQ > minQ {
				s += p.QueueW * float64(maxQ-st.Waiting) / float64(maxQ-minQ)
			} else {
				s += p.QueueW
			}
		}
		switch {
		case best == nil || s > bestScore:
			best, bestScore, bestBlocks, ties = e, s, blocks, 1
		case s == bestScore: // shuffled, then stably sorted: uniform among the ties
			ties++
			if p.rnd.IntN(ties) == 0 {
				best, bestBlocks = e, blocks
			}
		}
	}
	prompt := r.PromptTokens
	if tokens != nil {
		prompt = len(tokens)
	}
	return routing.Decision{Endpoint: best, Reason: ReasonPrecise, MatchedBlocks: bestBlocks,
		Prefill: max(0, prompt-bestBlocks*bs), PromptTokens: prompt}
}

// stats returns the latest scrape of e this policy saw (nil: none yet),
// recording a fresh one; p.mu is held.
func (p *Precise) stats(e *discovery.Endpoint) *discovery.EngineStats {
	if s := e.Engine(); s != nil {
		p.seen[e.ID] = s
		return s
	}
	return p.seen[e.ID]
}

// match returns how many of keys v holds consecutively from the first, and
// their weight (each block its best tier's); 0, 0 for a nil v.
func (v *preciseView) match(keys []uint64) (blocks int, weighted float64) {
	if v == nil {
		return 0, 0
	}
	for _, k := range keys {
		t := v.held[k]
		if t == 0 {
			break
		}
		w := 0.0
		for tier, tw := range tierWeights {
			if t&(1<<tier) != 0 {
				w = max(w, tw)
			}
		}
		blocks++
		weighted += w
	}
	return blocks, weighted
}

// tokenize returns the engine's tokens of r's body, asked of e (or the
// cache); nil when r is not a completions or chat request, or the call
// failed (the prefix then scores 0, as in llm-d).
func (p *Precise) tokenize(r *routing.Request, e *discovery.Endpoint) []uint32 {
	if len(r.Body) == 0 || (r.Kind != routing.KindCompletions && r.Kind != routing.KindChat) {
		return nil
	}
	h := xxh3.Hash(r.Body)
	if t, ok := p.cache.get(h); ok {
		return t
	}
	t, err := p.fetchTokens(e, r.Body)
	if err != nil {
		return nil
	}
	p.cache.put(h, t)
	return t
}

// fetchTokens posts body to e's /tokenize and returns the tokens.
func (p *Precise) fetchTokens(e *discovery.Endpoint, body []byte) ([]uint32, error) {
	return kvevents.Tokenize(p.client, e, body, p.TokenizeTimeout)
}

// tokenCache maps body hashes to their tokens, bounded in tokens (a
// prefix.TwoGen weighing each entry by its tokens). Safe for concurrent
// use; cached slices are never modified.
type tokenCache struct {
	mu sync.Mutex
	g  prefix.TwoGen[[]uint32]
}

func newTokenCache(tokens int) tokenCache {
	return tokenCache{g: prefix.NewTwoGen(tokens, func(t []uint32) int { return len(t) })}
}

func (c *tokenCache) get(h uint64) ([]uint32, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.g.Get(h)
}

func (c *tokenCache) put(h uint64, t []uint32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.g.Put(h, t)
}

// The precise scorer is a policy fed by the engines' KV events: the
// benchmark finds it a KV-event subscription by this interface.
var (
	_ routing.Picker = (*Precise)(nil)
	_ kvevents.Sink  = (*Precise)(nil)
)
