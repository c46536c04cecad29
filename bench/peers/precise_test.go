package peers

import (
	"encoding/json"
	"net"
	"testing"

	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/kvevents"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// preciseModel is the simulated fleet's model name.
const preciseModel = "m"

// startPreciseFleet starts n simulated pods, closed when the test ends.
func startPreciseFleet(t *testing.T, n int) *sim.Fleet {
	t.Helper()
	f, err := sim.StartFleet(n, sim.Config{Model: preciseModel, TimeScale: 100})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return f
}

// preciseSet publishes an endpoint per URL (new Endpoints, so no scrape
// of another test's carries over).
func preciseSet(t *testing.T, urls ...string) *discovery.Set {
	t.Helper()
	var eps []*discovery.Endpoint
	for _, u := range urls {
		e, err := discovery.NewEndpoint(u, discovery.RoleMixed)
		if err != nil {
			t.Fatal(err)
		}
		eps = append(eps, e)
	}
	var pool discovery.Pool
	return pool.Publish(eps)
}

// completion is a /v1/completions request for text, as the proxy hands it
// to a policy.
func completion(t *testing.T, model, text string) *routing.Request {
	t.Helper()
	body, err := json.Marshal(map[string]any{"model": model, "prompt": text, "max_tokens": 1})
	if err != nil {
		t.Fatal(err)
	}
	return &routing.Request{Kind: routing.KindCompletions, Model: model, Body: body,
		PromptBytes: len(text), PromptTokens: len(text) / 4}
}

// simTokens is the simulated engine's tokenization of a completion prompt.
func simTokens(text string) []uint32 { return sim.Tokenize(text, sim.DefaultConfig().VocabSize) }

// preciseText is a 200-token prompt: 12 whole blocks of 16 and 8 tokens.
var preciseText = sim.SyntheticText(200, 7)

// storedBatch announces blocks hashes (in chain order) of tokens, 16 per
// block, on tier; parent is the engine hash of the block before (0: a
// chain's root).
func storedBatch(hashes []uint64, parent uint64, tokens []uint32, tier kvevents.Tier, lora string) *kvevents.Batch {
	return &kvevents.Batch{Events: []kvevents.Event{{Kind: kvevents.BlockStored, BlockHashes: hashes,
		Parent: parent, HasParent: parent != 0, TokenIDs: tokens, BlockSize: 16, Tier: tier, LoRA: lora}}}
}

func removedBatch(tier kvevents.Tier, hashes ...uint64) *kvevents.Batch {
	return &kvevents.Batch{Events: []kvevents.Event{{Kind: kvevents.BlockRemoved, BlockHashes: hashes, Tier: tier}}}
}

// engineHashes returns n engine block hashes from..from+n-1.
func engineHashes(from, n int) []uint64 {
	hs := make([]uint64, n)
	for i := range hs {
		hs[i] = uint64(from + i)
	}
	return hs
}

// load sets each endpoint's scraped waiting queue and KV usage; a nil
// entry leaves the endpoint unscraped.
type load struct {
	waiting int64
	kv      float64
}

func setLoad(set *discovery.Set, loads []*load) {
	for i, l := range loads {
		if l != nil {
			set.Serving[i].SetEngine(&discovery.EngineStats{Engine: "vllm", Waiting: l.waiting, KVUsage: l.kv})
		}
	}
}

// The prefix an engine announced wins over load, by the share of its
// blocks still held from the first; once its first block is gone, load
// decides again.
func TestPreciseRoutesToTheEventsHolder(t *testing.T) {
	f := startPreciseFleet(t, 3)
	set := preciseSet(t, f.URLs()...)
	// Without the prefix: 0.5, 1.9 and 1.2 of load scores.
	setLoad(set, []*load{{waiting: 4, kv: 0.5}, {waiting: 0, kv: 0.1}, {waiting: 2, kv: 0.3}})
	p := NewPrecise(1)
	tokens := simTokens(preciseText)
	if len(tokens) != 200 {
		t.Fatalf("the prompt is %d tokens, want 200", len(tokens))
	}
	holder, other := set.Serving[2], set.Serving[1]
	steps := []struct {
		name        string
		batch       *kvevents.Batch
		want        *discovery.Endpoint
		wantMatched int
	}{
		{name: "no events: load", want: other},
		// 2 + 1.2 against 1.9.
		{name: "all 12 blocks stored", batch: storedBatch(engineHashes(1, 12), 0, tokens[:192], kvevents.TierGPU, ""),
			want: holder, wantMatched: 12},
		// 2 × 11/12 + 1.2 against 1.9.
		{name: "the last block removed", batch: removedBatch(kvevents.TierGPU, 12), want: holder, wantMatched: 11},
		{name: "the first block removed", batch: removedBatch(kvevents.TierGPU, 1), want: other},
		{name: "the first block back", batch: storedBatch(engineHashes(1, 1), 0, tokens[:16], kvevents.TierGPU, ""),
			want: holder, wantMatched: 11},
		{name: "cleared", batch: &kvevents.Batch{Events: []kvevents.Event{{Kind: kvevents.AllCleared}}}, want: other},
	}
	for _, s := range steps {
		if s.batch != nil {
			p.KVBatch(holder, s.batch)
		}
		d := p.Pick(completion(t, preciseModel, preciseText), set)
		if d.Endpoint != s.want || d.MatchedBlocks != s.wantMatched || d.Reason != ReasonPrecise {
			t.Fatalf("%s: %s (%s) matched %d blocks, want %s matching %d", s.name, d.Endpoint, d.Reason,
				d.MatchedBlocks, s.want, s.wantMatched)
		}
		if d.PromptTokens != 200 || d.Prefill != 200-16*s.wantMatched {
			t.Fatalf("%s: %d prompt tokens, %d to prefill; want 200 and %d", s.name, d.PromptTokens, d.Prefill, 200-16*s.wantMatched)
		}
	}
}

// With no prefix held anywhere, the queue and KV scorers decide, and a pod
// never scraped gets neither.
func TestPreciseLoadScores(t *testing.T) {
	f := startPreciseFleet(t, 3)
	for _, tc := range []struct {
		name  string
		loads []*load
		want  int
	}{
		// 0.8, 1 + 0.8, 1 + 0.4.
		{name: "queue decides", loads: []*load{{waiting: 3, kv: 0.2}, {waiting: 1, kv: 0.2}, {waiting: 1, kv: 0.6}}, want: 1},
		{name: "KV usage decides equal queues", loads: []*load{{waiting: 2, kv: 0.5}, {waiting: 2, kv: 0.4}, {waiting: 2, kv: 0.2}}, want: 2},
		// 0, 1 + 0.1, 1 + 0.05.
		{name: "an unscraped pod scores no load", loads: []*load{nil, {waiting: 5, kv: 0.9}, {waiting: 5, kv: 0.95}}, want: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := preciseSet(t, f.URLs()...)
			setLoad(set, tc.loads)
			p := NewPrecise(1)
			// Another prompt's blocks do not count.
			p.KVBatch(set.Serving[0], storedBatch(engineHashes(1, 2), 0, simTokens(sim.SyntheticText(32, 99)), kvevents.TierGPU, ""))
			d := p.Pick(completion(t, preciseModel, preciseText), set)
			if d.Endpoint != set.Serving[tc.want] || d.MatchedBlocks != 0 {
				t.Fatalf("%s matching %d blocks, want %s", d.Endpoint, d.MatchedBlocks, set.Serving[tc.want])
			}
		})
	}
}

