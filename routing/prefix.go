package routing

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/prefix"
)

// Reasons of the prefix policy.
const (
	// ReasonWarm: the endpoint holding the request's prefix was chosen.
	ReasonWarm = "warm"
	// ReasonSpill: the warm endpoint was saturated; the request went to a
	// colder one where it gets its first token sooner.
	ReasonSpill = "spill"
	// ReasonCold: no endpoint holds enough of the prefix.
	ReasonCold = "cold"
)

// Prefix is the prefix-aware, sticky-until-saturated policy. It estimates,
// for every usable endpoint, how long this request would wait for its first
// token there:
//
//	wait = in-flight prefill tokens / pending rate + slot wait + foreign waiting × queue cost
//	     + this request's uncached tokens / prefill rate
//	     + its tokens on a slower tier / load rate
//	     + (in-flight requests + foreign) × decode cost
//	     + engine KV usage × KV cost
//	     + [the request's LoRA adapter finds the engine's adapter slots held by others] × decode time
//	slot wait = max(0, in-flight requests + foreign − batch limit + 1) × decode time / batch limit
//	foreign = max(0, engine running + waiting − this router's in-flight requests at the scrape)
//
// where the engine terms (foreign: other clients' requests, of which
// foreign waiting ≤ engine waiting are queued) count only when freshly
// scraped (else the router's own counters, exact and current, stand
// alone), and the uncached tokens are the prompt
// minus the prefix the index believes the endpoint holds, of which those
// its engine's KV events show on a CPU or storage tier only are loaded,
// not computed. The constants are the endpoint's own (discovery.Costs):
// its prefill and load rates (of its own tokens, and of the pending tokens
// ahead) fitted to its TTFTs, its decode cost the engine's inter-token
// latency, its
// batch limit the most requests it ran while others waited, the queue cost
// its mean prefill time or batch turnover; PrefixParams holds the priors
// used until they are measured, and the values it pins.
//
// Every prefix key (the block at depth MinMatchBlocks) has a home (homes:
// balanced rendezvous hashing over the recurring keys, the same in every
// router replica), kept apart from the index, so that the index forgetting
// blocks never moves a prefix. The target is the warm endpoint (deepest
// useful match; the home while its wait is within the spill rule, among
// equal matches and, for a recurring key when other routers share the
// engines (Foreign at least sharedFleet), where the index shows the home
// cold, unless this router placed the key's first request elsewhere; then
// the lowest wait), or for a prefix warm nowhere its home (for a key that
// does not recur, only while the home would start it about as soon as the
// endpoint with the shortest wait). The target keeps the request unless its
// wait in the router's own view (its own in-flight requests and prefill)
// exceeds SpillRatio × the best idle endpoint's wait + SpillMarginSec + the
// stall the spill causes there (the recompute's prefill time × the requests
// running there, which it delays; an established home is tested without the
// recompute, as if warm); then the request spills to that idle endpoint,
// whose cache becomes warm too. Idle means nothing queued there and a free
// place in its batch in the router's view and, when scraped, the engine's,
// with KV usage below SpillMaxKVUsage. Ties go to the rendezvous-hash
// winner. The pick is recorded in the index at once, so a burst of
// same-prefix requests follows the first.
//
// Conversations under a system prompt that many share all have that
// prompt's key, so their homes cannot place them, and a router replica
// knows only the turns it routed. When the engines show that other
// routers share them (Foreign at least sharedFleet) and most of a key's
// recent requests extend an earlier one (homes.family: the key is
// chained), a request is keyed by its first block past the family's
// shared part instead — its conversation's own key, the same in every
// replica — homed on that key's plain rendezvous winner, and that home is
// presumed to hold the conversation (and the shared part) until this
// router places it elsewhere. Safe for concurrent use.
type Prefix struct {
	index *prefix.Index
	homes *homes
	warm  *warmth
	// seqs learns, per endpoint, how many whole prompts (sequences) its
	// engine keeps, keyed by their end marks (prefix.Mark): a
	// conversation's turn continues its previous turn's sequence.
	seqs       *warmth
	blockBytes int
	params     atomic.Pointer[PrefixParams]
	scratch    sync.Pool // *[]prefix.Match
	// bpt is the rendering's bytes per engine token (math.Float64bits),
	// learned from the engines' prompt_tokens; 4 until then.
	bpt atomic.Uint64
	// foreign is the share of the engines' requests that are not this
	// router's (math.Float64bits; learned over decisions with fresh
	// scrapes, see learnForeign): other router replicas, or other clients.
	// foreignSamples counts those decisions.
	foreign        atomic.Uint64
	foreignSamples atomic.Uint64

	capMu     sync.Mutex
	capTokens map[uint64]int // scraped KV capacity per endpoint, in tokens
	capBPT    float64        // bpt the index capacities were sized with

	// onPlaced, when set, is told every pick's endpoint and chain after
	// the index recorded it (the replicas' gossip, OnPlaced).
	onPlaced func(id uint64, hashes []uint64)
	// onSequenced, when set, is told every pick's endpoint and the marks
	// of the earlier prompt it continued there (0: none) and of its own
	// (the replicas' gossip, OnSequenced).
	onSequenced func(id, from, to uint64)
	// onOutcome, when set, is told what each answer said of the sequence
	// it continued (the replicas' gossip, OnOutcome).
	onOutcome func(id uint64, distance int, held bool)
	// meshed, when set, reports whether other router replicas share the
	// engines (the replicas' gossip, Meshed), and others how many are
	// live.
	meshed func() bool
	others func() int
	// rank, while meshed, is this replica's place among the live ones
	// (0..others): its turn in the rendezvous order (turnOf).
	rank func() int
	// echo is how many requests of the others one pick of this replica's
	// stands for (Pick; peers' Mesh.Echo, learned from their loads).
	echo func() float64
	// colds are the peers' recent cold placements' echoes (cold.go).
	colds peerColds
}

// Bytes per token: the rule of thumb for English (OpenAI: a token is about
// four characters) until the
// engines' reports say otherwise; learning is bounded to a plausible range
// and moves by a twentieth of each report.
const (
	initialBytesPerToken = 4.0
	minBytesPerToken     = 1.0
	maxBytesPerToken     = 16.0
	bptLearningRate      = 0.05
)

// NewPrefix returns the policy over index, whose blocks are blockBytes of
// the canonical rendering (≈ blockBytes/4 tokens).
func NewPrefix(index *prefix.Index, blockBytes int, p PrefixParams) *Prefix {
	w := newWarmth()
	pp := &Prefix{index: index, homes: newHomes(index.TTL(), time.Now), warm: w, seqs: newSequences(), blockBytes: blockBytes,
		capTokens: make(map[uint64]int), capBPT: initialBytesPerToken}
	pp.homes.kept, pp.homes.keptVersion = w.kept, w.version.Load
	pp.params.Store(&p)
	pp.bpt.Store(math.Float64bits(initialBytesPerToken))
	pp.scratch.New = func() any { s := make([]prefix.Match, 0, 16); return &s }
	return pp
}

// Params returns the current parameters.
func (p *Prefix) Params() PrefixParams { return *p.params.Load() }

// SetParams replaces the parameters for the following decisions.
func (p *Prefix) SetParams(pp PrefixParams) error {
	if err := pp.Validate(); err != nil {
		return err
	}
	p.params.Store(&pp)
	return nil
}

