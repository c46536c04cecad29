package routing

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/discovery"
)

// conversations runs convs conversations under one shared system prompt,
// 15 turns each on average, each turn resending the history, every turn
// through a random one of replicas; it returns how many turns went to
// another endpoint than their conversation's previous turn, and the most
// turns one endpoint served. Every conversation's first turn comes first,
// then the turns follow in random order.
func conversations(t *testing.T, set *discovery.Set, replicas []*Prefix, convs int) (moved, most int) {
	t.Helper()
	rng := rand.New(rand.NewPCG(7, 8))
	sys := system(9, 2500)
	history := make([]string, convs)
	last := make([]*discovery.Endpoint, convs)
	served := map[*discovery.Endpoint]int{}
	ask := func(c int) (*Prefix, *Request) {
		history[c] += fmt.Sprintf("user %d: %s\n", c, strings.Repeat(fmt.Sprint(rng.IntN(1e9)), 60))
		return replicas[rng.IntN(len(replicas))], request(sys + history[c])
	}
	answer := func(c int, d Decision) {
		history[c] += fmt.Sprintf("assistant: %s\n", strings.Repeat(fmt.Sprint(rng.IntN(1e9)), 40))
		if last[c] != nil && d.Endpoint != last[c] {
			moved++
		}
		last[c] = d.Endpoint
		served[d.Endpoint]++
		most = max(most, served[d.Endpoint])
	}
	for c := range convs {
		p, r := ask(c)
		answer(c, p.Pick(r, set))
	}
	for range convs * 14 {
		c := rng.IntN(convs)
		p, r := ask(c)
		answer(c, p.Pick(r, set))
	}
	return moved, most
}

// Independent replicas, each routing a random share of the turns of
// conversations under one shared system prompt, send each conversation's
// turns where its earlier turns went: once the engines show other
// routers' requests and the family's requests are seen to extend earlier
// ones, each conversation is keyed by its own first block. A conversation
// moves once, when its history first fills a block of its own (its first
// turn is keyed by the shared prompt), and a few twice, while a replica
// has yet to see the family chained.
func TestReplicasAgreeOnConversations(t *testing.T) {
	set := testSet(t, 8)
	for _, e := range set.Endpoints {
		// Other routers' requests: 3 running there, none of this router's.
		e.SetEngine(&discovery.EngineStats{Engine: "vllm", Running: 3, At: time.Now().Add(time.Hour)})
	}
	replicas := []*Prefix{newTestPrefix(DefaultPrefixParams()), newTestPrefix(DefaultPrefixParams()), newTestPrefix(DefaultPrefixParams())}
	const convs = 48
	moved, most := conversations(t, set, replicas, convs)
	if moved > convs*5/4 {
		t.Fatalf("%d turns of %d moved to another endpoint than their conversation's last turn, want at most one a conversation and a few more", moved, convs*14)
	}
	// Not all on the shared prompt's home: the conversations spread.
	if most > convs*15*2/5 {
		t.Fatalf("one endpoint served %d of %d turns", most, convs*15)
	}
	if f := replicas[0].Foreign(); f < 0.9 {
		t.Fatalf("learned foreign share %.2f, want ≈ 1", f)
	}
}

// A router alone (the engines run only its requests) keeps placing a
// family's conversations by its own view of load: its keys stay the
// shared prompt's.
func TestRouterAloneKeysTheSharedPrompt(t *testing.T) {
	set := testSet(t, 8)
	p := newTestPrefix(DefaultPrefixParams())
	_, _ = conversations(t, set, []*Prefix{p}, 16)
	mm := DefaultPrefixParams().MinMatchBlocks
	key := rendezvousKey(request(system(9, 2500)).Hashes, mm)
	if shared, chained := p.homes.family(key, 2, mm, false); !chained || shared < 2 {
		t.Fatalf("family: shared %d chained %v, want at least the 2 blocks of the shared prompt, chained", shared, chained)
	}
	d := p.Pick(request(system(9, 2500)+"user 99: a new conversation "+strings.Repeat("x", 2000)), set)
	if want := key; d.PrefixKey != want || d.branch {
		t.Fatalf("a lone router keyed a new conversation %x (branch %v), want the shared prompt's %x", d.PrefixKey, d.branch, want)
	}
}

