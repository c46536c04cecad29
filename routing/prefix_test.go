package routing

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/prefix"
)

const testBlock = 1024

func testSet(t testing.TB, n int) *discovery.Set {
	t.Helper()
	var pool discovery.Pool
	eps := make([]*discovery.Endpoint, n)
	for i := range eps {
		e, err := discovery.NewEndpoint(fmt.Sprintf("http://10.0.0.%d:8000", i+1), discovery.RoleMixed)
		if err != nil {
			t.Fatal(err)
		}
		eps[i] = e
	}
	return pool.Publish(eps)
}

func newTestPrefix(p PrefixParams) *Prefix {
	return NewPrefix(prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: 100_000}), testBlock, p)
}

// request renders text like the proxy does and hashes it.
func request(text string) *Request {
	var h prefix.Hasher
	h.Reset(testBlock, 1024, prefix.Seed("m", ""))
	_, _ = h.WriteString(text)
	return &Request{Kind: KindCompletions, Model: "m", PromptBytes: len(text), PromptTokens: len(text) / 4, Hashes: h.Hashes}
}

// system returns a system prompt of n bytes, distinct per id.
func system(id, n int) string {
	s := strings.Repeat(fmt.Sprintf("[system prompt %d] ", id), n/10+1)
	return s[:n]
}

// A prompt warm nowhere records its whole chain at the pick: a request
// with the same prefix that follows before the first is answered sees all
// of it held there (and the prefill still running), not one block.
func TestNewPromptRecordedWholeAtThePick(t *testing.T) {
	set := testSet(t, 8)
	p := newTestPrefix(DefaultPrefixParams())
	long := request(system(7, 16*testBlock))
	d := p.Pick(long, set)
	if m := p.Index().Match(long.Hashes, nil); len(m) != 1 || m[0].Blocks != 16 || m[0].ID != d.Endpoint.ID {
		t.Fatalf("after a new 16-block prompt's pick the index holds %+v, want its 16 blocks on %s", m, d.Endpoint)
	}
	f := p.Pick(request(system(7, 16*testBlock)+"b"), set)
	if f.Endpoint != d.Endpoint || f.Reason != ReasonWarm || f.MatchedBlocks != 16 {
		t.Fatalf("the same prefix picked while the first is unanswered: %+v, want warm (16 blocks) on %s", f, d.Endpoint)
	}
}

// OnPlaced is told each pick's endpoint and whole chain after the index
// recorded it (the replicas' gossip); Explain tells it nothing. Another
// policy's index merging what it was told sees the prompt warm there.
func TestOnPlaced(t *testing.T) {
	set := testSet(t, 4)
	p, other := newTestPrefix(DefaultPrefixParams()), newTestPrefix(DefaultPrefixParams())
	var got []uint64
	var at uint64
	p.OnPlaced(func(id uint64, hashes []uint64) {
		at, got = id, append(got[:0], hashes...)
		other.Index().Record(id, hashes)
	})
	r := request(system(3, 8*testBlock))
	p.Explain(r, set)
	if got != nil {
		t.Fatal("Explain told the hook")
	}
	d := p.Pick(r, set)
	if at != d.Endpoint.ID || len(got) != len(r.Hashes) || got[7] != r.Hashes[7] {
		t.Fatalf("hook told %x with %d hashes, want %s with %d", at, len(got), d.Endpoint, len(r.Hashes))
	}
	if f := other.Pick(request(system(3, 8*testBlock)+"?"), set); f.Endpoint != d.Endpoint || f.Reason != ReasonWarm {
		t.Fatalf("the merging policy picked %+v, want warm on %s", f, d.Endpoint)
	}
}

// dispatch picks for r and leases the endpoint as the proxy does; the
// caller releases the lease.
func dispatch(p *Prefix, r *Request, set *discovery.Set) (Decision, discovery.Lease) {
	d := p.Pick(r, set)
	var l discovery.Lease
	if d.Endpoint != nil {
		l = d.Endpoint.Acquire(d.Prefill)
	}
	return d, l
}