// Homes returns how many prefix keys recur (and so are homed by the
// balanced assignment).
func (p *Prefix) Homes() int { return p.homes.len() }

// Index returns the policy's index.
func (p *Prefix) Index() *prefix.Index { return p.index }

// BytesPerToken returns the learned bytes of rendering per engine token.
func (p *Prefix) BytesPerToken() float64 { return math.Float64frombits(p.bpt.Load()) }

// SetCapacityTokens sizes endpoint id's index LRU from its engine's KV
// capacity in tokens (scraped), converted with the learned bytes per token;
// the conversion is redone when that estimate moves.
func (p *Prefix) SetCapacityTokens(id uint64, tokens int) {
	p.capMu.Lock()
	defer p.capMu.Unlock()
	p.capTokens[id] = tokens
	p.index.SetCapacity(id, p.blocksFor(tokens, p.capBPT))
}

// Forget drops endpoint id from the index and its capacity record (it left,
// or its engine restarted).
func (p *Prefix) Forget(id uint64) {
	p.capMu.Lock()
	delete(p.capTokens, id)
	p.capMu.Unlock()
	p.index.Forget(id)
	p.homes.forget(id)
	p.warm.forget(id)
	p.seqs.forget(id)
}

func (p *Prefix) blocksFor(tokens int, bpt float64) int {
	return max(1, int(float64(tokens)*bpt/float64(p.blockBytes)))
}

// learnBytesPerToken folds one engine report (a rendering of promptBytes
// that the engine counted as promptTokens) into the estimate, and resizes
// the index once the estimate moved by more than 5%.
func (p *Prefix) learnBytesPerToken(promptBytes, promptTokens int) {
	if promptBytes <= 0 || promptTokens <= 0 {
		return
	}
	sample := min(max(float64(promptBytes)/float64(promptTokens), minBytesPerToken), maxBytesPerToken)
	for {
		old := p.bpt.Load()
		v := math.Float64frombits(old)
		v += bptLearningRate * (sample - v)
		if p.bpt.CompareAndSwap(old, math.Float64bits(v)) {
			break
		}
	}
	bpt := p.BytesPerToken()
	p.capMu.Lock()
	defer p.capMu.Unlock()
	if math.Abs(bpt-p.capBPT) <= 0.05*p.capBPT {
		return
	}
	p.capBPT = bpt
	for id, tokens := range p.capTokens {
		p.index.SetCapacity(id, p.blocksFor(tokens, bpt))
	}
}

// sharedFleet is the share of the engines' requests from elsewhere above
// which this router is taken to be one of several routing the same fleet:
// then it keys conversations by their own first block, which every
// replica computes alike, instead of placing them by its own view of load,
// which the others do not see. A router alone (the others' share near 0)
// places them by load, which balances them better.
const sharedFleet = 0.25

// foreignRate is the weight of one decision's sample in Foreign once a
// hundred were taken.
const foreignRate = 0.01

// Foreign returns the learned share of the engines' requests that are not
// this router's.
func (p *Prefix) Foreign() float64 { return math.Float64frombits(p.foreign.Load()) }

// learnForeign folds one decision's view of the engines into Foreign: the
// mean of the samples so far, then, from the hundredth on, a moving average
// over about a hundred decisions: a moving average started at 0 kept
// replicas from seeing one another for their first decisions, and the
// conversations begun meanwhile were placed apart for good (BENCHMARKS.md,
// "Measurements behind the code").
func (p *Prefix) learnForeign(sample float64) {
	rate := max(foreignRate, 1/float64(p.foreignSamples.Add(1)))
	for {
		old := p.foreign.Load()
		v := math.Float64frombits(old)
		v += rate * (sample - v)
		if p.foreign.CompareAndSwap(old, math.Float64bits(v)) {
			return
		}
	}
}

// Pick implements the policy and records the pick's whole chain in the
// index at once, so that the requests that follow see where the prompt will
// be cached: a burst of the same prefix follows the first, weighing the
// prefill still running there. (Recording only a new prompt's first blocks
// at the pick made the requests in between see it held one block deep,
// spill to cold pods instead of following it, and take a conversation's
// first turn for the shared part of the next: BENCHMARKS.md, "Measurements
// behind the code".)
func (p *Prefix) Pick(r *Request, set *discovery.Set) Decision {
	d := p.decide(r, set, nil)
	d.distance, d.seqDistance = -1, -1
	if p.hold(r, &d) {
		return d
	}
	if d.Endpoint != nil {
		p.index.Record(d.Endpoint.ID, r.Hashes)
		if p.onPlaced != nil {
			p.onPlaced(d.Endpoint.ID, r.Hashes)
		}
		if d.PrefixKey != 0 {
			d.distance = p.warm.see(d.Endpoint.ID, d.PrefixKey)
		}
		if n := len(r.Marks); n > 0 {
			d.seqDistance = p.seqs.extend(d.Endpoint.ID, d.seqFrom, r.Marks[n-1].Hash, time.Now())
			if p.onSequenced != nil {
				p.onSequenced(d.Endpoint.ID, d.seqFrom, r.Marks[n-1].Hash)
			}
		}
		if n := p.echoes(); n > 0 && d.Prefill > 0 {
			d.Endpoint.AddUnheardPrefill(int64(n*float64(d.Prefill)), time.Now().Add(unheardFor))
		}
	}
	if strayed := (d.Reason == ReasonCold || d.branch) && !d.Home; d.PrefixKey != 0 && d.Endpoint != nil && (d.unplaced || strayed) {
		p.homes.placed(d.PrefixKey, d.Endpoint.ID, strayed)
	}
	return d
}

// hold sets d.Hold and d.HoldFor, and reports true, when d's endpoint
// caches prompts per slot (discovery/prompts.go) and every copy it holds
// of the request's prompt key is busy with another request of this
// router's: sent now, the request would compute the prompt afresh in a
// free slot. It waits instead for one of them to end, when a request's
// turn there (its decode time, learned) is shorter than the prompt's cold
// prefill, and at most that prefill plus a turn: by then a running request
// that was itself computing the prompt has ended too. Only while the
// endpoint has a free slot (its slots as the engine says, else its learned
// batch limit; unknown: never). A request waits once (Request.Held), and
// never after the queue gave it a place (StartNow), nor for a prefill leg
// or a retry.
func (p *Prefix) hold(r *Request, d *Decision) bool {
	e := d.Endpoint
	if e == nil || d.PrefixKey == 0 || d.MatchedBlocks == 0 || r.Held || r.StartNow || r.Prefill || len(r.Tried) > 0 || !e.Dialect().Slotted() {
		return false
	}
	prm := p.params.Load()
	rt := prm.ratesOf(e.Costs(), prm.pins())
	if rt.prefill <= 0 {
		return false
	}
	cold := float64(d.PromptTokens) / rt.prefill
	// Only while a slot is free: with every slot busy the engine queues
	// the request and gives it the first slot that frees, the prompt's
	// when the running one of it ends first; held, the request would
	// leave that turn to whatever came meanwhile.
	slots := slotsOf(e, rt)
	if rt.turnover >= cold || slots <= 0 || e.InFlight()+e.PeerInFlight() >= slots {
		return false
	}
	running, copies, ended := e.PromptRuns(d.PrefixKey) // the lock last, once the rest allows a hold
	if running == 0 || running < copies {
		return false
	}
	d.Hold, d.HoldFor = ended, time.Duration((cold+rt.turnover)*float64(time.Second))
	return true
}