// A family is chained when its requests extend their own branches (matches
// at many depths past the shared part), not when they all match one
// shared part, even after one request matched short of it.
func TestFamilyChained(t *testing.T) {
	h := newHomes(0, time.Now)
	eps := testSet(t, 2).Endpoints
	for _, tc := range []struct {
		name    string
		depths  []int
		shared  int
		chained bool
	}{
		{"group", []int{8, 8, 8, 8, 8, 8, 8, 8}, 8, false},
		{"group after one short match", []int{2, 8, 8, 8, 8, 8, 8, 8, 8}, 8, false},
		{"group after two short matches", []int{2, 8, 8, 8, 3, 8, 8, 8, 8}, 3, false},
		{"conversations", []int{2, 3, 2, 4, 5, 2, 6, 7, 3, 8}, 2, true},
	} {
		key := uint64(len(tc.name))<<32 | uint64(tc.shared)
		h.lookup(key, eps, 1.1, true, false, false, turn{}) // the key's first request
		var shared int
		var chained bool
		for _, d := range tc.depths {
			shared, chained = h.family(key, d, 2, true)
		}
		if shared != tc.shared || chained != tc.chained {
			t.Errorf("%s: shared %d chained %v, want %d %v", tc.name, shared, chained, tc.shared, tc.chained)
		}
	}
}

// Replicas that gossip their placements (each pick recorded in every
// replica's index, Meshed) route as one of several, yet send each
// conversation's turns where the index says its history is, not to a
// home presumed to hold it: no more moves than independent replicas
// make, though no engine shows another router's requests.
func TestMeshedReplicasFollowTheIndex(t *testing.T) {
	set := testSet(t, 8)
	replicas := []*Prefix{newTestPrefix(DefaultPrefixParams()), newTestPrefix(DefaultPrefixParams())}
	for _, p := range replicas {
		p.Meshed(func() bool { return true }, nil, nil, nil)
		p.OnPlaced(func(id uint64, hashes []uint64) {
			for _, q := range replicas {
				if q != p {
					q.Index().Record(id, hashes)
				}
			}
		})
	}
	const convs = 48
	moved, _ := conversations(t, set, replicas, convs)
	if moved > convs*5/4 {
		t.Fatalf("%d turns of %d moved to another endpoint than their conversation's last turn, want at most one a conversation and a few more", moved, convs*14)
	}
}

// A gossiping peer's placement is merged into the index and counts as
// prefill running where it went, for the blocks not held there, until the
// endpoint's rates say it is computed; the peers' requests in flight
// count in the spill test like this router's own, so that a pod every
// replica sent its share to is relieved although none of them alone
// loaded it.
func TestPeersLoadCountsAsOwn(t *testing.T) {
	set := testSet(t, 4)
	p := newTestPrefix(DefaultPrefixParams())
	p.Meshed(func() bool { return true }, nil, nil, nil)
	sys := system(11, 16*testBlock)
	r := request(sys + "first")
	e := set.Endpoints[0]
	p.PeerPlaced(e, r.Hashes)
	want := int64(float64(len(r.Hashes)*testBlock) / p.BytesPerToken())
	if got := e.PeerPrefill(); got != want {
		t.Fatalf("peer prefill %d tokens, want %d", got, want)
	}
	p.PeerPlaced(e, r.Hashes) // held now: nothing more to compute
	if got := e.PeerPrefill(); got != want {
		t.Fatalf("the same chain again: %d tokens, want %d", got, want)
	}
	d, terms := p.Explain(request(sys+"second"), set)
	if d.Endpoint != e || d.MatchedBlocks == 0 {
		t.Fatalf("the peer's placement is not followed: %+v", d)
	}
	for _, term := range terms {
		if term.Endpoint == e.URL && term.InFlightPrefill != want {
			t.Errorf("/debug/route shows %d tokens pending there, want the peer's %d", term.InFlightPrefill, want)
		}
	}
	// Every replica sent it requests: twelve in flight there, none of
	// them this router's.
	e.SetPeerInFlight(12)
	defer e.SetPeerInFlight(0)
	if d := p.Pick(request(sys+"third"), set); d.Endpoint == e || d.Reason != ReasonSpill {
		t.Fatalf("a pod the peers load is not relieved: %+v", d)
	}
}