// occupy loads e with n requests in flight and prefill pending tokens, as
// leases would; the returned function releases them.
func occupy(e *discovery.Endpoint, n, prefill int) (release func()) {
	leases := make([]discovery.Lease, n)
	for i := range leases {
		p := 0
		if i == 0 {
			p = prefill
		}
		leases[i] = e.Acquire(p)
	}
	return func() {
		for i := range leases {
			leases[i].Release()
		}
	}
}

func TestSameprefixGoesWhereItIsCached(t *testing.T) {
	set := testSet(t, 8)
	p := newTestPrefix(DefaultPrefixParams())
	sys := system(1, 8192)
	first := p.Pick(request(sys+"question one"), set)
	if first.Reason != ReasonCold {
		t.Fatalf("first request: %+v", first)
	}
	for i := 0; i < 20; i++ {
		d := p.Pick(request(sys+fmt.Sprintf("question %d", i)), set)
		if d.Endpoint != first.Endpoint || d.Reason != ReasonWarm || d.MatchedBlocks != 8192/testBlock {
			t.Fatalf("request %d: %+v, want warm on %s", i, d, first.Endpoint)
		}
		if d.Prefill >= 100 {
			t.Fatalf("prefill %d tokens for a cached prefix", d.Prefill)
		}
	}
}

// Failure mode: bursts herd onto one pod when load is counted after the
// pick. Here load is counted at the pick, so a burst of one prefix stays on
// the warm pod only until waiting there costs more than recomputing.
func TestBurstSpillsInsteadOfHerding(t *testing.T) {
	set := testSet(t, 8)
	p := newTestPrefix(DefaultPrefixParams())
	sys := system(2, 16384) // 4k tokens: 0.2 s to recompute
	counts := map[*discovery.Endpoint]int{}
	reasons := map[string]int{}
	for i := 0; i < 200; i++ {
		d, _ := dispatch(p, request(sys+fmt.Sprintf("q%d", i)), set) // the burst stays in flight
		counts[d.Endpoint]++
		reasons[d.Reason]++
	}
	if len(counts) < 4 || reasons[ReasonSpill] == 0 {
		t.Fatalf("a burst of 200 herded: %d endpoints used, reasons %v", len(counts), reasons)
	}
	for e, n := range counts {
		if n > 100 {
			t.Fatalf("%s took %d of 200", e, n)
		}
	}
	// After a spill the prefix is warm on several pods, so most picks hit.
	if reasons[ReasonWarm] < 150 {
		t.Fatalf("reasons %v: the spilled prefix should stay warm", reasons)
	}
}

// Failure mode: one short shared system prompt pins the fleet to one pod.
// A one-block prefix is warm where it is cached, but under a steady load
// (here 32 requests in flight) it spreads, and once every pod holds it the
// load decides.
func TestShortSharedPrefixDoesNotPin(t *testing.T) {
	set := testSet(t, 8)
	p := newTestPrefix(DefaultPrefixParams())
	shared := system(3, testBlock) // one block
	counts := map[*discovery.Endpoint]int{}
	var inFlight []discovery.Lease
	for i := 0; i < 400; i++ {
		r := request(shared + system(1000+i, 4096))
		d, l := dispatch(p, r, set)
		counts[d.Endpoint]++
		if inFlight = append(inFlight, l); len(inFlight) > 32 {
			inFlight[0].Release()
			inFlight = inFlight[1:]
		}
	}
	for _, l := range inFlight {
		l.Release()
	}
	for e, n := range counts {
		if n < 20 || n > 80 { // 50 expected each
			t.Fatalf("uneven spread: %s got %d of 400 (%d endpoints used)", e, n, len(counts))
		}
	}
	if len(counts) != 8 {
		t.Fatalf("%d endpoints used", len(counts))
	}
}