// slotsOf is how many requests e runs at once: its slots as the engine
// says (llama.cpp's /props), else its learned batch limit; 0: unknown.
func slotsOf(e *discovery.Endpoint, rt rates) int64 {
	if in := e.Info(); in != nil && in.Slots > 0 {
		return int64(in.Slots)
	}
	return rt.limit
}

// echoes is how many requests of the other replicas one pick of this
// router's stands for (Meshed's echo, else every live other).
func (p *Prefix) echoes() float64 {
	switch {
	case p.echo != nil:
		return p.echo()
	case p.others != nil:
		return float64(p.others())
	}
	return 0
}

// unheardFor is how long a pick stands for the gossiping replicas' picks
// of the same moment at its endpoint (Endpoint.AddUnheardPrefill): their
// placements go out every 10 ms (peers' flushEvery) and arrive within
// about as long. A client spreading requests over n replicas sends each
// the same mix, and replicas deciding on the same view decide alike: a
// burst's first requests of one prompt, each replica seeing its own few
// and none of the others', went to the prompt's home three or four from
// each replica, eleven conversations of 24 on one of eight kvsim pods,
// where one router sends three and spills the rest.
const unheardFor = 20 * time.Millisecond

// CachedTokens estimates how many of r's prompt tokens the fleet holds
// already: the deepest match the index shows anywhere, in tokens, at most
// r.PromptTokens. The queue charges a request the rest (its prefill).
func (p *Prefix) CachedTokens(r *Request) int {
	if len(r.Hashes) == 0 {
		return 0
	}
	sp := p.match(r.Hashes)
	deepest := deepestMatch(*sp)
	p.scratch.Put(sp)
	return min(r.PromptTokens, int(float64(deepest*p.blockBytes)/p.BytesPerToken()))
}

// WarmRoom reports, for a request waiting in the router's queue, whether
// its prompt is cached in its group (placed: the index shows its deepest
// match, of MinMatchBlocks blocks at least, on an endpoint of the group)
// and whether one endpoint holding that match may take it now (Usable:
// with r.StartNow, room in its batch or short queue). The queue gives a
// freed place to a waiter whose cache has room before one of the same
// flow whose cache has none, which would recompute its prompt elsewhere
// (and copy it there). It records nothing.
func (p *Prefix) WarmRoom(r *Request, set *discovery.Set) (placed, room bool) {
	p.holders(r, set, func(e *discovery.Endpoint) bool {
		placed = true
		room = Usable(r, e)
		return !room
	})
	return placed, room
}

// Holding returns the endpoints of set that hold the deepest match of r's
// prompt in the index, when it is a key's worth (MinMatchBlocks) or more.
func (p *Prefix) Holding(r *Request, set *discovery.Set) []*discovery.Endpoint {
	var out []*discovery.Endpoint
	p.holders(r, set, func(e *discovery.Endpoint) bool {
		out = append(out, e)
		return true
	})
	return out
}

// holders calls yield with each endpoint of r's group that holds the
// deepest match of r's prompt, a key's worth or more, until it returns
// false.
func (p *Prefix) holders(r *Request, set *discovery.Set, yield func(*discovery.Endpoint) bool) {
	if len(r.Hashes) == 0 {
		return
	}
	sp := p.match(r.Hashes)
	defer p.scratch.Put(sp)
	matches := *sp
	deepest := deepestMatch(matches)
	if deepest < p.params.Load().MinMatchBlocks {
		return
	}
	for _, e := range r.group(set) {
		if b, _ := matchedBlocks(matches, e.ID); b == deepest && !yield(e) {
			return
		}
	}
}

// OnPlaced sets f to be told each pick's endpoint and chain after the
// index recorded it (hashes is only valid during the call): the replicas'
// gossip sends them to the other replicas, whose indexes record them too.
// Set it before the policy serves.
func (p *Prefix) OnPlaced(f func(id uint64, hashes []uint64)) { p.onPlaced = f }

// OnSequenced sets f to be told each pick's sequence (Prefix.seqs): its
// endpoint, the mark of the earlier prompt it continued there (0: none)
// and its own. The replicas' gossip sends them to the other replicas
// (PeerSequenced). Set it before the policy serves.
func (p *Prefix) OnSequenced(f func(id, from, to uint64)) { p.onSequenced = f }

// OnOutcome sets f to be told what each answer said of the sequence its
// request continued: its endpoint, its distance there, and whether the
// engine still held it (Prefix.seqs). The replicas' gossip sends them to
// the other replicas (PeerOutcome), so that every replica learns how many
// sequences an engine keeps from all the answers. Set it before the policy
// serves.
func (p *Prefix) OnOutcome(f func(id uint64, distance int, held bool)) { p.onOutcome = f }

// PeerOutcome takes what a router replica's answer said of a sequence on
// endpoint id (OnOutcome's), as if this router's had said it.
func (p *Prefix) PeerOutcome(id uint64, distance int, held bool) {
	p.seqs.outcome(id, distance, held) // it ignores a distance it does not track
}

// PeerSequenced takes a router replica's sequence on endpoint id
// (OnSequenced's), as if this router had placed it: the engine's slots
// hold every replica's conversations.
func (p *Prefix) PeerSequenced(id, from, to uint64) { p.seqs.extend(id, from, to, time.Now()) }

// maxPeerPrefill bounds how long a peer's placement counts as prefill
// still running (PeerPlaced): a prediction further out is noise.
const maxPeerPrefill = 10 * time.Second

// PeerPlaced merges a router replica's placement on e (its gossip: the
// request's block hashes) into the index, and counts the blocks e did not
// hold as prefill running there until the endpoint's rates say they are
// computed, after the prefill found pending there: as this router counts
// its own requests' from the pick to their first byte, so that a pod the
// peers just gave new prompts does not look idle to this one.
//
// The request counts as this router's own dispatch would (peerKey): toward
// its prefix key's recurrence (homes.peerSaw), so that the replicas'
// recurring keys, and with them their homes, agree; and in e's stack of
// recent keys (warmth.see), so that a key's distance there counts every
// replica's keys. Counting their own requests alone, eight replicas on
// llm-d shared-prefix each saw its recurring keys grow through the whole
// run, each new one moving one to five of 64 homes, and learned kept
// counts from distances that counted about an eighth of the keys sent
// there, each change of which moved up to 30 homes; counting the peers', no
// home moved after the first 24 s.
func (p *Prefix) PeerPlaced(e *discovery.Endpoint, hashes []uint64) {
	prm := p.params.Load()
	sp := p.match(hashes)
	held, _ := matchedBlocks(*sp, e.ID)
	var key uint64
	keyed := len(hashes) >= prm.MinMatchBlocks
	if keyed {
		key = p.peerKey(e, hashes, *sp, prm)
	}
	p.scratch.Put(sp)
	p.index.Record(e.ID, hashes)
	r := prm.ratesOf(e.Costs(), prm.pins())
	if held >= len(hashes) || r.prefill <= 0 {
		return
	}
	tokens := float64(len(hashes)-held) * float64(p.blockBytes) / p.BytesPerToken()
	ahead := 0.0
	if r.pending > 0 {
		ahead = float64(e.PendingPrefill()+e.PeerPrefill()) / r.pending
	}
	d := min(ahead+tokens/r.prefill, maxPeerPrefill.Seconds())
	now := time.Now()
	e.AddPeerPrefill(int64(tokens), now.Add(time.Duration(d*float64(time.Second))))
	if n := p.echoes() - 1; keyed && held < prm.MinMatchBlocks && n > 0 {
		p.colds.add(key, e.ID, int64(n*tokens), now.Add(unheardFor)) // placed cold
	}
}