// Equal scores go to a seeded random one of the tied pods.
func TestPreciseTiesAreSeeded(t *testing.T) {
	f := startPreciseFleet(t, 3)
	set := preciseSet(t, f.URLs()...)
	r := completion(t, preciseModel, preciseText)
	draw := func() []*discovery.Endpoint {
		p := NewPrecise(42)
		var out []*discovery.Endpoint
		for range 30 {
			out = append(out, p.Pick(r, set).Endpoint)
		}
		return out
	}
	a, b := draw(), draw()
	per := map[*discovery.Endpoint]int{}
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("seeded draws differ at %d", i)
		}
		per[a[i]]++
	}
	if len(per) != 3 {
		t.Fatalf("30 tied picks went to %d of 3 pods", len(per))
	}
}

// A request that cannot be tokenized scores no prefix: it is still routed,
// by load, and the prompt length is the proxy's estimate.
func TestPreciseTokenizeFailure(t *testing.T) {
	f := startPreciseFleet(t, 2)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + ln.Addr().String()
	_ = ln.Close()
	good := completion(t, preciseModel, preciseText)
	badJSON := completion(t, preciseModel, preciseText)
	badJSON.Body = badJSON.Body[:len(badJSON.Body)-1]
	other := completion(t, preciseModel, preciseText)
	other.Kind = routing.KindEmbeddings
	noBody := completion(t, preciseModel, preciseText)
	noBody.Body = nil
	for _, tc := range []struct {
		name string
		urls []string
		r    *routing.Request
	}{
		{name: "the tokenizing pod is down", urls: []string{dead, f.URL(0), f.URL(1)}, r: good},
		{name: "the engine rejects the body", urls: f.URLs(), r: badJSON},
		{name: "not a completions or chat request", urls: f.URLs(), r: other},
		{name: "no body", urls: f.URLs(), r: noBody},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := preciseSet(t, tc.urls...)
			p := NewPrecise(1)
			holder := set.Serving[len(set.Serving)-1]
			p.KVBatch(holder, storedBatch(engineHashes(1, 12), 0, simTokens(preciseText)[:192], kvevents.TierGPU, ""))
			d := p.Pick(tc.r, set)
			if d.Endpoint == nil || d.MatchedBlocks != 0 || d.PromptTokens != tc.r.PromptTokens || d.Prefill != tc.r.PromptTokens {
				t.Fatalf("decision %+v, want an endpoint, no match and the estimated %d tokens", d, tc.r.PromptTokens)
			}
		})
	}
}