// Failure mode: under load the policy flips from affinity to least-load for
// everything and the hit rate collapses. Here only the saturated prefix
// spills; other prefixes stay where they are cached.
func TestLoadOnOnePodDoesNotCollapseAffinity(t *testing.T) {
	set := testSet(t, 4)
	p := newTestPrefix(DefaultPrefixParams())
	a, b := system(10, 8192), system(11, 8192)
	da := p.Pick(request(a+"x"), set)
	db := p.Pick(request(b+"x"), set)
	if da.Endpoint == db.Endpoint {
		// Force distinct homes for the test by recording b elsewhere.
		for _, e := range set.Endpoints {
			if e != da.Endpoint {
				p.Index().Forget(db.Endpoint.ID)
				p.Index().Record(e.ID, request(b+"x").Hashes)
				db.Endpoint = e
				break
			}
		}
	}
	defer occupy(da.Endpoint, 200, 100_000)() // a's home is saturated
	if d := p.Pick(request(a+"y"), set); d.Reason != ReasonSpill || d.Endpoint == da.Endpoint {
		t.Fatalf("saturated prefix did not spill: %+v", d)
	}
	if d := p.Pick(request(b+"y"), set); d.Reason != ReasonWarm || d.Endpoint != db.Endpoint {
		t.Fatalf("an unrelated prefix lost its affinity: %+v", d)
	}
}

// Failure mode: tie-breaks by map order. Cold prefixes go to the
// rendezvous winner, the same for independent replicas and every run.
func TestColdPicksAgreeAcrossReplicas(t *testing.T) {
	set := testSet(t, 16)
	r1, r2 := newTestPrefix(DefaultPrefixParams()), newTestPrefix(DefaultPrefixParams())
	used := map[*discovery.Endpoint]bool{}
	for i := 0; i < 200; i++ {
		req := request(system(100+i, 4096))
		d1, d2 := r1.Pick(req, set), r2.Pick(req, set)
		if d1.Endpoint != d2.Endpoint {
			t.Fatalf("replicas disagree on a cold prefix: %s vs %s", d1.Endpoint, d2.Endpoint)
		}
		used[d1.Endpoint] = true
	}
	if len(used) < 14 {
		t.Fatalf("cold prefixes used %d of 16 endpoints", len(used))
	}
}

func TestExplainMatchesPickWithoutRecording(t *testing.T) {
	set := testSet(t, 3)
	p := newTestPrefix(DefaultPrefixParams())
	r := request(system(7, 4096))
	d, terms := p.Explain(r, set)
	if len(terms) != 3 || d.Endpoint == nil || d.Reason != ReasonCold {
		t.Fatalf("explain %+v %+v", d, terms)
	}
	if st := p.Index().Stats(); st.Entries != 0 || p.Homes() != 0 {
		t.Fatal("explain recorded the request")
	}
	if !terms[indexOf(set, d.Endpoint)].Home {
		t.Fatalf("the cold pick is not marked as the prefix's home: %+v", terms)
	}
	if got := p.Pick(r, set); got.Endpoint != d.Endpoint {
		t.Fatalf("pick %s, explain said %s", got.Endpoint, d.Endpoint)
	}
	if _, terms := p.Explain(r, set); terms[indexOf(set, d.Endpoint)].MatchedBlocks != 4096/testBlock {
		t.Fatalf("terms after the pick: %+v", terms)
	}
}

func indexOf(set *discovery.Set, e *discovery.Endpoint) int {
	for i, x := range set.Endpoints {
		if x == e {
			return i
		}
	}
	return -1
}

func TestSetParamsValidates(t *testing.T) {
	p := newTestPrefix(DefaultPrefixParams())
	bad := DefaultPrefixParams()
	bad.MinMatchBlocks = 0
	if err := p.SetParams(bad); err == nil {
		t.Fatal("accepted min_match_blocks 0")
	}
	good := DefaultPrefixParams()
	good.SpillMarginSec = 2
	if err := p.SetParams(good); err != nil || p.Params().SpillMarginSec != 2 {
		t.Fatalf("SetParams: %v", err)
	}
}