// A peer's cold placement of a prompt stands, for a moment, for the
// others' sends of the same prompt there too (every replica heard it at
// once): a request of that prompt counts them and goes elsewhere, one of
// another prompt does not, and neither does either once the moment passed.
func TestPeersColdPlacementEchoesForItsPrompt(t *testing.T) {
	set := testSet(t, 2)
	p := newTestPrefix(DefaultPrefixParams())
	p.Meshed(func() bool { return true }, func() int { return 7 }, func() int { return 0 }, func() float64 { return 7 })
	sys := system(13, 16*testBlock)
	first := request(sys + "first")
	e := set.Endpoints[0]
	p.PeerPlaced(e, first.Hashes)
	own := e.PeerPrefill()
	pendingAt := func(r *Request) int64 {
		_, terms := p.Explain(r, set)
		for _, term := range terms {
			if term.Endpoint == e.URL {
				return term.InFlightPrefill
			}
		}
		t.Fatal("no term for the endpoint")
		return 0
	}
	if got, want := pendingAt(request(sys+"second")), 7*own; got != want {
		t.Errorf("a request of the prompt counts %d tokens pending there, want the placement's and six others' (%d)", got, want)
	}
	if d := p.Pick(request(sys+"second"), set); d.Endpoint == e {
		t.Errorf("a request of the prompt followed the cold placement at once: %+v", d)
	}
	if got := pendingAt(request(system(14, 16*testBlock) + "other")); got != own {
		t.Errorf("a request of another prompt counts %d tokens pending there, want the placement's %d", got, own)
	}
	p.PeerPlaced(e, request(sys+"first, then a long turn of its own: "+strings.Repeat("more. ", 400)).Hashes)
	if got := p.colds.n.Load(); got != 1 {
		t.Errorf("%d cold placements counted, want 1 (a turn placed where its prompt is held is not cold)", got)
	}
	key, _, _ := p.keyOf(first.Hashes, false, p.params.Load(), 0, true, false)
	if got := p.colds.at(key, e.ID, time.Now().Add(unheardFor)); got != 0 {
		t.Errorf("after %s still %d tokens counted", unheardFor, got)
	}
}

// chainedReplica returns one of two gossiping replicas over set that have
// routed 16 conversations under one system prompt: its family is seen
// chained, and a conversation is keyed by its own branch.
func chainedReplica(t *testing.T, set *discovery.Set) *Prefix {
	t.Helper()
	replicas := []*Prefix{newTestPrefix(DefaultPrefixParams()), newTestPrefix(DefaultPrefixParams())}
	for _, p := range replicas {
		p.Meshed(func() bool { return true }, nil, nil, nil)
	}
	conversations(t, set, replicas, 16)
	return replicas[0]
}

// A conversation of gossiping replicas whose deepest copy, away from its
// home, lost most of its history (the endpoint evicted it) goes home;
// while that copy holds most of it, the conversation stays with it.
func TestLostConversationGoesHome(t *testing.T) {
	set := testSet(t, 8)
	p := chainedReplica(t, set)
	conv := system(9, 2500) + "user 99: " + strings.Repeat("a long first question of its own. ", 400)
	first := request(conv)
	d := p.Pick(first, set)
	if !d.branch {
		t.Fatalf("the conversation is not keyed by its own branch: %+v", d)
	}
	home := d.Endpoint
	away := set.Endpoints[0]
	if away == home {
		away = set.Endpoints[1]
	}
	// Its history went elsewhere (another replica spilled it there).
	p.Index().Drop(home.ID, first.Hashes...)
	p.Index().Record(away.ID, first.Hashes)
	conv += "assistant: an answer\nuser 99: a second question"
	if d := p.Pick(request(conv), set); d.Endpoint != away {
		t.Fatalf("a conversation left the copy holding its history for %s", d.Endpoint.URL)
	}
	// That endpoint evicted all but three blocks of it.
	p.Index().Drop(away.ID, request(conv).Hashes[3:]...)
	conv += "assistant: an answer\nuser 99: a third question"
	if d := p.Pick(request(conv), set); d.Endpoint != home || !d.Home {
		t.Fatalf("a conversation whose copy lost most of its history went to %s (home %v), want its home %s", d.Endpoint.URL, d.Home, home.URL)
	}
}

// A gossiping replica places a new conversation under a shared system
// prompt (nothing of its own held anywhere) by the load, as a router
// alone does, not at its key's home: the homes are where the keys'
// rendezvous puts them, up to seven of 24 on one of eight pods.
func TestNewConversationGoesByLoad(t *testing.T) {
	set := testSet(t, 8)
	p := chainedReplica(t, set)
	first := request(system(9, 2500) + "user 98: " + strings.Repeat("a first question of its own. ", 40))
	_, terms := p.Explain(first, set)
	var home *discovery.Endpoint
	for i, term := range terms {
		if term.Home {
			home = set.Endpoints[i]
		}
	}
	if home == nil {
		t.Fatal("the conversation has no home")
	}
	// Every endpoint holds the system prompt (its first two blocks; spills
	// copied it everywhere). The home runs two requests, well within the
	// spill rule; the others are idle.
	for _, e := range set.Endpoints {
		p.Index().Record(e.ID, first.Hashes[:2])
	}
	for range 2 {
		l := home.Acquire(0)
		defer l.Release()
	}
	d := p.Pick(first, set)
	if !d.branch {
		t.Fatalf("the conversation is not keyed by its own branch: %+v", d)
	}
	if d.Endpoint == home {
		t.Fatalf("a new conversation went to its busy home %s, while seven endpoints holding the shared prompt as deep were idle", home.URL)
	}
}

