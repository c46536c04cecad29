package kvevents

import (
	"context"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/metrics"
	"github.com/kvroute/kvroute/prefix"
)

// EngineTruthConfig configures an EngineTruth.
type EngineTruthConfig struct {
	// Events configures the subscriber (the --kv-events-* flags).
	Events Config
	// BlockBytes is the prefix index's block size in bytes
	// (prefix.TruthConfig.BlockBytes).
	BlockBytes int
	// Tokenizer configures the tokenizer (Rate: --tokenize-rate).
	Tokenizer TokenizerConfig
	// StaleAfter is how long an endpoint's events may stop while it is
	// sent requests before it falls back to learning; 0: never.
	StaleAfter time.Duration
	// Tiers applies CPU and storage tiers' events; false: GPU blocks only.
	Tiers bool
}

// EngineTruth joins the engines' KV-cache events to the prefix index: the
// subscriber's batches and resets go to prefix.Truth, the tokenizer links
// forwarded prompts to the events' tokens, and an endpoint whose events
// stop while it is sent requests falls back to learning. It is the
// subscriber's Sink. NewEngineTruth starts nothing; Run does the work.
// Its methods are safe for concurrent use.
type EngineTruth struct {
	truth      *prefix.Truth
	sub        *Subscriber
	tok        *Tokenizer
	pool       *discovery.Pool
	staleAfter time.Duration
	tiers      bool // apply CPU and storage tiers' events (EngineTruthConfig.Tiers)
	logger     *zap.Logger

	mu   sync.Mutex
	seen map[uint64]uint64 // endpoint id → its requests at its last batch
}

// NewEngineTruth returns engine truth for pool's endpoints over index. A
// nil logger logs nothing.
func NewEngineTruth(c EngineTruthConfig, pool *discovery.Pool, index *prefix.Index, logger *zap.Logger) *EngineTruth {
	if logger == nil {
		logger = zap.NewNop()
	}
	t := &EngineTruth{pool: pool, staleAfter: c.StaleAfter, tiers: c.Tiers, logger: logger.Named("kvevents"), seen: make(map[uint64]uint64),
		truth: prefix.NewTruth(index, prefix.TruthConfig{BlockBytes: c.BlockBytes})}
	t.tok = NewTokenizer(t.truth, c.Tokenizer)
	t.sub = NewSubscriber(c.Events, pool, t, logger)
	return t
}

// Tokenizer returns the tokenizer the request path offers its forwarded
// prompts to (proxy.Options.Tokenizer); Run runs it.
func (t *EngineTruth) Tokenizer() *Tokenizer { return t.tok }

// OnLinked sets f to be told the links the tokenizer learns
// (prefix.Truth's OnLinked): the router replicas' gossip sends them.
func (t *EngineTruth) OnLinked(f func(blocks, tokens []uint64)) { t.truth.OnLinked(f) }

// PeerLinked takes a router replica's links (prefix.Truth's PeerLinked).
func (t *EngineTruth) PeerLinked(blocks, tokens []uint64) { t.truth.PeerLinked(blocks, tokens) }

// KVBatch applies one endpoint's batch of events.
func (t *EngineTruth) KVBatch(e *discovery.Endpoint, b *Batch) {
	for i := range b.Events {
		ev := &b.Events[i]
		if ev.Tier != TierGPU && !t.tiers {
			continue
		}
		switch ev.Kind {
		case BlockStored:
			t.truth.Stored(e.ID, ev.Parent, ev.HasParent, ev.BlockHashes, ev.TokenIDs, ev.BlockSize, ev.LoRA, uint8(ev.Tier))
		case BlockRemoved:
			t.truth.Removed(e.ID, ev.BlockHashes, uint8(ev.Tier))
		case AllCleared:
			t.truth.Cleared(e.ID)
		}
	}
	t.mu.Lock()
	t.seen[e.ID] = e.Requests()
	t.mu.Unlock()
}