// BenchmarkPick: a whole decision for a 128 KiB prompt, hashing included,
// with the index at its default capacity (1,760 blocks an endpoint);
// "new-prefix" makes every prompt's first block distinct, so each pick
// also assigns a home and records the whole new chain (128 blocks
// inserted, as many evicted).
func BenchmarkPick(b *testing.B) {
	text := system(1, 128<<10)
	for _, n := range []int{8, 64, 1000} {
		b.Run(fmt.Sprintf("endpoints-%d", n), func(b *testing.B) { benchmarkPick(b, n, false, text) })
		b.Run(fmt.Sprintf("endpoints-%d/new-prefix", n), func(b *testing.B) { benchmarkPick(b, n, true, text) })
	}
}

// benchMessages is how many messages benchmarkPick's prompt is cut into.
const benchMessages = 16

func benchmarkPick(b *testing.B, n int, fresh bool, text string) {
	set := testSet(b, n)
	p := NewPrefix(prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: 1760, MaxEntries: 4_000_000}), testBlock, DefaultPrefixParams())
	var h prefix.Hasher
	var head [8]byte
	r := &Request{Kind: KindCompletions, Model: "m"}
	b.ReportAllocs()
	b.SetBytes(int64(len(text)))
	for i := 0; i < b.N; i++ {
		h.Reset(testBlock, 512, prefix.Seed("m", ""))
		if fresh {
			binary.LittleEndian.PutUint64(head[:], uint64(i))
			_, _ = h.Write(head[:])
		}
		for m := range benchMessages { // a chat: each message's end marked, as the proxy does
			_, _ = h.WriteString(text[m*len(text)/benchMessages : (m+1)*len(text)/benchMessages])
			h.Mark()
		}
		r.Hashes, r.Marks, r.PromptBytes, r.PromptTokens = h.Hashes, h.Marks, h.Len(), h.Len()/4
		d := p.Pick(r, set)
		if d.Endpoint == nil {
			b.Fatal("no pick")
		}
	}
}

// The engines' prompt_tokens calibrate bytes per token, which converts the
// scraped KV capacity into index blocks.
func TestLearnsBytesPerToken(t *testing.T) {
	p := newTestPrefix(DefaultPrefixParams())
	p.SetCapacityTokens(1, 25600)
	if got := p.Index().Correct(1, false); got != 25600*4/testBlock {
		t.Fatalf("capacity %d blocks at 4 bytes/token", got)
	}
	for i := 0; i < 200; i++ {
		p.Learn(Decision{}, 5000, 1000, 0) // the engine counts 5 bytes per token
	}
	if bpt := p.BytesPerToken(); bpt < 4.9 || bpt > 5.0 {
		t.Fatalf("learned %.2f bytes/token, want ≈ 5", bpt)
	}
	if got := p.Index().Correct(1, false); got < 25600*49/10/testBlock || got > 25600*5/testBlock {
		t.Fatalf("capacity %d blocks after learning 5 bytes/token", got)
	}
	p.Learn(Decision{}, 1<<30, 1, 0) // absurd reports are clamped
	if bpt := p.BytesPerToken(); bpt > 16 {
		t.Fatalf("bytes/token %.1f", bpt)
	}
}

// A prefix the index forgot (its blocks aged out of the capacity model)
// returns to its home, not to the least-loaded endpoint, unless the home is
// saturated as a warm endpoint would be: forgetting is no evidence that the
// engine evicted, and another router may keep the prefix there. Forgetting
// the endpoint itself re-homes the prefix.
func TestForgottenPrefixReturnsHome(t *testing.T) {
	set := testSet(t, 4)
	p := newTestPrefix(DefaultPrefixParams())
	sys := system(20, 8192)
	home := p.Pick(request(sys+"a"), set).Endpoint
	p.Index().Forget(home.ID)
	// Busier than the others, not saturated: 0.1 s of prefill queued, which
	// with the recompute would send a truly cold prefix to an idle endpoint.
	defer occupy(home, 3, 2000)()
	if d := p.Pick(request(sys+"b"), set); d.Endpoint != home || d.Reason != ReasonCold {
		t.Fatalf("forgotten prefix went to %s (%s), want its home %s", d.Endpoint, d.Reason, home)
	}
	p.Forget(home.ID) // the endpoint left, or its engine restarted
	if _, hk, _ := p.homes.lookup(rendezvousKey(request(sys).Hashes, 2), set.Mixed, 1.1, false, false, true, turn{}); hk.recurring {
		t.Fatal("the prefix kept a forgotten endpoint as its home")
	}
}