// peerKey counts a peer's placement of hashes on e under the prefix key
// this router would give the request (a chained family's branch included;
// matches is the index's view before the placement is recorded), and
// returns that key.
func (p *Prefix) peerKey(e *discovery.Endpoint, hashes []uint64, matches []prefix.Match, prm *PrefixParams) uint64 {
	key, _, branch := p.keyOf(hashes, e.Role == discovery.RolePrefill, prm, deepestMatch(matches), true, false)
	p.homes.peerSaw(key, branch > 0, e.ID)
	p.warm.see(e.ID, key)
	return key
}

// ExportHomes yields up to max prompt keys, most recently used first, with
// the endpoint each is homed on, whether it recurs and its age in seconds:
// a router replica's state for one that joins (ImportHomes).
func (p *Prefix) ExportHomes(max int, yield func(key, id uint64, recurring bool, age uint32)) {
	p.homes.export(max, yield)
}

// ImportHomes takes a peer's key homed on endpoint id (ExportHomes), unless
// this router knows the key; it reports whether it did.
func (p *Prefix) ImportHomes(key, id uint64, recurring bool, age uint32) bool {
	return p.homes.adopt(key, id, recurring, age)
}

// match returns the index's matches of hashes in a slice of the scratch
// pool, which the caller puts back (p.scratch.Put) once done with them.
func (p *Prefix) match(hashes []uint64) *[]prefix.Match {
	sp := p.scratch.Get().(*[]prefix.Match)
	*sp = p.index.Match(hashes, (*sp)[:0])
	return sp
}

// deepestMatch is the deepest of matches, in blocks (0: none).
func deepestMatch(matches []prefix.Match) int {
	deepest := 0
	for _, m := range matches {
		deepest = max(deepest, m.Blocks)
	}
	return deepest
}

// Meshed sets shared to report whether this router has live replicas
// (their gossip), and others to count them: then it routes as one of
// several (conversations keyed by their own blocks), whatever share of the
// engines' requests it sees as others' (an engine without /metrics shows
// none), but presumes no home holds a key: the replicas' placements are in
// its index. Knowing where each of them placed a key's first request
// (PeerPlaced), it homes keys as a router alone does, where that request
// went. Each of its picks counts, at the endpoint, the prefill the others
// most likely sent there meanwhile and have yet to tell (Pick: its own
// times echo, or times others when echo is nil), and rank, this replica's
// place among them, gives it its own turn for a new key's home and its
// spill targets (turnOf), where replicas would decide alike. Set it before
// the policy serves.
func (p *Prefix) Meshed(shared func() bool, others, rank func() int, echo func() float64) {
	p.meshed, p.others, p.rank, p.echo = shared, others, rank, echo
}

// Explain returns the decision Pick would make and its terms, without
// recording anything.
func (p *Prefix) Explain(r *Request, set *discovery.Set) (Decision, []Term) {
	var terms []Term
	d := p.decide(r, set, &terms)
	return d, terms
}

// Learn takes the engine's report for a request decided as d, whose
// rendering was promptBytes long: its prompt tokens (0 if unreported) and
// the prompt tokens it served from cache. It returns the cached tokens the
// policy had estimated. The prompt tokens calibrate bytes per token. When
// the engine held at least a block less than estimated and nothing else was
// prefilling there at pick time, the index over-claimed: the engine evicted
// earlier than modelled, and the endpoint's modelled capacity shrinks
// (prefix.Index.Correct). An accurate report lets it grow back. An engine
// that served the request's whole prefix key from cache had seen the prefix
// before, from this router or another: the key recurs, even if this router
// sees it for the first time.
func (p *Prefix) Learn(d Decision, promptBytes, enginePrompt, engineCached int) (estimated int) {
	p.learnBytesPerToken(promptBytes, enginePrompt)
	tokensPerBlock := int(float64(p.blockBytes) / p.BytesPerToken())
	keyWarm := engineCached >= p.params.Load().MinMatchBlocks*tokensPerBlock
	if d.PrefixKey != 0 && !d.branch && keyWarm {
		p.homes.recur(d.PrefixKey)
	}
	if d.Endpoint != nil && d.PrefixKey != 0 && (keyWarm || !d.busy) {
		// On an engine that caches prompts per slot, a miss counts only
		// where nothing else of this router's ran: it computes a prompt
		// afresh in a free slot while the slot that keeps it is busy
		// (Ollama with OLLAMA_NUM_PARALLEL), which says nothing of what it
		// keeps. (On paged caches a miss under load is an eviction; for
		// router replicas, one by another replica's prompts, and not
		// counting them cost 3 replicas 3 points of hit rate on bench/sim.)
		p.warm.outcome(d.Endpoint.ID, d.distance, keyWarm)
	}
	claimed := min(d.MatchedBlocks*tokensPerBlock, max(enginePrompt, d.PromptTokens))
	over := engineCached+tokensPerBlock <= claimed
	if d.Endpoint != nil && (!over || !d.Contended) {
		p.index.Correct(d.Endpoint.ID, over)
	}
	p.learnSequence(d, promptBytes, max(enginePrompt, 0), engineCached)
	return max(claimed, d.PromptTokens-d.Prefill)
}

// LearnTTFT is Learn for an engine that does not report its cached tokens
// (a stock Ollama server): how many of the prompt's tokens it served from
// cache is read from the request's time to first token, ttft. predict
// gives the TTFT the endpoint's learned costs predict, with the load the
// request found, for a number of tokens to compute; the tokens computed
// are the TTFT beyond predict(0) at the rate predict implies, and the rest
// of the prompt was cached. A warm prefix is an order of magnitude faster
// than a cold prefill, so the key's blocks (a few hundred tokens) show
// well above the noise. It learns nothing when the TTFT cannot tell: no
// prefix key, no costs measured yet. It reports whether the TTFT
// contradicts the decision's estimate (the tokens computed differ from it
// by more than half the prompt): the policy then took a kept prompt for
// evicted or the reverse, and the answer, read with that estimate, is no
// measure of the endpoint's costs.
func (p *Prefix) LearnTTFT(d Decision, promptBytes int, ttft time.Duration, predict func(own int) time.Duration) (contradicts bool) {
	if d.Endpoint == nil || d.PrefixKey == 0 || ttft <= 0 || d.PromptTokens <= 0 {
		return false
	}
	base, cold := predict(0), predict(d.PromptTokens)
	if base <= 0 || cold <= base {
		return false
	}
	computed := min(max(int(float64(d.PromptTokens)*float64(ttft-base)/float64(cold-base)), 0), d.PromptTokens)
	p.Learn(d, promptBytes, 0, d.PromptTokens-computed)
	return 2*abs(computed-d.Prefill) > d.PromptTokens
}

func abs(x int) int { return max(x, -x) }