// KVReset: a restarted engine holds nothing; events lost otherwise leave
// what it holds unknown, and the endpoint learns again.
func (t *EngineTruth) KVReset(e *discovery.Endpoint, cause string) {
	if cause == ResetRestart {
		t.truth.Cleared(e.ID)
		return
	}
	t.truth.Drop(e.ID)
	t.mu.Lock()
	delete(t.seen, e.ID)
	t.mu.Unlock()
}

// Run runs the subscriber, the tokenizer and the staleness check until
// ctx is done. It may be called once.
func (t *EngineTruth) Run(ctx context.Context) {
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		if err := t.sub.Run(ctx); err != nil && ctx.Err() == nil {
			t.logger.Error("KV-event subscriber stopped", zap.Error(err))
		}
	}()
	go func() { defer wg.Done(); t.tok.Run(ctx) }()
	defer wg.Wait()
	if t.staleAfter <= 0 {
		<-ctx.Done()
		return
	}
	tick := time.NewTicker(min(time.Second, t.staleAfter/2))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick.C:
			t.checkStale(now)
		}
	}
}

// checkStale falls back to learning for every endpoint on engine truth
// that was sent requests since its last batch, staleAfter ago or more.
func (t *EngineTruth) checkStale(now time.Time) {
	for _, e := range t.pool.Load().Endpoints {
		live, last := t.truth.Live(e.ID)
		if !live || now.Sub(last) < t.staleAfter {
			continue
		}
		t.mu.Lock()
		seen, ok := t.seen[e.ID]
		t.mu.Unlock()
		if ok && e.Requests() > seen {
			t.truth.Stale(e.ID)
			t.logger.Info("KV events stale: learning the endpoint's cache from routing until they resume",
				zap.String("endpoint", e.URL), zap.Duration("silent", now.Sub(last)))
		}
	}
}

// Sample reads the metrics' view of engine truth (for
// metrics.RegisterKVEvents).
func (t *EngineTruth) Sample() metrics.KVEventsSample {
	st, ts, tk := t.sub.Stats(), t.truth.Stats(), t.tok.Stats()
	s := metrics.KVEventsSample{
		Events:  map[string]uint64{"stored": st.Stored, "removed": st.Removed, "cleared": st.Cleared},
		Batches: st.Batches, DecodeErrors: st.DecodeErrors, Gaps: st.Gaps, Replayed: st.Replayed,
		Resets:          map[string]uint64{"restart": st.Resets[ResetRestart], "gap": st.Resets[ResetGap], "lost": st.Resets[ResetLost]},
		UnmatchedTopics: st.Unmatched, Blocks: ts.Blocks, Links: ts.Links, Bytes: ts.Bytes,
		Confirmed: ts.Confirmed, Dropped: ts.Dropped, Orphans: ts.Orphans,
		Tokenized: tk.OK, TokenizeFail: tk.Failed, TokenizeDropped: tk.Dropped,
		Sources: make(map[string]bool),
	}
	for _, e := range t.pool.Load().Endpoints {
		s.Sources[e.URL], _ = t.truth.Live(e.ID)
	}
	return s
}

// EndpointTruth is /debug/endpoints' view of one endpoint's engine truth.
type EndpointTruth struct {
	// Source is "events" while the endpoint's engine truth is live,
	// "learned" otherwise.
	Source string `json:"source"`
	// LastEvent is when its last event was applied.
	LastEvent *time.Time   `json:"last_event,omitempty"`
	Stream    StreamStatus `json:"stream"`
}

// Status returns e's engine truth and event stream.
func (t *EngineTruth) Status(e *discovery.Endpoint) EndpointTruth {
	live, last := t.truth.Live(e.ID)
	out := EndpointTruth{Source: "learned", Stream: t.sub.Status(e)}
	if live {
		out.Source = "events"
	}
	if !last.IsZero() {
		out.LastEvent = &last
	}
	return out
}