// A saturated warm endpoint spills only to an endpoint whose engine has KV
// room: spilling into a full cache evicts the prefixes homed there.
func TestSpillNeedsKVRoom(t *testing.T) {
	set := testSet(t, 3)
	p := newTestPrefix(DefaultPrefixParams())
	sys := system(30, 16384)
	warm := p.Pick(request(sys+"a"), set).Endpoint
	defer occupy(warm, 50, 40_000)() // two seconds of prefill queued
	var others []*discovery.Endpoint
	for _, e := range set.Endpoints {
		if e != warm {
			others = append(others, e)
			e.SetEngine(&discovery.EngineStats{Engine: "vllm", KVUsage: 0.95, At: time.Now()})
		}
	}
	if d := p.Pick(request(sys+"b"), set); d.Endpoint != warm || d.Reason != ReasonWarm {
		t.Fatalf("spilled into a full cache: %+v", d)
	}
	others[1].SetEngine(&discovery.EngineStats{Engine: "vllm", KVUsage: 0.3, At: time.Now()})
	if d := p.Pick(request(sys+"c"), set); d.Endpoint != others[1] || d.Reason != ReasonSpill {
		t.Fatalf("did not spill to the endpoint with room: %+v", d)
	}
}

func TestFollowFleetEvents(t *testing.T) {
	set := testSet(t, 2)
	e := set.Endpoints[0]
	p := newTestPrefix(DefaultPrefixParams())
	var o discovery.Options
	p.Follow(&o)
	// 1,024 tokens at 4 bytes a token is 4 one-KiB blocks.
	o.OnCapacity(e, 1024)
	p.Index().Record(e.ID, request(system(40, 16*testBlock)).Hashes)
	if n := p.Index().Stats().Entries; n != 4 {
		t.Fatalf("%d entries after recording 16 blocks on a 4-block endpoint", n)
	}
	for range 2 {
		p.homes.lookup(7, []*discovery.Endpoint{e}, 1.1, true, false, true, turn{})
	}
	o.OnRestart(e)
	if n := p.Index().Stats().Entries; n != 0 || p.Homes() != 0 {
		t.Fatalf("restart: %d entries and %d homes left", n, p.Homes())
	}
}

// Independent replicas, each routing a random share of the same traffic,
// agree on where every recurring prefix goes, and spread the prefixes
// evenly: homes depend on the recurring keys, not on which replica saw
// what first, and a replica follows the home even where its own index
// holds the prefix elsewhere (the engines show the other replicas'
// requests).
func TestReplicasAgree(t *testing.T) {
	set := testSet(t, 8)
	for _, e := range set.Endpoints {
		e.SetEngine(&discovery.EngineStats{Engine: "vllm", Running: 3, At: time.Now().Add(time.Hour)})
	}
	replicas := []*Prefix{newTestPrefix(DefaultPrefixParams()), newTestPrefix(DefaultPrefixParams()), newTestPrefix(DefaultPrefixParams())}
	rng := rand.New(rand.NewPCG(5, 6))
	for i := range 64 * 30 {
		g := rng.IntN(64)
		replicas[rng.IntN(len(replicas))].Pick(request(system(1000+g, 8192)+fmt.Sprint(i)), set)
	}
	load := map[*discovery.Endpoint]int{}
	for g := range 64 {
		var first *discovery.Endpoint
		for i, p := range replicas {
			d := p.Pick(request(system(1000+g, 8192)+"final"), set)
			if i == 0 {
				first = d.Endpoint
				load[first]++
			} else if d.Endpoint != first {
				t.Errorf("group %d: replica 0 routes to %s, replica %d to %s (%s)", g, first, i, d.Endpoint, d.Reason)
			}
		}
	}
	for e, n := range load {
		if n > 9 {
			t.Errorf("%s homes %d of 64 prefixes, want at most ⌈1.1 × 8⌉ = 9", e, n)
		}
	}
}