// A body tokenized once is not asked again: the pick survives the pods
// going away.
func TestPreciseCachesTokenizations(t *testing.T) {
	f := startPreciseFleet(t, 2)
	set := preciseSet(t, f.URLs()...)
	p := NewPrecise(1)
	p.KVBatch(set.Serving[1], storedBatch(engineHashes(1, 12), 0, simTokens(preciseText)[:192], kvevents.TierGPU, ""))
	r := completion(t, preciseModel, preciseText)
	if d := p.Pick(r, set); d.Endpoint != set.Serving[1] || d.MatchedBlocks != 12 {
		t.Fatalf("%s matching %d, want %s matching 12", d.Endpoint, d.MatchedBlocks, set.Serving[1])
	}
	_ = f.Close()
	if d := p.Pick(r, set); d.Endpoint != set.Serving[1] || d.MatchedBlocks != 12 {
		t.Fatalf("after the pods closed: %s matching %d, want the cached tokens' match", d.Endpoint, d.MatchedBlocks)
	}
	if d := p.Pick(completion(t, preciseModel, preciseText+" more"), set); d.MatchedBlocks != 0 {
		t.Fatalf("a new body matched %d blocks with no tokenizer", d.MatchedBlocks)
	}
}

// A chat body is tokenized through the engine's chat template, and an
// adapter's blocks count only for requests naming the adapter.
func TestPreciseChatAndAdapters(t *testing.T) {
	f := startPreciseFleet(t, 2)
	set := preciseSet(t, f.URLs()...)
	parent := preciseModel
	for _, e := range set.Serving {
		e.SetModels([]discovery.Model{{ID: preciseModel}, {ID: "ad", Parent: &parent}})
	}
	p := NewPrecise(1)
	body, _ := json.Marshal(map[string]any{"model": preciseModel, "messages": []map[string]string{{"role": "user", "content": preciseText}}})
	chat := &routing.Request{Kind: routing.KindChat, Model: preciseModel, Body: body, PromptTokens: 50}
	tokens, err := p.fetchTokens(set.Serving[0], body)
	if err != nil || len(tokens) < 200 {
		t.Fatalf("tokenizing the chat body: %d tokens, %v", len(tokens), err)
	}
	n := len(tokens) / 16
	p.KVBatch(set.Serving[1], storedBatch(engineHashes(1, n), 0, tokens[:16*n], kvevents.TierGPU, ""))
	if d := p.Pick(chat, set); d.Endpoint != set.Serving[1] || d.MatchedBlocks != n {
		t.Fatalf("chat: %s matching %d, want %s matching %d", d.Endpoint, d.MatchedBlocks, set.Serving[1], n)
	}

	text := simTokens(preciseText)[:192]
	p.KVBatch(set.Serving[0], storedBatch(engineHashes(100, 12), 0, text, kvevents.TierGPU, "ad"))
	if d := p.Pick(completion(t, "ad", preciseText), set); d.Endpoint != set.Serving[0] || d.MatchedBlocks != 12 {
		t.Fatalf("adapter: %s matching %d, want %s matching 12", d.Endpoint, d.MatchedBlocks, set.Serving[0])
	}
	if d := p.Pick(completion(t, preciseModel, preciseText), set); d.MatchedBlocks != 0 {
		t.Fatalf("the base model matched %d of the adapter's blocks on %s", d.MatchedBlocks, d.Endpoint)
	}
}