// Term is one endpoint's side of a decision, for /debug/route.
type Term struct {
	Endpoint       string `json:"endpoint"`
	MatchedBlocks  int    `json:"matched_blocks"`
	Warm           bool   `json:"warm"`
	Home           bool   `json:"home"`
	Idle           bool   `json:"idle"`
	UncachedTokens int    `json:"uncached_tokens"`
	// LoadedTokens are the matched tokens held there only on a slower
	// tier (engine truth's CPU or storage copies): loaded, not computed.
	LoadedTokens     int   `json:"loaded_tokens,omitempty"`
	InFlightPrefill  int64 `json:"in_flight_prefill_tokens"`
	InFlightRequests int64 `json:"in_flight_requests"`
	// PeerInFlight is the gossiping router replicas' requests in flight.
	PeerInFlight  int64    `json:"peer_in_flight_requests,omitempty"`
	EngineWaiting *int64   `json:"engine_waiting,omitempty"`
	EngineRunning *int64   `json:"engine_running,omitempty"`
	EngineKVUsage *float64 `json:"engine_kv_usage,omitempty"`
	// The wait model's constants for this endpoint (learned, or the
	// priors) and, when measured, what was learned with its sample counts.
	PrefillTokensPerSec float64          `json:"prefill_tokens_per_sec"`
	PendingTokensPerSec float64          `json:"pending_tokens_per_sec"`
	LoadTokensPerSec    float64          `json:"load_tokens_per_sec"`
	DecodeCostSec       float64          `json:"decode_cost_sec"`
	QueueCostSec        float64          `json:"queue_cost_sec"`
	SlotCostSec         float64          `json:"slot_cost_sec"`
	BatchLimit          int64            `json:"batch_limit"`
	Learned             *discovery.Costs `json:"learned,omitempty"`
	// LoRASlotWaitSec is the wait for a LoRA adapter slot included in
	// WaitSec: the engine runs as many other adapters as it may at once.
	LoRASlotWaitSec float64 `json:"lora_slot_wait_sec,omitempty"`
	// EvictsSec is the recompute of the prompt the endpoint's engine would
	// evict for this one (it keeps its learned count of others), which a
	// spill there must save.
	EvictsSec  float64 `json:"evicts_sec,omitempty"`
	WaitSec    float64 `json:"wait_sec"`
	Rendezvous uint64  `json:"rendezvous"`
	// CacheSource says what the endpoint's matched blocks rest on:
	// "events" (its engine's KV events confirm and evict them) or
	// "learned" (the router's own routing history).
	CacheSource string `json:"cache_source,omitempty"`
	// KeptPrompts is how many prefix keys the endpoint's engine is taken
	// to keep warm (warmth: learned, or the fleet's); absent when unknown.
	KeptPrompts int `json:"kept_prompts,omitempty"`
	// HeldPromptTokens: the endpoint is taken to hold an earlier prompt
	// of this request's conversation whole, of so many tokens (sequences).
	HeldPromptTokens int `json:"held_prompt_tokens,omitempty"`
	// HomesFull: a router alone would not place a new prompt here (the
	// endpoint homes its share of the prompts already; decide), or a new
	// conversation (its slots keep live ones; sequences).
	HomesFull bool   `json:"homes_full,omitempty"`
	Skipped   string `json:"skipped,omitempty"`
}

// decide returns the decision; terms, when not nil, receives each
// endpoint's side of it, and then nothing is counted as seen. It reads
// every endpoint's load once, so the terms and the decision agree.
func (p *Prefix) decide(r *Request, set *discovery.Set, terms *[]Term) Decision {
	// see: the decision is Pick's and the request counts (the homes see
	// its key, Foreign learns from its view of the engines); Explain's
	// (terms wanted) records nothing.
	see := terms == nil
	prm := p.params.Load()
	sp := p.match(r.Hashes)
	defer p.scratch.Put(sp)
	matches := *sp
	deepest := deepestMatch(matches)

	meshed := p.meshed != nil && p.meshed()
	replicated := p.Foreign() >= sharedFleet || meshed
	key, keyed, branch := p.keyOf(r.Hashes, r.Prefill, prm, deepest, replicated, see)
	group := r.group(set)
	var t turn
	if meshed && p.rank != nil && p.others != nil {
		t = turnOf(key, group, p.rank(), p.others()+1)
	}
	// The key's home; established when the key recurs.
	var homeID uint64
	var hk homeKey
	var hasHome bool
	if keyed {
		homeID, hk, hasHome = p.homes.lookup(key, group, prm.HomeLoadFactor, see, branch > 0, !replicated || meshed, t)
	}
	bpt := p.BytesPerToken()
	promptTokens := r.PromptTokens
	if r.PromptBytes > 0 {
		promptTokens = int(float64(r.PromptBytes) / bpt)
	}
	k := costing{prm: prm, pinned: prm.pins(), key: key, model: r.Model, promptTokens: promptTokens,
		tokensPerBlock: float64(p.blockBytes) / bpt, bytesPerToken: bpt, now: time.Now()}
	if keyed {
		k.warm, k.colds = p.warm, &p.colds
	}
	if len(r.Marks) > 0 {
		k.seqs = p.seqs
		k.seqAt, k.seqMark, _, k.seqKept = p.seqs.latest(r.Marks)
	}
	k.turn = t

	// A router alone places a key seen for the first time on a slot
	// engine (llama.cpp, Ollama: a few prompts cached per sequence slot)
	// only where its homes stay balanced: at its home, or, when the home
	// is busy, on another endpoint that homes fewer keys than its bound
	// (homes.hasRoom) — never on one that has its share already, where
	// the key would stay (its cache follows it) and load that endpoint
	// above the others. (Eight groups on four Ollama servers with four
	// slots each went 3-2-2-1 by such first picks.) A paged cache holds
	// many prompts: there a new prompt goes where it waits least, and a
	// faster engine takes more of them. Gossiping replicas, which home keys
	// as a router alone does, place alike; replicas that do not gossip
	// place by the assignment.
	firstAlone := keyed && hasHome && (!replicated || meshed) && !hk.recurring && hk.at == 0 && branch == 0
	ch := p.gather(r, group, &k, matches, homeKeyed{id: homeID, ok: hasHome, branch: branch, first: firstAlone}, see, terms)
	if ch.top.e == nil {
		return Decision{Reason: ReasonCold}
	}
	if ch.home.e == nil {
		ch.home = ch.top // the home is not usable now, or every endpoint is at the bound
	}
	if terms != nil {
		for i := range *terms {
			(*terms)[i].Home = (*terms)[i].Endpoint == ch.home.e.URL
		}
	}
	established := hk.recurring && ch.home.e.ID == homeID
	ch.shared, ch.blocks = branch, len(r.Hashes)
	// A home is presumed to hold its keys only where other routers share
	// the engines unseen: they route the keys home too (a branch's from
	// its first sight here: the conversation's earlier turns went there
	// through the other replicas). A router alone knows where it sent each
	// key, and replicas that gossip know where each of them did (their
	// placements are in the index): when the recurring set changes the
	// key's home, the key stays where it is cached until the index forgets
	// it there. (Presuming homes among gossiping replicas sent a
	// conversation's turns home while its history was cached on the
	// endpoint a peer had placed it on: two replicas 0.80 of one's hit
	// rate on multi-turn, bench/sim.)
	presume := replicated && !meshed && (established || branch > 0) && !hk.strayed
	target, reason := ch.target(established, presume, prm)
	d := target.decision(reason, promptTokens)
	d.Home = target.e == ch.home.e
	if keyed {
		d.PrefixKey, d.branch = key, branch > 0
		d.unplaced = !hk.recurring && hk.at == 0
	}
	return d
}