// A prefix the engine already held was seen before, by this router or
// another: the first report of it cached makes its key recur.
func TestEngineCacheMakesAKeyRecur(t *testing.T) {
	set := testSet(t, 4)
	p := newTestPrefix(DefaultPrefixParams())
	r := request(system(50, 8192) + "q")
	d := p.Pick(r, set)
	p.Learn(d, r.PromptBytes, r.PromptTokens, 16) // a block's worth of a shared preamble
	if p.Homes() != 0 {
		t.Fatalf("%d recurring keys after a report of 16 cached tokens", p.Homes())
	}
	p.Learn(d, r.PromptBytes, r.PromptTokens, 2048)
	if p.Homes() != 1 {
		t.Fatalf("%d recurring keys after the engine reported the prefix cached", p.Homes())
	}
}

// A spill recomputes the prompt where it lands, and that prefill stalls
// the requests running there: it must save the request more than it costs
// them. An endpoint with nothing running takes the spill that a busy one,
// though below its batch limit, does not.
func TestSpillWeighsTheStallItCauses(t *testing.T) {
	set := testSet(t, 3)
	p := newTestPrefix(DefaultPrefixParams())
	sys := system(40, 16384) // 4k tokens: 0.2 s to recompute
	warm := p.Pick(request(sys+"a"), set).Endpoint
	defer occupy(warm, 1, 10_000)() // 0.5 s of prefill queued
	var releases []func()
	for _, e := range set.Endpoints {
		if e != warm {
			releases = append(releases, occupy(e, 5, 0)) // 5 running: a spill stalls them 1 s
		}
	}
	if d := p.Pick(request(sys+"b"), set); d.Endpoint != warm || d.Reason != ReasonWarm {
		t.Fatalf("spilled onto running batches: %+v", d)
	}
	releases[0]()
	defer releases[1]()
	if d := p.Pick(request(sys+"c"), set); d.Endpoint == warm || d.Reason != ReasonSpill {
		t.Fatalf("did not spill to the endpoint with nothing running: %+v", d)
	}
}

// A first request that found its home busy went elsewhere: its prefix is
// cached there, not at the home, so the next request follows it instead
// of recomputing at the home.
func TestPrefixStaysWhereItsFirstRequestWent(t *testing.T) {
	set := testSet(t, 4)
	p := newTestPrefix(DefaultPrefixParams())
	sys := system(41, 8192)
	home, _, _ := p.homes.lookup(rendezvousKey(request(sys).Hashes, 2), set.Mixed, 1.1, false, false, true, turn{})
	var busy *discovery.Endpoint
	for _, e := range set.Endpoints {
		if e.ID == home {
			busy = e
		}
	}
	release := occupy(busy, 2, 40_000) // 2 s of prefill queued
	first := p.Pick(request(sys+"a"), set)
	release()
	if first.Endpoint == busy || first.Reason != ReasonCold {
		t.Fatalf("a new prefix queued behind its busy home: %+v", first)
	}
	if d := p.Pick(request(sys+"b"), set); d.Endpoint != first.Endpoint || d.Reason != ReasonWarm {
		t.Fatalf("the second request went to %s (%s), not where the prefix is cached (%s)", d.Endpoint, d.Reason, first.Endpoint)
	}
}

// A router alone knows where it sent each prefix: as the recurring keys
// grow and the balanced assignment moves homes, a prefix stays where this
// router cached it instead of being recomputed at its new home.
func TestRouterAloneKeepsPrefixesWhereCached(t *testing.T) {
	set := testSet(t, 8)
	p := newTestPrefix(DefaultPrefixParams())
	rng := rand.New(rand.NewPCG(9, 10))
	where := map[int]*discovery.Endpoint{}
	moved := 0
	for i := range 64 * 8 {
		g := rng.IntN(64)
		d := p.Pick(request(system(2000+g, 8192)+fmt.Sprint(i)), set)
		if w, ok := where[g]; ok && w != d.Endpoint {
			moved++
		}
		where[g] = d.Endpoint
	}
	if moved > 0 {
		t.Fatalf("%d requests left the endpoint their prefix was cached on (%d homes recur)", moved, p.Homes())
	}
}

