package app

import (
	"context"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/metrics"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/proxy"
)

// engineTruth joins the engines' KV-cache events to the prefix index: the
// subscriber's batches and resets go to prefix.Truth, the tokenizer links
// forwarded prompts to the events' tokens, and an endpoint whose events
// stop while it is sent requests falls back to learning. It is the
// subscriber's discovery.KVSink.
type engineTruth struct {
	truth      *prefix.Truth
	sub        *discovery.KVSubscriber
	tok        *proxy.Tokenizer
	pool       *discovery.Pool
	staleAfter time.Duration
	tiers      bool // apply CPU and storage tiers' events (Config.KVEventsTiers)
	logger     *zap.Logger

	mu   sync.Mutex
	seen map[uint64]uint64 // endpoint id → its requests at its last batch
}

func newEngineTruth(cfg *Config, pool *discovery.Pool, index *prefix.Index, logger *zap.Logger) *engineTruth {
	t := &engineTruth{pool: pool, staleAfter: cfg.KVEventsStaleAfter, tiers: cfg.KVEventsTiers, logger: logger.Named("kvevents"), seen: make(map[uint64]uint64),
		truth: prefix.NewTruth(index, prefix.TruthConfig{BlockBytes: cfg.PrefixBlockBytes})}
	t.tok = proxy.NewTokenizer(t.truth, proxy.TokenizerConfig{Rate: cfg.TokenizeRate})
	t.sub = discovery.NewKVSubscriber(discovery.KVEventsConfig{Port: cfg.KVEventsPort, ReplayPort: cfg.KVEventsReplayPort,
		Listen: cfg.KVEventsListen}, pool, t, logger)
	return t
}

// KVBatch applies one endpoint's batch of events.
func (t *engineTruth) KVBatch(e *discovery.Endpoint, b *discovery.KVBatch) {
	for i := range b.Events {
		ev := &b.Events[i]
		if ev.Tier != discovery.TierGPU && !t.tiers {
			continue
		}
		switch ev.Kind {
		case discovery.KVBlockStored:
			t.truth.Stored(e.ID, ev.Parent, ev.HasParent, ev.BlockHashes, ev.TokenIDs, ev.BlockSize, ev.LoRA, uint8(ev.Tier))
		case discovery.KVBlockRemoved:
			t.truth.Removed(e.ID, ev.BlockHashes, uint8(ev.Tier))
		case discovery.KVAllCleared:
			t.truth.Cleared(e.ID)
		}
	}
	t.mu.Lock()
	t.seen[e.ID] = e.Requests()
	t.mu.Unlock()
}

// KVReset: a restarted engine holds nothing; events lost otherwise leave
// what it holds unknown, and the endpoint learns again.
func (t *engineTruth) KVReset(e *discovery.Endpoint, cause string) {
	if cause == discovery.KVResetRestart {
		t.truth.Cleared(e.ID)
		return
	}
	t.truth.Drop(e.ID)
	t.mu.Lock()
	delete(t.seen, e.ID)
	t.mu.Unlock()
}

// run runs the subscriber, the tokenizer and the staleness check until
// ctx is done.
func (t *engineTruth) run(ctx context.Context) {
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
func (t *engineTruth) checkStale(now time.Time) {
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

// sample reads the metrics' view of engine truth.
func (t *engineTruth) sample() metrics.KVEventsSample {
	st, ts, tk := t.sub.Stats(), t.truth.Stats(), t.tok.Stats()
	s := metrics.KVEventsSample{
		Events:  map[string]uint64{"stored": st.Stored, "removed": st.Removed, "cleared": st.Cleared},
		Batches: st.Batches, DecodeErrors: st.DecodeErrors, Gaps: st.Gaps, Replayed: st.Replayed,
		Resets:          map[string]uint64{"restart": st.Resets[discovery.KVResetRestart], "gap": st.Resets[discovery.KVResetGap], "lost": st.Resets[discovery.KVResetLost]},
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

// endpointTruth is /debug/endpoints' view of one endpoint's engine truth.
type endpointTruth struct {
	// Source is "events" while the endpoint's engine truth is live,
	// "learned" otherwise.
	Source string `json:"source"`
	// LastEvent is when its last event was applied.
	LastEvent *time.Time         `json:"last_event,omitempty"`
	Stream    discovery.KVStatus `json:"stream"`
}

func (t *engineTruth) status(e *discovery.Endpoint) endpointTruth {
	live, last := t.truth.Live(e.ID)
	out := endpointTruth{Source: "learned", Stream: t.sub.Status(e)}
	if live {
		out.Source = "events"
	}
	if !last.IsZero() {
		out.LastEvent = &last
	}
	return out
}