// homeKeyed is what gather needs of the request's home: the endpoint
// (when ok), the family's shared blocks held there, and whether the key
// is a router alone's first sight (decide's firstAlone).
type homeKeyed struct {
	id     uint64
	ok     bool
	branch int
	first  bool
}

// gather costs every usable endpoint of group for r and returns the
// candidates' picks; terms, when not nil, receives each endpoint's side.
// For a router alone's first sight of a key, endpoints of slot engines
// that home their share already are left out unless none is left; with
// see, the engines' foreign share is learned from the fresh scrapes.
func (p *Prefix) gather(r *Request, group []*discovery.Endpoint, k *costing, matches []prefix.Match, home homeKeyed, see bool, terms *[]Term) picks {
	var ch, full picks         // full: the candidates left out, should none be left
	var engines, foreign int64 // the fresh scrapes' requests, and those not this router's
	for _, e := range group {
		if !Usable(r, e) {
			if terms != nil {
				*terms = append(*terms, skippedTerm(r, e))
			}
			continue
		}
		matched, lower := matchedBlocks(matches, e.ID)
		isHome := home.ok && e.ID == home.id
		shared := 0
		if isHome {
			// Every replica sends the family's branches to their homes,
			// which so hold the shared part too (or compute it once).
			shared = home.branch
		}
		c := k.candidate(e, matched, lower, shared)
		if eng := c.load.eng; eng != nil {
			engines += eng.Running + eng.Waiting
			foreign += max(0, eng.Running+eng.Waiting-eng.Routed) // other replicas' too
		}
		fullHere := home.first && !isHome && e.Dialect().Slotted() && !p.homes.hasRoom(e.ID) || k.seqCrowded(c)
		if terms != nil {
			*terms = append(*terms, p.term(c, fullHere))
		}
		if fullHere {
			full.add(c, false, k.prm.TieSec)
			continue
		}
		ch.add(c, isHome, k.prm.TieSec)
	}
	if see && engines > 0 {
		p.learnForeign(float64(foreign) / float64(engines))
	}
	if ch.top.e == nil {
		return full
	}
	return ch
}

// term is candidate c's side of a decision for /debug/route; full when a
// new key could not be placed there (its homes are at the bound).
func (p *Prefix) term(c candidate, full bool) Term {
	t := c.term()
	t.CacheSource = "learned"
	if p.index.OnTruth(c.e.ID) {
		t.CacheSource = "events"
	}
	t.KeptPrompts = p.warm.kept(c.e.ID)
	t.HomesFull = full
	return t
}

// matchedBlocks returns the blocks matches credit endpoint id with, and
// how many of them it holds only on a slower tier.
func matchedBlocks(matches []prefix.Match, id uint64) (blocks, lower int) {
	for _, m := range matches {
		if m.ID == id {
			return m.Blocks, m.Lower
		}
	}
	return 0, 0
}

// candidate is one endpoint's terms in a decision.
type candidate struct {
	e        *discovery.Endpoint
	load     load
	rates    rates
	wait     float64 // the wait estimate
	own      float64 // the wait from this router's own counters alone
	idle     bool    // may take spills
	warm     bool    // matches at least MinMatchBlocks
	score    uint64  // rendezvous score for the request's key
	tie      uint64  // wins ties among spill targets: the score in this replica's turn (costing.turn)
	uncached int
	loaded   int     // cached tokens to load from a slower tier
	blocks   int     // matched blocks that count (0 below MinMatchBlocks)
	loraWait float64 // the wait for a LoRA adapter slot, included in wait
	// evicts is the recompute of the prompt that sending the request here
	// would evict (warmth.evicts; a prompt as long as this one), seconds.
	evicts float64
	seq    seqHeld // the request's earlier prompt held whole here
}

// costing is what every candidate of one decision is costed with.
type costing struct {
	prm            *PrefixParams
	pinned         pins
	key            uint64   // the request's prefix key
	model          string   // the request's model or adapter
	adapters       []string // scratch: the adapters holding an endpoint's slots
	promptTokens   int
	tokensPerBlock float64
	warm           *warmth // what engines keep (warmth.at); nil: the request has no key
	bytesPerToken  float64
	// seqs is the whole prompts each engine keeps (Prefix.seqs; nil: the
	// request has no marks), read at now: the latest of the request's
	// earlier prompts held anywhere is seqMark, on endpoint seqAt, kept
	// there (seqKept) or not.
	seqs    *warmth
	now     time.Time
	seqAt   uint64
	seqMark prefix.Mark
	seqKept bool
	// turn orders a new key's home and ties among idle spill targets while
	// meshed (turnOf); else the rendezvous scores do.
	turn turn
	// colds are the peers' recent cold placements of keys (nil: the
	// request has no key).
	colds *peerColds
}

// candidate reads e's load and applies the wait model for the request's
// prompt, of which the index credits e with matched blocks, lower of them
// only on a slower tier than the GPU (engine truth: they cost a load, not a
// recompute). None of them count beyond what e's engine keeps (warmth),
// and at least shared do (the family's shared part, at its home).
func (k *costing) candidate(e *discovery.Endpoint, matched, lower, shared int) candidate {
	holds, evicts := true, false
	if k.warm != nil {
		holds, evicts = k.warm.at(e.ID, k.key)
	}
	if !holds {
		matched, lower = 0, 0
	}
	matched = max(matched, shared)
	seq := k.sequence(e, holds)
	c := candidate{e: e, load: loadOf(e), score: rendezvous(k.key, e.ID), warm: matched >= k.prm.MinMatchBlocks}
	if k.colds != nil {
		c.load.pending += k.colds.at(k.key, e.ID, k.now)
	}
	c.tie = k.turn.of(c.score)
	if c.warm {
		c.blocks = matched // a shorter match counts neither for warmth nor for cost
		c.loaded = min(int(float64(min(lower, matched))*k.tokensPerBlock), k.promptTokens)
	}
	c.seq = seq
	c.uncached = max(0, k.promptTokens-max(int(float64(c.blocks)*k.tokensPerBlock), seq.tokens))
	c.loaded = min(c.loaded, k.promptTokens-c.uncached)
	c.rates = k.prm.ratesOf(c.load.costs, k.pinned)
	if evicts {
		c.evicts = float64(k.promptTokens) / c.rates.prefill // the evicted prompt, taken as long
	}
	c.wait, c.own, c.idle = k.prm.wait(c.load, c.rates, c.uncached, c.loaded)
	if k.waitsForLoRASlot(e, c.load.eng) {
		// The request waits, however free the batch, until one of the
		// running adapters has no request left: about the time a request
		// holds its place there. Not a spill target meanwhile.
		c.loraWait = c.rates.turnover
		c.wait += c.loraWait
		c.own += c.loraWait
		c.idle = false
	}
	return c
}

// waitsForLoRASlot reports whether the request names a LoRA adapter that
// e cannot run at once: as many other adapters as its engine runs at a
// time (vLLM's --max-loras, freshly scraped) have requests there. Those
// are this router's own requests in flight, exact and current, and, when
// the engine also runs other clients' requests, the adapters its scrape
// showed running. The request's model is an adapter when e's model list
// says so or, with the list unknown, when the engine shows requests for it
// waiting.
func (k *costing) waitsForLoRASlot(e *discovery.Endpoint, eng *discovery.EngineStats) bool {
	if k.model == "" || eng == nil || eng.LoRA == nil {
		return false
	}
	if m := e.Models(); m != nil && !m.Adapter(k.model) || m == nil && !slices.Contains(eng.LoRA.Waiting, k.model) {
		return false
	}
	active := e.AdaptersInFlight(k.adapters[:0])
	if eng.Foreign()+eng.Peers > 0 {
		for _, a := range eng.LoRA.Running {
			if !slices.Contains(active, a) {
				active = append(active, a)
			}
		}
	}
	k.adapters = active
	return !slices.Contains(active, k.model) && len(active) >= eng.LoRA.MaxLoRAs
}