// A gossiping replica that learns of a key from a peer's placement homes
// it where the peer sent it, as its own first request would: the home
// stays there when the index forgets the prompt.
func TestPeerPlacementHomesTheKey(t *testing.T) {
	set := testSet(t, 4)
	p := newTestPrefix(DefaultPrefixParams())
	p.Meshed(func() bool { return true }, func() int { return 1 }, func() int { return 0 }, nil)
	sys := system(21, 16*testBlock)
	first := request(sys + "the first question")
	d, _ := p.Explain(first, set) // where this replica would have put it
	at := set.Endpoints[0]
	if at == d.Endpoint {
		at = set.Endpoints[1]
	}
	p.PeerPlaced(at, first.Hashes)
	p.Index().Drop(at.ID, first.Hashes...)
	_, terms := p.Explain(request(sys+"a second question"), set)
	for _, term := range terms {
		if term.Home != (term.Endpoint == at.URL) {
			t.Fatalf("home %s is %v, want the peer's placement %s", term.Endpoint, term.Home, at.URL)
		}
	}
}

// Gossiping replicas that each get a burst of one new prompt before any
// placement of the others arrives spread it as one router does: each pick
// counts the prefill the others most likely sent its endpoint meanwhile,
// and each replica breaks ties among idle spill targets its own way.
// Deciding alike, each had sent three of its eight to the prompt's home.
func TestUnheardPicksSpreadABurst(t *testing.T) {
	// burst sends 24 new conversations under one system prompt through n
	// replicas, in turn, none told of the others' picks; others is the
	// live peers each counts (0: none), turns whether each takes its turn
	// in the rendezvous order (its rank). It returns the most on one of
	// the eight endpoints.
	burst := func(n, others int, turns bool) (most int) {
		// Each replica its own endpoints (the same eight servers), its
		// own counters.
		replicas := make([]*Prefix, n)
		sets := make([]*discovery.Set, n)
		for i := range replicas {
			replicas[i], sets[i] = newTestPrefix(DefaultPrefixParams()), testSet(t, 8)
			var rank func() int
			if turns {
				rank = func() int { return i }
			}
			replicas[i].Meshed(func() bool { return true }, func() int { return others }, rank, nil)
		}
		sys := system(23, 4*testBlock)
		served := map[string]int{}
		var leases []discovery.Lease
		for i := range 24 {
			d := replicas[i%n].Pick(request(sys+fmt.Sprintf("conversation %d: %s", i, strings.Repeat("x", 1500))), sets[i%n])
			leases = append(leases, d.Endpoint.Acquire(d.Prefill))
			served[d.Endpoint.URL]++
			most = max(most, served[d.Endpoint.URL])
		}
		for i := range leases {
			leases[i].Release()
		}
		return most
	}
	for _, n := range []int{3, 8} {
		if most := burst(n, n-1, true); most > 3 {
			t.Errorf("one endpoint took %d of a burst of 24 on 8 from %d replicas, want at most 3", most, n)
		}
		// The controls: each replica breaking ties on the scores alone,
		// the first picks herd to the prompt's home; not counting the
		// others' picks either, the later ones too.
		if most := burst(n, n-1, false); n == 8 && most < 6 {
			t.Errorf("%d replicas without their turns: one endpoint took %d, want the herd (6 or more) the test is about", n, most)
		}
		if most := burst(n, 0, false); most < 6 {
			t.Errorf("%d replicas counting no others: one endpoint took %d, want the herd (6 or more)", n, most)
		}
	}
}

// A gossiping replica's pick counts, at its endpoint, the prefill of as
// many requests of the others as its echo says they send alike (the
// peers' Mesh.Echo, learned from their loads); of every live other without
// an echo; none when the echo says the others send nothing.
func TestPickCountsTheOthersUnheard(t *testing.T) {
	for _, tc := range []struct {
		name string
		echo func() float64
		want float64
	}{
		{"none", nil, 7},
		{"2.5", func() float64 { return 2.5 }, 2.5},
		{"0", func() float64 { return 0 }, 0},
	} {
		set := testSet(t, 4)
		p := newTestPrefix(DefaultPrefixParams())
		p.Meshed(func() bool { return true }, func() int { return 7 }, func() int { return 0 }, tc.echo)
		d := p.Pick(request(system(29, 4*testBlock)+"a new question"), set)
		if d.Prefill == 0 {
			t.Fatal("a new prompt left nothing to compute")
		}
		if got, want := d.Endpoint.UnheardPrefill(), int64(tc.want*float64(d.Prefill)); got != want {
			t.Errorf("echo %s: %d tokens of the others' prefill counted unheard at the pick's endpoint, want %d", tc.name, got, want)
		}
	}
}
