package sim

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// request is one HTTP inference request: one or more sequences (prompts × n)
// answered together. Fields above mu are set before submit and then only
// read. The engine publishes progress into the sequences' pub fields under
// mu and signals wake; the HTTP side reads them under mu.
type request struct {
	id           string // response id, e.g. "cmpl-<base>"
	chat         bool
	stream       bool
	includeUsage bool
	noCached     bool // usage without cached_tokens (Config.NoCachedTokens)
	holdKV       bool // prefill role: hold the KV for a remote decode
	model        string
	created      int64 // unix seconds
	seqs         []*seq

	wake      chan struct{}      // capacity 1; signalled on progress
	cancelled atomic.Bool        // the client went away; the engine aborts
	ctx       context.Context    // done once cancelled; stops the request's KV pulls
	stop      context.CancelFunc // cancels ctx

	mu       sync.Mutex
	doneSeqs int     // guarded by mu
	kv       *kvHold // guarded by mu: the prefill hold, once finished
}

// newRequest returns a request with its wake channel and context.
func newRequest() *request {
	r := &request{wake: make(chan struct{}, 1)}
	r.ctx, r.stop = context.WithCancel(context.Background())
	return r
}

// cancel marks the request as abandoned by its client and reports whether
// this call did (the first one). Safe for concurrent use.
func (r *request) cancel() bool {
	if r.cancelled.Swap(true) {
		return false
	}
	r.stop()
	return true
}

// seqPub is what the engine publishes about a sequence (guarded by req.mu).
type seqPub struct {
	generated int    // tokens generated so far
	finish    string // "", "length", "stop" or "abort"
	cached    int    // prompt tokens served from cache (local + remote)
}

type seqState uint8

const (
	stWaiting seqState = iota
	stLoading          // pulling KV from a prefill pod
	stRunning
	stDone
)

// seq is one sequence. Fields above the engine-owned block are immutable.
type seq struct {
	req       *request
	index     int // choice index
	prompt    []uint32
	maxTokens int
	ignoreEOS bool
	seed      uint64 // output text and EOS draws
	root      uint64 // parent hash of block 0 (cache_salt)
	lora      string // the LoRA adapter named as the model; "" for the base model
	remote    *kvRef // where to pull the prompt's KV from (decode role), or nil
	room      *room  // the bootstrap room to hold the KV for (prefill role), or nil

	// Engine goroutine only.
	state       seqState
	generated   int
	numComputed int
	blocks      []int32
	hashes      []uint64 // chained hashes of the leading full, computed blocks
	cpuBlocks   int      // blocks after the GPU hit that match loads from the CPU tier
	fromCPU     bool     // back from a CPU load, whose admission counted the lookup
	cached      int      // reported cached tokens (first admission)
	admitted    bool
	remoteDone  bool
	reason      string        // finish reason once stDone
	arrival     time.Duration // modelled
	lastToken   time.Duration // modelled time of the last sampled token

	pub seqPub // guarded by req.mu
}

func (s *seq) numTokens() int { return len(s.prompt) + s.generated }

// tokenAt returns token i of the sequence (prompt, then generated tokens).
func (s *seq) tokenAt(i int, vocab uint32) uint32 {
	if i < len(s.prompt) {
		return s.prompt[i]
	}
	return pieceID(outputWord(s.seed, i-len(s.prompt)), vocab)
}

// kvHold is KV a prefill pod keeps for a remote decode pod. Guarded by
// engine.mu once published in engine.holds.
type kvHold struct {
	id       string // remote_request_id; "" for a room's hold
	room     *room  // the bootstrap room that holds it, or nil
	blocks   []int32
	tokens   int
	deadline time.Time // wall
	done     bool      // pulled or expired
}

type evKind uint8

const (
	evRequest   evKind = iota
	evLoaded           // a KV pull finished (ok or not)
	evRelease          // a hold was pulled: release its blocks
	evNudge            // something was cancelled
	evCPULoaded        // a load from the CPU tier finished (or its request was cancelled)
	evReset            // reset the prefix cache, then close done
)