// A prefix every endpoint holds as deep (a hot system prompt, spilled
// everywhere) goes where the wait is shortest: its home has no copy the
// others lack, so it takes no precedence. With one endpoint short of it,
// the home keeps its precedence while within the spill rule.
func TestPrefixHeldEverywhereIsBalancedByLoad(t *testing.T) {
	set := testSet(t, 4)
	p := newTestPrefix(DefaultPrefixParams())
	sys := system(5, 8*testBlock)
	r := request(sys + "q")
	home := p.Pick(r, set).Endpoint
	for _, e := range set.Endpoints {
		p.Index().Record(e.ID, r.Hashes)
	}
	// One request in flight at the home: a few ms more wait there, well
	// within the spill rule.
	release := occupy(home, 1, 0)
	defer release()
	if d := p.Pick(request(sys+"q2"), set); d.Endpoint == home || d.Reason != ReasonWarm {
		t.Fatalf("held everywhere: %+v went to the busier home", d)
	}
	for _, e := range set.Endpoints {
		if e != home {
			p.Index().Forget(e.ID) // one endpoint no longer holds it
			break
		}
	}
	if d := p.Pick(request(sys+"q3"), set); d.Endpoint != home {
		t.Fatalf("held on 3 of 4: %+v, want the home %s", d, home.URL)
	}
}

// A shared prefix shorter than two blocks (380 tokens, 1.8 KiB) still
// keeps its group together: issue #24's prompts, which with a two-block
// minimum were all cold and spread like least-request's.
func TestShortGroupPrefixStaysTogether(t *testing.T) {
	set := testSet(t, 4)
	p := newTestPrefix(DefaultPrefixParams())
	sys := system(6, 1843)
	first := p.Pick(request(sys+system(100, 300)), set)
	for i := 1; i < 12; i++ {
		if d := p.Pick(request(sys+system(100+i, 300)), set); d.Endpoint != first.Endpoint || d.Reason != ReasonWarm {
			t.Fatalf("prompt %d of the group: %+v, want warm on %s", i, d, first.Endpoint.URL)
		}
	}
}

// A prefix held as deep on every endpoint, by one only on a slower tier
// (engine truth's CPU copy), goes where it is on the GPU: the copy costs a
// load, which /debug/route shows.
func TestSlowerTierCostsALoad(t *testing.T) {
	set := testSet(t, 2)
	p := newTestPrefix(DefaultPrefixParams())
	sys := system(6, 8*testBlock)
	r := request(sys + "q")
	for _, e := range set.Endpoints {
		p.Index().Record(e.ID, r.Hashes)
	}
	first := p.Pick(r, set).Endpoint // equal waits: the rendezvous winner
	for _, h := range r.Hashes {
		p.Index().SetLower(first.ID, h, true)
	}
	r2 := request(sys + "q2")
	d, terms := p.Explain(r2, set)
	if d.Endpoint == first || d.Loaded != 0 {
		t.Fatalf("%+v: went to the endpoint holding the prefix on CPU only", d)
	}
	for _, term := range terms {
		if term.Endpoint == first.URL && (term.LoadedTokens == 0 || term.LoadTokensPerSec != term.PrefillTokensPerSec*discovery.LoadSpeedup) {
			t.Fatalf("the CPU holder's term %+v: no load, or not at the prior rate", term)
		}
	}
	// Where only the CPU holder holds it, the load beats a recompute.
	for _, e := range set.Endpoints {
		if e != first {
			p.Index().Forget(e.ID)
		}
	}
	if d := p.Pick(request(sys+"q3"), set); d.Endpoint != first || d.Loaded == 0 || d.Reason != ReasonWarm {
		t.Fatalf("%+v: want the CPU holder, warm, loading", d)
	}
}