// term is c's side of the decision, for /debug/route.
func (c candidate) term() Term {
	t := Term{Endpoint: c.e.URL, MatchedBlocks: c.blocks, Warm: c.warm, Idle: c.idle,
		UncachedTokens: c.uncached, LoadedTokens: c.loaded, LoadTokensPerSec: c.rates.load, InFlightPrefill: c.load.pending, InFlightRequests: c.load.inFlight, PeerInFlight: c.load.peer,
		WaitSec: c.wait, LoRASlotWaitSec: c.loraWait, EvictsSec: c.evicts, Rendezvous: c.score, Learned: c.load.costs,
		PrefillTokensPerSec: c.rates.prefill, PendingTokensPerSec: c.rates.pending, DecodeCostSec: c.rates.decode,
		QueueCostSec: c.rates.queue, SlotCostSec: c.rates.slot, BatchLimit: c.rates.limit, HeldPromptTokens: c.seq.tokens}
	if eng := c.load.eng; eng != nil {
		t.EngineWaiting, t.EngineRunning, t.EngineKVUsage = &eng.Waiting, &eng.Running, &eng.KVUsage
	}
	return t
}

func skippedTerm(r *Request, e *discovery.Endpoint) Term {
	why := "already tried"
	switch {
	case !e.Routable():
		why = e.State().String()
	case !e.Serves(r.Model):
		why = "does not serve the model"
	case e.Shedding():
		why = "shedding (answered 429 to everything)"
	case e.Full():
		why = "full (answered 429 at this load)"
	case r.MaxInFlight > 0 && e.InFlight() >= r.MaxInFlight:
		why = "at --max-in-flight-per-endpoint"
	case r.StartNow && r.Alone && !e.HasRoom():
		why = "no room (the request waited in the queue, alone of its tenant: it goes where it starts now)"
	case r.StartNow && !e.QueueRoom():
		why = "no room (its batch and short queue are full; the request waited in the queue)"
	}
	return Term{Endpoint: e.URL, Skipped: why}
}

// picks gathers the candidates a decision chooses among.
type picks struct {
	warm candidate // the deepest match, then the shortest wait
	free candidate // the idle endpoint with the shortest wait (spill target)
	best candidate // the endpoint with the shortest wait
	home candidate // the candidate of the key's home
	top  candidate // the plain rendezvous winner
	// shared is the family's shared part (blocks) when the key is a
	// branch's own (see homes.family), 0 otherwise; blocks is the
	// request's.
	shared, blocks int
	// n counts the candidates, everywhere those matching as deep as warm.
	n, everywhere int
}

// add considers c; home tells whether c is the key's home.
func (ch *picks) add(c candidate, home bool, tie float64) {
	if ch.top.e == nil || c.score > ch.top.score {
		ch.top = c
	}
	if home {
		ch.home = c
	}
	if c.idle && c.beats(ch.free, tie, true) {
		ch.free = c
	}
	if c.beats(ch.best, tie, false) {
		ch.best = c
	}
	ch.n++
	switch {
	case !c.warm:
	case ch.warm.e == nil || c.blocks > ch.warm.blocks:
		ch.warm, ch.everywhere = c, 1
	case c.blocks == ch.warm.blocks:
		ch.everywhere++
		if c.beats(ch.warm, tie, false) {
			ch.warm = c
		}
	}
}

// preferHome returns the warm candidate after giving the home its
// precedence. Among equally deep matches the home comes first while its
// wait is within the spill rule of the others: copies a spill left
// elsewhere then serve only while the home is saturated and age out of
// those caches afterwards, instead of keeping the prefix cached twice.
// (Letting equally warm endpoints share the load, the home winning only
// ties, lengthened the hot prefix's tail: BENCHMARKS.md, "Measurements
// behind the code".) With presume, the established home of a recurring key
// that this router's index does not show warm there is presumed to hold
// what the copies hold: other replicas, which route the key home too, have
// most likely kept it there, while the copy is this router's own. (decide
// does not presume when this router sent the key's first request elsewhere
// because the home was busy: the copy is then where the key lives. A home
// shown warm to a shallower depth than a copy holds a shorter shared prefix
// — a system prompt common to many conversations — and the copy the
// conversation; but when the key is a conversation's own (a branch of a
// chained family), its home shown holding no more than the family's shared
// part is presumed to hold the conversation.)
func (ch *picks) preferHome(presume bool, prm *PrefixParams) candidate {
	warm, h := ch.warm, ch.home
	presumed := presume && h.blocks <= ch.shared
	// A conversation's copy that lost most of it (lost) leaves the home
	// judged by its load alone, as a presumed home is; the home keeps its
	// real cost, the recompute the move pays once.
	lost := !presumed && ch.lost()
	if warm.e == nil || h.e == warm.e || !(h.blocks == warm.blocks || presumed || lost) {
		return warm
	}
	if !presumed && !lost && ch.everywhere == ch.n {
		// Every endpoint holds the prefix as deep, the home no more: no
		// copy is extra, the load decides.
		return warm
	}
	var saved float64
	if h.blocks < warm.blocks {
		saved = float64(h.uncached-warm.uncached) / h.rates.prefill
	}
	if h.wait-saved > warm.wait*prm.SpillRatio+prm.SpillMarginSec {
		return warm
	}
	if presumed && h.blocks < warm.blocks { // presumed to hold what the copy holds
		h.wait, h.own = h.wait-saved, h.own-saved
		h.blocks, h.uncached = warm.blocks, warm.uncached
	}
	return h
}

// lost reports whether the key is a conversation's own (a branch of a
// chained family) whose deepest copy, away from its home, holds some but
// less than half of what the conversation added to the family's shared
// part: that endpoint evicted most of its history, so a request there
// recomputes most of it anyway, and the conversation goes home, where its
// next turns find it, unless the home is saturated. A conversation that
// nothing holds beyond the shared part is new (or evicted everywhere) and
// is placed by the load, as a router alone places it: sent home, new
// conversations went wherever their keys' rendezvous put them, and eight
// replicas gave one of eight kvsim pods seven of 24 live conversations
// while others had one, where one router keeps three on each; that pod
// then recomputed most of every turn. (Staying where the deepest copy was,
// the conversations that a first wave had crowded onto one endpoint —
// replicas that had each kept their own under the spill rule there —
// recomputed most of their histories every turn until they ended: three
// gossiping replicas 0.89 of one router's requests/s on bench/sim
// multi-turn.)
func (ch *picks) lost() bool {
	return ch.shared > 0 && ch.home.e != nil && ch.blocks > ch.shared &&
		ch.warm.blocks > ch.shared && 2*(ch.warm.blocks-ch.shared) < ch.blocks-ch.shared
}