type event struct {
	kind evKind
	at   time.Time // wall time it was posted
	req  *request
	seq  *seq
	ok   bool
	hold *kvHold
	done chan struct{}
}

type scheduled struct {
	s       *seq
	n       int  // tokens computed this step
	prefill bool // several tokens of one sequence: a prompt chunk
}

// engine is one pod's continuous-batching loop. Handlers talk to it only via
// post; everything below the mutex-guarded block belongs to the goroutine
// running run.
type engine struct {
	cfg       *Config
	m         *podMetrics
	scale     float64
	startWall time.Time
	done      <-chan struct{}
	vocab     uint32
	// startPull starts a tracked goroutine that pulls s's KV and posts
	// evLoaded, not before the wall time ready (the modelled transfer end)
	// nor, for a pull that waits for a concurrent prefill, before transfer
	// (wall) after the prefill pod answered.
	startPull func(s *seq, ready time.Time, transfer time.Duration)
	// startCPULoad starts a tracked goroutine that posts evCPULoaded for s
	// at the wall time ready (the modelled end of its copy from the CPU
	// tier), or once s's request is cancelled.
	startCPULoad func(s *seq, ready time.Time)
	// kv publishes ev's events at the end of every step; both nil when KV
	// events are off.
	kv *kvPublisher
	ev *kvEvents

	mu          sync.Mutex
	inbox       []event
	holds       map[string]*kvHold
	holdCount   uint64
	rooms       map[uint64]*room // bootstrap rooms (bootstrap.go)
	closedRooms []*room          // closed rooms, FIFO by expiry
	wake        chan struct{}

	cache     *blockCache
	hash      hasher
	waiting   []*seq
	running   []*seq
	loading   int
	holdQueue []*kvHold // FIFO by deadline
	modelNow  time.Duration
	timer     *time.Timer
	spare     []event
	batch     []scheduled
	toks      []uint32 // scratch: one block of token ids
	notify    []*seq   // scratch: sequences to publish after a step

	// Published for gauges and Stats.
	nRunning, nWaiting, nUsed, nHeld atomic.Int64
	loras                            atomic.Pointer[loraInfo] // nil until a LoRA pod's first step
	steps                            atomic.Uint64
	modelClock                       atomic.Int64
}

func newEngine(cfg *Config, start time.Time, done <-chan struct{}) *engine {
	t := time.NewTimer(time.Hour)
	t.Stop()
	e := &engine{
		cfg: cfg, scale: cfg.TimeScale, startWall: start, done: done,
		vocab: uint32(cfg.VocabSize), holds: make(map[string]*kvHold), rooms: make(map[uint64]*room),
		wake: make(chan struct{}, 1), cache: newBlockCache(cfg.NumGPUBlocks), timer: t,
		toks: make([]uint32, cfg.BlockSize),
	}
	if cfg.KVEventsPort != 0 {
		e.ev = &kvEvents{}
		e.cache.ev = e.ev
	}
	if cfg.CPUBlocks > 0 {
		e.cache.cpu = newCPUTier(cfg.CPUBlocks, e.ev)
	}
	return e
}

func (e *engine) modelOf(w time.Time) time.Duration {
	return time.Duration(float64(w.Sub(e.startWall)) * e.scale)
}

func (e *engine) wallOf(m time.Duration) time.Time {
	return e.startWall.Add(time.Duration(float64(m) / e.scale))
}

func (e *engine) blocksFor(tokens int) int { return (tokens + e.cfg.BlockSize - 1) / e.cfg.BlockSize }