// CachedTokens is the deepest prefix the index shows anywhere, in tokens,
// never more than the prompt: what the queue does not charge a request.
func TestCachedTokens(t *testing.T) {
	p := newTestPrefix(DefaultPrefixParams())
	text := strings.Repeat("a shared system prompt. ", 300) // 7,200 bytes: 7 whole blocks
	r := request(text)
	if c := p.CachedTokens(r); c != 0 {
		t.Fatalf("cold: %d cached", c)
	}
	p.Index().Record(1, r.Hashes[:3])
	p.Index().Record(2, r.Hashes[:5])
	if c, want := p.CachedTokens(r), 5*testBlock/4; c != want {
		t.Errorf("cached %d, want the deepest match, %d", c, want)
	}
	p.Index().Record(3, r.Hashes)
	if c := p.CachedTokens(r); c > r.PromptTokens || c < r.PromptTokens-testBlock/4 {
		t.Errorf("all held: cached %d of %d", c, r.PromptTokens)
	}
	if c := p.CachedTokens(&Request{PromptTokens: 10}); c != 0 {
		t.Errorf("no hashes: %d", c)
	}
}

// A gossiping peer's request counts as this router's own would: its prefix
// key recurs at its second request anywhere, not at this replica's second,
// and the keys the peers send an endpoint count in a key's distance there
// (warmth), so that replicas agree on the recurring keys and learn what an
// engine keeps from every replica's traffic.
func TestPeersRequestsCountAsSeen(t *testing.T) {
	set := testSet(t, 4)
	p := newTestPrefix(DefaultPrefixParams())
	p.Meshed(func() bool { return true }, nil, nil, nil)
	e := set.Endpoints[0]
	sys := system(60, 8192)
	p.PeerPlaced(e, request(sys+"a").Hashes)
	if p.Homes() != 0 {
		t.Fatalf("%d recurring keys after one request", p.Homes())
	}
	p.PeerPlaced(set.Endpoints[1], request(sys+"b").Hashes)
	if p.Homes() != 1 {
		t.Fatalf("%d recurring keys after two peers' requests of one prefix, want 1", p.Homes())
	}
	d := p.Pick(request(sys+"c"), set)
	for g := range 3 { // the peers send three other prefixes where this one went
		p.PeerPlaced(d.Endpoint, request(system(70+g, 8192)+"x").Hashes)
	}
	if dist := p.warm.see(d.Endpoint.ID, d.PrefixKey); dist != 3 {
		t.Fatalf("the prefix's distance on %s: %d, want 3 (the peers' three keys since)", d.Endpoint, dist)
	}
}

// WarmRoom tells the queue whether a waiting request's deepest match has
// room: a shallower copy elsewhere does not count, nor a match shorter
// than MinMatchBlocks.
func TestWarmRoom(t *testing.T) {
	set := testSet(t, 3)
	p := newTestPrefix(DefaultPrefixParams())
	r := request(strings.Repeat("a shared system prompt. ", 300)) // 7 whole blocks
	r.StartNow, r.MaxInFlight = true, 1
	if placed, room := p.WarmRoom(r, set); placed || room {
		t.Fatalf("cold: placed %v, room %v", placed, room)
	}
	deep, shallow := set.Serving[0], set.Serving[1]
	p.Index().Record(deep.ID, r.Hashes[:5])
	p.Index().Record(shallow.ID, r.Hashes[:3])
	if placed, room := p.WarmRoom(r, set); !placed || !room {
		t.Fatalf("deepest match idle: placed %v, room %v", placed, room)
	}
	release := occupy(deep, 1, 0) // at r.MaxInFlight
	if placed, room := p.WarmRoom(r, set); !placed || room {
		t.Errorf("deepest match at its cap: placed %v, room %v (a shallower copy has room)", placed, room)
	}
	release()
	prm := DefaultPrefixParams()
	prm.MinMatchBlocks = 3
	short := newTestPrefix(prm)
	short.Index().Record(deep.ID, r.Hashes[:2])
	if placed, _ := short.WarmRoom(r, set); placed {
		t.Error("a match shorter than MinMatchBlocks counts as placed")
	}
}