// keysOf chains tokens' whole 16-token blocks as Precise does.
func keysOf(tokens []uint32, lora string) []uint64 {
	var keys []uint64
	key := prefix.TokenRoot(lora)
	for i := 0; i+16 <= len(tokens); i += 16 {
		key = prefix.TokenKey(key, tokens[i:i+16])
		keys = append(keys, key)
	}
	return keys
}

// The events build each endpoint's view as llm-d's event pool does:
// chained stores, tier copies and removals, dropped orphans, clears and
// resets.
func TestPreciseEvents(t *testing.T) {
	set := testSet(t, 1)
	e := set.Serving[0]
	p := NewPrecise(1)
	tokens := simTokens(preciseText)[:192]
	keys := keysOf(tokens, "")
	check := func(step string, wantBlocks int, wantWeight float64) {
		t.Helper()
		p.mu.Lock()
		blocks, w := p.views[e.ID].match(keys)
		p.mu.Unlock()
		if blocks != wantBlocks || w < wantWeight-1e-9 || w > wantWeight+1e-9 {
			t.Fatalf("%s: %d blocks weighing %g, want %d weighing %g", step, blocks, w, wantBlocks, wantWeight)
		}
	}
	p.KVBatch(e, storedBatch(engineHashes(1, 6), 0, tokens[:96], kvevents.TierGPU, ""))
	p.KVBatch(e, storedBatch(engineHashes(7, 6), 6, tokens[96:], kvevents.TierGPU, ""))
	check("two chained stores", 12, 12)
	p.KVBatch(e, storedBatch(engineHashes(1, 12), 0, nil, kvevents.TierCPU, ""))
	p.KVBatch(e, removedBatch(kvevents.TierGPU, 4))
	check("block 4 on the CPU only", 12, 11.8)
	p.KVBatch(e, removedBatch(kvevents.TierCPU, 4))
	check("block 4 gone", 3, 3)
	p.KVBatch(e, storedBatch(engineHashes(4, 1), 999, tokens[48:64], kvevents.TierGPU, ""))
	check("a store after an unknown parent is dropped", 3, 3)
	p.KVBatch(e, storedBatch(engineHashes(4, 1), 3, tokens[48:64], kvevents.TierGPU, ""))
	check("block 4 back after its parent", 12, 12)
	p.KVBatch(e, &kvevents.Batch{Events: []kvevents.Event{{Kind: kvevents.AllCleared}}})
	check("cleared", 0, 0)
	for _, cause := range []string{kvevents.ResetRestart, kvevents.ResetGap, kvevents.ResetLost} {
		p.KVBatch(e, storedBatch(engineHashes(1, 12), 0, tokens, kvevents.TierGPU, ""))
		check("stored again", 12, 12)
		p.KVReset(e, cause)
		check("reset: "+cause, 0, 0)
	}
	p.KVBatch(e, storedBatch(engineHashes(1, 12), 0, tokens[:100], kvevents.TierGPU, ""))
	check("tokens not lining up with the blocks", 0, 0)
}

// The tokenization cache keeps at most two generations of its half size,
// a hit in the older one moving the entry to the newer.
func TestPreciseTokenCacheBound(t *testing.T) {
	c := newTokenCache(20) // 10 tokens a generation
	four := make([]uint32, 4)
	c.put(1, four)
	c.put(2, four)
	c.put(3, four) // 12 > 10: 1 and 2 move to old
	if _, ok := c.get(1); !ok {
		t.Fatal("entry 1 lost at the first rotation")
	}
	c.put(4, four) // cur holds 3 and 1 (8 tokens): 4 rotates; old = {3, 1}, 2 dropped
	if _, ok := c.get(2); ok {
		t.Fatal("entry 2 survived two rotations")
	}
	for _, h := range []uint64{1, 3, 4} {
		if _, ok := c.get(h); !ok {
			t.Fatalf("entry %d lost", h)
		}
	}
	c.put(5, make([]uint32, 11)) // bigger than a generation: not kept
	if _, ok := c.get(5); ok {
		t.Fatal("an entry bigger than a generation was kept")
	}
}