// post hands an event to the engine goroutine. Safe for concurrent use.
func (e *engine) post(ev event) {
	if ev.at.IsZero() {
		ev.at = time.Now()
	}
	e.mu.Lock()
	e.inbox = append(e.inbox, ev)
	e.mu.Unlock()
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// run is the engine loop; it returns when done is closed.
func (e *engine) run() {
	defer e.timer.Stop()
	idle := true
	var prevStart, prevEnd time.Duration
	for {
		e.mu.Lock()
		evs := e.inbox
		e.inbox = e.spare[:0]
		e.mu.Unlock()
		if idle {
			// The modelled clock ran on while the engine slept: resume it at
			// the earliest event (not at the wake-up, whose latency is the
			// simulator's, not the GPU's), or now after a timer wake-up.
			at := time.Now()
			for _, ev := range evs {
				if ev.at.Before(at) {
					at = ev.at
				}
			}
			e.modelNow = max(e.modelNow, e.modelOf(at))
		}
		for i := range evs {
			e.handle(&evs[i], idle, prevStart, prevEnd)
			evs[i] = event{}
		}
		e.spare = evs
		e.sweepHolds(time.Now())
		e.reapCancelled()

		prefill, ctxTokens := e.schedule()
		e.publishGauges()
		if len(e.batch) == 0 {
			e.flushKV()
			idle = true
			if !e.sleepIdle() {
				return
			}
			continue
		}
		idle = false
		start := e.modelNow
		d := e.cfg.StepCost(prefill, ctxTokens)
		end := start + d
		info := StepInfo{Start: start, Duration: d, PrefillTokens: prefill, ContextTokens: ctxTokens,
			Running: len(e.running), Waiting: len(e.waiting) + e.loading, UsedBlocks: e.cache.used()}
		if !e.sleepUntil(e.wallOf(end)) {
			return
		}
		e.modelNow, prevStart, prevEnd = end, start, end
		e.modelClock.Store(int64(end))
		info.DecodeSeqs = e.apply(end)
		e.flushKV()
		e.steps.Add(1)
		if e.cfg.OnStep != nil {
			e.cfg.OnStep(info)
		}
		e.deliver()
	}
}

func (e *engine) sleepUntil(deadline time.Time) bool {
	d := time.Until(deadline)
	if d <= 0 {
		select {
		case <-e.done:
			return false
		default:
			return true
		}
	}
	e.timer.Reset(d)
	select {
	case <-e.timer.C:
		return true
	case <-e.done:
		return false
	}
}

// sleepIdle waits for an event, the next hold expiry or shutdown. An idle
// engine uses no CPU.
func (e *engine) sleepIdle() bool {
	var expiry <-chan time.Time
	e.mu.Lock()
	for _, h := range e.holdQueue {
		if !h.done {
			e.timer.Reset(max(time.Until(h.deadline), 0))
			expiry = e.timer.C
			break
		}
	}
	e.mu.Unlock()
	select {
	case <-e.wake:
	case <-expiry:
	case <-e.done:
		return false
	}
	e.timer.Stop()
	return true
}

func (e *engine) handle(ev *event, idle bool, prevStart, prevEnd time.Duration) {
	switch ev.kind {
	case evRequest:
		// A request that arrived while the engine slept starts the next step;
		// one that arrived during a step waited for that step to end.
		arr := e.modelNow
		if !idle {
			arr = min(max(e.modelOf(ev.at), prevStart), prevEnd)
		}
		for _, s := range ev.req.seqs {
			s.arrival = arr
			e.waiting = append(e.waiting, s)
		}
	case evLoaded:
		e.loaded(ev.seq, ev.ok)
	case evRelease:
		e.cache.releaseAll(ev.hold.blocks)
	case evCPULoaded:
		e.cpuLoaded(ev.seq)
	case evReset:
		e.cache.reset()
		close(ev.done)
	}
}

// flushKV hands the events collected since the last flush to the publisher
// as one batch: one per engine step that has any, as vLLM publishes.
func (e *engine) flushKV() {
	if e.kv == nil || len(e.ev.list) == 0 {
		return
	}
	e.kv.publish(time.Now(), e.ev.take())
}

// cpuLoaded finishes a load from the CPU tier: the loaded blocks count as
// computed and get their hashes on the GPU again (BlockStored, medium GPU),
// and the sequence waits at the head of the queue to compute the rest.
func (e *engine) cpuLoaded(s *seq) {
	e.loading--
	if s.req.cancelled.Load() {
		e.finish(s, "abort", e.modelNow)
		e.publish(s)
		return
	}
	s.numComputed += s.cpuBlocks * e.cfg.BlockSize
	s.cpuBlocks, s.fromCPU = 0, true
	e.commit(s)
	s.state = stWaiting
	e.waiting = append([]*seq{s}, e.waiting...)
}

// loaded finishes a KV pull: on success the prompt (all but its last token,
// which the decode pod recomputes to sample, as vLLM does) counts as
// computed; on failure the pod computes the prefill itself.
func (e *engine) loaded(s *seq, ok bool) {
	e.loading--
	s.remoteDone = true
	if s.req.cancelled.Load() {
		e.finish(s, "abort", e.modelNow)
		e.publish(s)
		return
	}
	if ok {
		if remote := len(s.prompt) - 1; remote > s.numComputed {
			e.m.extHits.Add(float64(remote - s.numComputed))
			s.numComputed = remote
			e.commit(s)
		}
	} else {
		e.m.kvFailed.Inc()
	}
	s.cached = s.numComputed
	s.state = stWaiting
	e.waiting = append([]*seq{s}, e.waiting...)
}

// sweepHolds releases holds whose decode pod never pulled them.
func (e *engine) sweepHolds(now time.Time) {
	if len(e.holdQueue) == 0 {
		return
	}
	e.mu.Lock()
	k := 0
	for ; k < len(e.holdQueue); k++ {
		h := e.holdQueue[k]
		if h.done {
			continue
		}
		if h.deadline.After(now) {
			break
		}
		h.done = true
		if h.room != nil {
			e.closeRoom(h.room, now, roomExpired)
		} else {
			delete(e.holds, h.id)
		}
		e.cache.releaseAll(h.blocks)
		e.nHeld.Add(-int64(len(h.blocks)))
		e.m.kvExpired.Inc()
	}
	e.holdQueue = e.holdQueue[k:]
	e.mu.Unlock()
}

// reapCancelled aborts sequences whose clients went away.
func (e *engine) reapCancelled() {
	keep := func(list []*seq) []*seq {
		out := list[:0]
		for _, s := range list {
			if s.req.cancelled.Load() {
				e.finish(s, "abort", e.modelNow)
				e.publish(s)
				continue
			}
			out = append(out, s)
		}
		clear(list[len(out):])
		return out
	}
	e.running = keep(e.running)
	e.waiting = keep(e.waiting)
}

// schedule builds e.batch for the next step, vLLM-v1 style: running
// sequences first (decode one token or continue a chunked prefill),
// preempting the newest running sequence when KV runs out; then, unless
// one was preempted, waiting sequences FCFS while the token budget, the
// sequence limit and KV last. It returns the prompt tokens computed and the
// KV tokens read.
func (e *engine) schedule() (prefill, ctxTokens int) {
	e.batch = e.batch[:0]
	budget, preempted := e.scheduleRunning(e.cfg.MaxNumBatchedTokens)
	if !preempted {
		e.scheduleWaiting(budget)
	}
	for _, b := range e.batch {
		if b.prefill {
			prefill += b.n
		}
		ctxTokens += b.s.numComputed + b.n
	}
	return prefill, ctxTokens
}

// scheduleRunning batches the running sequences in order while budget
// tokens last, growing each one's KV and preempting the newest running
// sequence when KV runs out (the sequence itself, when it is the newest:
// then the batch ends there). It returns the budget left and whether a
// sequence was preempted.
func (e *engine) scheduleRunning(budget int) (left int, preempted bool) {
	for i := 0; i < len(e.running) && budget > 0; {
		s := e.running[i]
		n := min(s.numTokens()-s.numComputed, budget)
		need := e.blocksFor(s.numComputed+n) - len(s.blocks)
		fits := true
		for need > e.cache.free {
			last := len(e.running) - 1
			victim := e.running[last]
			e.running[last] = nil
			e.running = e.running[:last]
			e.preempt(victim)
			preempted = true
			if victim == s {
				fits = false
				break
			}
		}
		if !fits {
			break
		}
		e.grow(s, need)
		e.batch = append(e.batch, scheduled{s, n, n > 1})
		budget -= n
		i++
	}
	return budget, preempted
}

// scheduleWaiting admits waiting sequences FCFS while budget tokens, the
// sequence limit and KV last: into the batch, or into loading when their
// KV comes from a remote prefill or the CPU tier. The first that KV cannot
// hold ends the admissions.
func (e *engine) scheduleWaiting(budget int) {
	// vLLM's scheduler admits requests for at most MaxLoRAs adapters into a
	// batch: a request for another is skipped, keeping its place.
	var active []string
	if len(e.cfg.LoRAs) > 0 {
		active = loraNames(e.running)
	}
	for i := 0; i < len(e.waiting) && budget > 0 && len(e.running) < e.cfg.MaxNumSeqs; {
		s := e.waiting[i]
		if s.lora != "" && e.cfg.MaxLoRAs > 0 && !slices.Contains(active, s.lora) {
			if len(active) >= e.cfg.MaxLoRAs {
				i++
				continue
			}
			active = append(active, s.lora) // admitted below, or the loop ends
		}
		fresh := s.blocks == nil
		if fresh {
			e.match(s)
		}
		var admitted bool
		switch {
		case s.remote != nil && !s.remoteDone:
			admitted = e.admitPull(i, s, fresh)
		case s.cpuBlocks > 0:
			admitted = e.admitCPULoad(i, s, fresh)
		default:
			var n int
			n, admitted = e.admitRunning(i, s, fresh, budget)
			budget -= n
		}
		if !admitted {
			return
		}
	}
}

// admitPull moves waiting sequence i, s, whose prompt's KV a remote
// prefill computed, into loading: it allocates the blocks and starts the
// transfer. When KV cannot hold them it undoes s's match (fresh: made for
// this admission) and returns false.
func (e *engine) admitPull(i int, s *seq, fresh bool) bool {
	need := e.blocksFor(len(s.prompt)) - len(s.blocks)
	if need > e.cache.free {
		e.unmatch(s, fresh)
		return false
	}
	e.grow(s, need)
	e.admitStats(s, true)
	e.m.extQueries.Add(float64(len(s.prompt) - 1 - s.numComputed))
	e.removeWaiting(i)
	s.state = stLoading
	e.loading++
	cost := e.cfg.TransferCost(len(s.prompt) - 1 - s.numComputed)
	e.startPull(s, e.wallOf(e.modelNow+cost), time.Duration(float64(cost)/e.scale))
	return true
}

// admitCPULoad moves waiting sequence i, s, into loading its CPU-tier
// blocks, as vLLM's OffloadingConnector does: the blocks after the GPU hit
// that the CPU tier holds are loaded asynchronously into newly allocated
// GPU blocks, and the request waits for them (WAITING_FOR_REMOTE_KVS)
// instead of computing them. When KV cannot hold them it undoes s's match
// (fresh: made for this admission) and returns false.
func (e *engine) admitCPULoad(i int, s *seq, fresh bool) bool {
	if s.cpuBlocks > e.cache.free {
		e.unmatch(s, fresh)
		return false
	}
	e.prefixStats(s)
	e.extStats(s)
	e.grow(s, s.cpuBlocks)
	e.removeWaiting(i)
	s.state = stLoading
	e.loading++
	tokens := s.cpuBlocks * e.cfg.BlockSize
	cost := e.cfg.CPUTransferCost(tokens)
	e.m.offloaded(cpuToGPU, float64(tokens)*e.cfg.KVBytesPerToken, cost)
	e.startCPULoad(s, e.wallOf(e.modelNow+cost))
	return true
}

// admitRunning moves waiting sequence i, s, into the running sequences and
// the batch, with as many of its tokens as budget allows, and returns them.
// When KV cannot hold them it undoes s's match (fresh: made for this
// admission) and returns false.
func (e *engine) admitRunning(i int, s *seq, fresh bool, budget int) (n int, ok bool) {
	n = min(s.numTokens()-s.numComputed, budget)
	need := e.blocksFor(s.numComputed+n) - len(s.blocks)
	if need > e.cache.free {
		e.unmatch(s, fresh)
		return 0, false
	}
	e.grow(s, need)
	if fresh && e.cache.cpu != nil && s.remote == nil {
		e.extStats(s) // the CPU tier was queried and missed
	}
	e.admitStats(s, !s.fromCPU)
	s.fromCPU = false
	e.removeWaiting(i)
	s.state = stRunning
	e.running = append(e.running, s)
	e.batch = append(e.batch, scheduled{s, n, n > 1})
	return n, true
}

// removeWaiting takes waiting sequence i out of the queue, keeping the
// others' order.
func (e *engine) removeWaiting(i int) {
	if i == 0 {
		e.waiting[0] = nil
		e.waiting = e.waiting[1:]
		return
	}
	e.waiting = slices.Delete(e.waiting, i, i+1)
}

// loraNames returns the adapters of seqs, each once, in order.
func loraNames(seqs []*seq) []string {
	var names []string
	for _, s := range seqs {
		if s.lora != "" && !slices.Contains(names, s.lora) {
			names = append(names, s.lora)
		}
	}
	return names
}

// grow allocates need more blocks to s (need may be ≤ 0).
func (e *engine) grow(s *seq, need int) {
	for range need {
		s.blocks = append(s.blocks, e.cache.alloc())
	}
}

// match pins the longest cached prefix of s: whole blocks, never the last
// token (vLLM always recomputes at least one token). With a CPU tier it
// also counts the blocks after the GPU hit that the tier holds (cpuBlocks),
// unless s pulls its KV from a prefill pod.
func (e *engine) match(s *seq) {
	limit := (s.numTokens() - 1) / e.cfg.BlockSize
	bs := e.cfg.BlockSize
	parent := s.root
	s.hashes = s.hashes[:0]
	s.cpuBlocks = 0
	toks := e.toks
	for i := range limit {
		for j := range bs {
			toks[j] = s.tokenAt(i*bs+j, e.vocab)
		}
		h := e.hash.block(parent, toks)
		b, ok := e.cache.lookup(h)
		if !ok {
			if e.cache.cpu != nil && s.remote == nil {
				s.cpuBlocks = e.cpuMatch(s, i, h, limit)
			}
			break
		}
		e.cache.acquire(b)
		s.blocks = append(s.blocks, b)
		s.hashes = append(s.hashes, h)
		parent = h
	}
	s.numComputed = len(s.blocks) * bs
}

// cpuMatch returns how many consecutive blocks of s from block i (whose
// hash is h) up to limit the CPU tier holds.
func (e *engine) cpuMatch(s *seq, i int, h uint64, limit int) int {
	bs := e.cfg.BlockSize
	n := 0
	for e.cache.cpu.lookup(h) {
		n++
		if i+n == limit {
			break
		}
		for j := range bs {
			e.toks[j] = s.tokenAt((i+n)*bs+j, e.vocab)
		}
		h = e.hash.block(h, e.toks)
	}
	return n
}

// unmatch undoes a match made in this scheduling attempt.
func (e *engine) unmatch(s *seq, fresh bool) {
	if !fresh {
		return
	}
	e.cache.releaseAll(s.blocks)
	s.blocks, s.hashes, s.numComputed, s.cpuBlocks = nil, s.hashes[:0], 0, 0
}

// prefixStats counts an admission's GPU prefix-cache lookup
// (vllm:prefix_cache_*).
func (e *engine) prefixStats(s *seq) {
	e.m.prefixQueries.Add(float64(s.numTokens()))
	e.m.prefixHits.Add(float64(s.numComputed))
}

// extStats counts a fresh admission's query of the CPU tier as vLLM counts
// a KV connector's (vllm:external_prefix_cache_*): the tokens the GPU did
// not hold, and those of them the tier holds.
func (e *engine) extStats(s *seq) {
	e.m.extQueries.Add(float64(s.numTokens() - s.numComputed))
	e.m.extHits.Add(float64(s.cpuBlocks * e.cfg.BlockSize))
}

// admitStats counts a sequence's admission: its prefix-cache lookup (unless
// lookup is false: a sequence back from a CPU load, whose lookup was
// counted when the load started, as vLLM counts none after an async load)
// and, the first time, its cached tokens and queue time.
func (e *engine) admitStats(s *seq, lookup bool) {
	if lookup {
		e.prefixStats(s)
	}
	if !s.admitted {
		s.admitted = true
		s.cached = s.numComputed
		e.m.queue.Observe((e.modelNow - s.arrival).Seconds())
	}
}

// preempt returns a running sequence to the front of the queue, freeing its
// blocks (their hashes stay cached, so the recompute mostly hits).
func (e *engine) preempt(s *seq) {
	e.cache.releaseAll(s.blocks)
	s.blocks, s.hashes, s.numComputed, s.fromCPU = nil, s.hashes[:0], 0, false
	s.state = stWaiting
	e.waiting = append([]*seq{s}, e.waiting...)
	e.m.preemptions.Inc()
}

// commit registers the hashes of blocks that became full and computed
// (prompt and generated tokens alike), records them as stored (one
// BlockStored per run of newly registered hashes, in chain order) and
// stores them in the CPU tier.
func (e *engine) commit(s *seq) {
	bs := e.cfg.BlockSize
	full := s.numComputed / bs
	first := len(s.hashes)
	if first >= full {
		return
	}
	parent := s.root
	if first > 0 {
		parent = s.hashes[first-1]
	}
	toks := e.toks
	run := -1 // index in e.ev.list of the BlockStored being filled
	for i := first; i < full; i++ {
		for j := range bs {
			toks[j] = s.tokenAt(i*bs+j, e.vocab)
		}
		h := e.hash.block(parent, toks)
		registered := e.cache.register(s.blocks[i], h)
		if e.ev != nil {
			switch {
			case !registered:
				run = -1 // another block holds h: announced already
			case run < 0:
				run = e.ev.stored(e.storedEvent(s, parent, i > 0))
				fallthrough
			default:
				ev := &e.ev.list[run]
				ev.hashes = append(ev.hashes, h)
				ev.tokens = append(ev.tokens, toks...)
			}
		}
		s.hashes = append(s.hashes, h)
		parent = h
	}
	if e.cache.cpu != nil {
		if n := e.cache.cpu.store(s.hashes[first:]); n > 0 {
			bytes := float64(n*bs) * e.cfg.KVBytesPerToken
			e.m.offloaded(gpuToCPU, bytes, e.cfg.CPUTransferCost(n*bs))
		}
	}
}

// storedEvent returns an empty BlockStored on the GPU for s's blocks after
// parent (a chain root when hasParent is false).
func (e *engine) storedEvent(s *seq, parent uint64, hasParent bool) kvEvent {
	ev := kvEvent{medium: mediumGPU, parent: parent, hasParent: hasParent}
	if s.lora != "" {
		// vLLM numbers --lora-modules from 1 (lora_int_id).
		ev.loraID, ev.lora = slices.Index(e.cfg.LoRAs, s.lora)+1, s.lora
	}
	return ev
}

// apply completes the step that ended at modelled time end: computed tokens
// advance, finished prompts and decodes sample a token. It returns the number
// of decoding sequences.
func (e *engine) apply(end time.Duration) (decodes int) {
	for _, b := range e.batch {
		s := b.s
		if s.state != stRunning {
			continue
		}
		if !b.prefill {
			decodes++
		}
		s.numComputed += b.n
		e.commit(s)
		if s.numComputed < s.numTokens() {
			continue // chunked prefill continues next step
		}
		g := s.generated
		s.generated++
		if g == 0 {
			e.m.ttft.Observe((end - s.arrival).Seconds())
			e.m.promptTokens.Add(float64(len(s.prompt)))
		} else {
			e.m.itl.Observe((end - s.lastToken).Seconds())
		}
		s.lastToken = end
		e.m.generationTokens.Inc()
		finish := ""
		switch {
		case !s.ignoreEOS && isEOS(s.seed, g, e.cfg.EOSProbability):
			finish = "stop"
		case s.generated >= s.maxTokens:
			finish = "length"
		}
		if finish != "" {
			e.finish(s, finish, end)
		}
		if finish != "" || s.req.stream && g%e.cfg.StreamInterval == 0 {
			e.notify = append(e.notify, s)
		}
	}
	out := e.running[:0]
	for _, s := range e.running {
		if s.state == stRunning {
			out = append(out, s)
		}
	}
	clear(e.running[len(out):])
	e.running = out
	return decodes
}

// deliver sends the answers of the step apply ended. Gauges first, so a
// client that got its answer sees them (and the step's OnStep) updated.
func (e *engine) deliver() {
	e.publishGauges()
	for i, s := range e.notify {
		e.publish(s)
		e.notify[i] = nil
	}
	e.notify = e.notify[:0]
}

// finish ends a sequence: its blocks are freed, or held for a remote decode
// pod when this is a prefill leg that stopped on its length limit. A
// bootstrap room whose prefill ends any other way closes.
func (e *engine) finish(s *seq, reason string, end time.Duration) {
	s.state, s.reason = stDone, reason
	e.m.success(reason).Inc()
	if reason != "abort" {
		e.m.e2e.Observe((end - s.arrival).Seconds())
	}
	r := s.req
	held := reason == "length" && len(s.blocks) > 0
	switch {
	case s.room != nil && held:
		h := e.hold(s, end)
		e.mu.Lock()
		h.room = s.room
		e.readyRoom(s.room, h)
		e.mu.Unlock()
	case s.room != nil:
		e.cache.releaseAll(s.blocks)
		e.mu.Lock()
		e.closeRoom(s.room, time.Now(), roomAborted)
		e.mu.Unlock()
	case r.holdKV && s.index == 0 && held:
		h := e.hold(s, end)
		e.mu.Lock()
		h.id = r.id + "-0"
		if _, taken := e.holds[h.id]; taken {
			e.holdCount++
			h.id += "." + strconv.FormatUint(e.holdCount, 10)
		}
		e.holds[h.id] = h
		e.mu.Unlock()
		r.mu.Lock()
		r.kv = h
		r.mu.Unlock()
	default:
		e.cache.releaseAll(s.blocks)
	}
	s.blocks = nil
}

// hold makes a hold of s's blocks, which a prefill step ending at end
// computed, and queues it for expiry; the caller publishes it.
func (e *engine) hold(s *seq, end time.Duration) *kvHold {
	h := &kvHold{
		blocks:   s.blocks,
		tokens:   len(s.prompt),
		deadline: e.wallOf(end + e.cfg.KVHoldTimeout),
	}
	e.holdQueue = append(e.holdQueue, h)
	e.nHeld.Add(int64(len(h.blocks)))
	return h
}

// publish copies s's progress to the HTTP side and wakes it.
func (e *engine) publish(s *seq) {
	r := s.req
	r.mu.Lock()
	if s.state == stDone && s.pub.finish == "" {
		r.doneSeqs++
	}
	s.pub = seqPub{generated: s.generated, finish: s.reason, cached: s.cached}
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// takeHold removes a hold for a pull from the side channel. It reports
// whether the hold existed and had not expired. Safe for concurrent use.
func (e *engine) takeHold(id string, now time.Time) (*kvHold, bool, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	h, ok := e.holds[id]
	if !ok {
		return nil, false, false
	}
	if !h.deadline.After(now) {
		return h, true, false // expired; the sweep releases it
	}
	h.done = true
	delete(e.holds, id)
	e.nHeld.Add(-int64(len(h.blocks)))
	return h, true, true
}

func (e *engine) publishGauges() {
	e.nRunning.Store(int64(len(e.running)))
	e.nWaiting.Store(int64(len(e.waiting) + e.loading))
	e.nUsed.Store(int64(e.cache.used()))
	if len(e.cfg.LoRAs) > 0 {
		info := loraInfo{running: strings.Join(loraNames(e.running), ","), waiting: strings.Join(loraNames(e.waiting), ",")}
		if old := e.loras.Load(); old == nil || old.running != info.running || old.waiting != info.waiting {
			info.at = float64(time.Now().UnixNano()) / 1e9
			e.loras.Store(&info)
		}
	}
}

// loraInfo is vllm:lora_requests_info's labels and value: the adapters of
// the running and the waiting requests (comma-separated), and when they
// last changed (Unix seconds).
type loraInfo struct {
	running, waiting string
	at               float64
}