// target applies the spill rule to the warm candidate, or for a prefix
// warm nowhere to its home, and returns the pick and its reason.
//
// The spill test takes the target's wait in the routers' own view (this
// router's counters and its gossiping peers' reports): the engine's queue
// is up to a scrape old, so acting on it would make every replica spill
// the target's prefixes for a whole interval after the queue drained.
// (Which endpoint is idle enough to take a spill does consult the
// engine.) A cold prefix goes to its home: a prefix the index forgot
// returns where it lived, and replicas that never saw it agree on where
// that is. An established home leaves the request only when it is
// saturated as a warm endpoint would be (its wait without the recompute):
// the index forgetting is no evidence that the engine did, and another
// router may keep the prefix there — unless the home's engine keeps a
// learned count of prompts, that many others went there since (slot
// engines; paged ones whose misses showed a count), no router unseen
// shares the engines (presume), and every slot of the home is busy (full:
// its slots known). There the request is cold at home as on the spill
// target, evicts a prompt at either, and queues at home, so the home's
// queue decides. (With a slot free it starts at once at home. Ollama, whose
// slots kvroute cannot know, is left out: with OLLAMA_NUM_PARALLEL=4, its
// homes' slots mostly free, sending busy homes' cold requests away read 130
// cold prompts in three rounds against 115 before.) A prefix warm nowhere
// that does not recur has nothing cached to keep: it goes home only while
// the home would start it about as soon as the endpoint with the shortest
// wait, busy or not (the spill rule against that endpoint), so that on
// engines with small batches new prompts do not queue behind each other
// while others idle.
func (ch *picks) target(established, presume bool, prm *PrefixParams) (candidate, string) {
	target, reason := ch.preferHome(presume, prm), ReasonWarm
	spillTest := target.own
	if target.e == nil {
		target, reason, spillTest = ch.home, ReasonCold, ch.home.own
		switch {
		case !established:
			if ch.home.wait > ch.best.wait*prm.SpillRatio+prm.SpillMarginSec {
				return ch.best, ReasonCold
			}
		case ch.home.evicts > 0 && !presume && ch.home.full():
			// The home's engine keeps a learned count of prompts and this
			// one is not among them: cold there as anywhere, it pushes out
			// a prompt kept there as it would on the spill target, and it
			// waits for a slot.
			spillTest += ch.home.evicts
		default:
			spillTest -= float64(ch.home.uncached) / ch.home.rates.prefill
		}
	}
	if ch.free.e != nil && spillTest > ch.free.wait*prm.SpillRatio+prm.SpillMarginSec+ch.free.stall()+ch.free.evicts {
		if reason == ReasonWarm {
			reason = ReasonSpill
		}
		return ch.free, reason
	}
	return target, reason
}

// full reports whether every slot of c's engine is busy with the
// routers' requests, its slots known (slotsOf): a request sent there
// queues for one.
func (c candidate) full() bool {
	slots := slotsOf(c.e, c.rates)
	return slots > 0 && c.load.inFlight+c.load.peer >= slots
}

// stall is what computing the request's uncached tokens on c costs the
// requests running there: each waits for that prefill (it shares their
// steps), so a spill must save the request more than it costs them, and
// more than the recompute of a prompt it evicts (c.evicts): on engines
// that keep a prompt or two, a key taken for cold at its busy home went to
// an idle server, evicted the prompt kept there, and the next request of
// that prompt missed in turn.
func (c candidate) stall() float64 {
	running := c.load.inFlight + c.load.peer
	if c.load.eng != nil {
		running = max(running, c.load.eng.Running)
	}
	return float64(c.uncached) / c.rates.prefill * float64(running)
}

// beats reports whether c is a better pick than o (an empty o loses): a
// wait shorter by more than tie, or a tie won on the rendezvous score
// (inTurn: on candidate.tie, this replica's turn while meshed).
func (c candidate) beats(o candidate, tie float64, inTurn bool) bool {
	switch {
	case o.e == nil || c.wait < o.wait-tie:
		return true
	case c.wait > o.wait+tie:
		return false
	case inTurn:
		return c.tie > o.tie
	}
	return c.score > o.score
}

// turn is a gossiping replica's own order of a key's endpoints: the
// key's rendezvous order begun at the endpoint whose score is pivot, and
// on from the top past the lowest (when on; else the order itself), for a
// new key's home and ties among idle spill targets. Replica r of n begins
// r × endpoints / n places down (turnOf). Replicas that decide alike on
// the same view (a burst of one prompt, their picks yet untold) then each
// begin at their own endpoint and spill to the next ones in turn, where
// each took the rendezvous winner: eight replicas sent the first wave of
// 24 conversations 8-4-3-3-2-2-1-1 over eight pods, eight to the shared
// prompt's home, where one router sends three to each (bench/sim
// multi-turn). Other ties (the shortest wait, equally deep copies) stay on
// the scores, where replicas agree. A router alone breaks every tie on the
// scores.
type turn struct {
	pivot uint64
	on    bool
}

// turnOf returns the turn of a replica of rank among n live ones for key
// over group.
func turnOf(key uint64, group []*discovery.Endpoint, rank, n int) turn {
	if len(group) == 0 {
		return turn{}
	}
	scores := make([]uint64, len(group))
	for i, e := range group {
		scores[i] = rendezvous(key, e.ID)
	}
	slices.Sort(scores)
	m := len(scores)
	off := rank * m / max(n, 1) % m // a rank read before a peer left may reach n
	return turn{pivot: scores[m-1-off], on: true}
}

// of returns a rendezvous score's place in the turn, the higher first: the
// pivot highest, the scores below it next, then those above it (the
// subtraction wraps them below every score up to the pivot).
func (t turn) of(score uint64) uint64 {
	if !t.on {
		return score
	}
	return score - t.pivot - 1
}

// first returns the endpoint of eps that comes first in the turn for key
// among those ok accepts (nil: all), or 0 when none is.
func (t turn) first(key uint64, eps []*discovery.Endpoint, ok func(id uint64) bool) (id uint64) {
	var best uint64
	for _, e := range eps {
		if ok != nil && !ok(e.ID) {
			continue
		}
		if o := t.of(rendezvous(key, e.ID)); id == 0 || o > best {
			id, best = e.ID, o
		}
	}
	return id
}

func (c candidate) decision(reason string, promptTokens int) Decision {
	return Decision{Endpoint: c.e, Reason: reason, Prefill: c.uncached, Loaded: c.loaded, MatchedBlocks: c.blocks,
		Contended: c.load.pending > 0, busy: c.load.inFlight+c.load.peer > 0 && c.e.Dialect().Slotted(), PromptTokens: promptTokens,
		seqFrom: c.seq.mark, seqBytes: c.seq.bytes}
}

// Follow sets o's OnRemove, OnRestart and OnCapacity so that the policy
// follows the fleet: an endpoint that left, or whose engine restarted with
// an empty cache, is forgotten (index and homes), and a scraped KV capacity
// sizes the endpoint's index.
func (p *Prefix) Follow(o *discovery.Options) {
	forget := func(e *discovery.Endpoint) { p.Forget(e.ID) }
	o.OnRemove, o.OnRestart = forget, forget
	o.OnCapacity = func(e *discovery.Endpoint, tokens int) { p.SetCapacityTokens(e.ID, tokens) }
}

// Kept returns how many distinct prefix keys endpoint id's engine is
// learned to keep warm (warmth); 0 when unknown: as many as the index
// remembers.
func (p *Prefix) Kept(id uint64) int { return p.warm.kept(id) }
