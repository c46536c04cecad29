package routing

import (
	"testing"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/prefix"
)

// chat renders messages as the proxy does, marking each one's end.
func chat(messages ...string) *Request {
	var h prefix.Hasher
	h.Reset(testBlock, 1024, prefix.Seed("m", ""))
	for _, m := range messages {
		_, _ = h.WriteString(m)
		h.Mark()
	}
	return &Request{Kind: KindChat, Model: "m", PromptBytes: h.Len(), PromptTokens: h.Len() / 4,
		Hashes: append([]uint64(nil), h.Hashes...), Marks: append([]prefix.Mark(nil), h.Marks...)}
}

// termOf returns e's term in terms.
func termOf(t *testing.T, terms []Term, e *discovery.Endpoint) Term {
	t.Helper()
	for _, tm := range terms {
		if tm.Endpoint == e.URL {
			return tm
		}
	}
	t.Fatalf("no term for %s", e.URL)
	return Term{}
}

// A conversation's turn is credited, where its previous turn went, with
// that whole prompt, not only the blocks its index holds (a turn adding
// less than a block shows no deeper block match than the shared system
// prompt, wherever its history is) — once the engine's answers showed it
// keeps sequences that far: an engine that reports no cached tokens is
// read from its TTFTs, which a credit it does not honour would skew.
func TestTurnCreditedWithItsEarlierPrompt(t *testing.T) {
	set := testSet(t, 2)
	p := newTestPrefix(DefaultPrefixParams())
	sys := system(1, 3*testBlock+100)
	turn1 := []string{sys, "user: what is a KV cache? " + system(2, 300)}
	at := p.Pick(chat(turn1...), set).Endpoint
	other := set.Endpoints[0]
	if other == at {
		other = set.Endpoints[1]
	}
	p.Index().Record(other.ID, chat(sys).Hashes) // the system prompt is held there too

	turn2 := chat(append(turn1, "assistant: attention state.", "user: and a prefix?")...)
	if _, terms := p.Explain(turn2, set); termOf(t, terms, at).HeldPromptTokens != 0 {
		t.Fatal("an earlier prompt credited before any answer showed the engine keeps one")
	}
	for range 3 { // answers show the engine keeping the latest sequence
		p.seqs.outcome(at.ID, 0, true)
	}
	d, terms := p.Explain(turn2, set)
	here, there := termOf(t, terms, at), termOf(t, terms, other)
	if here.MatchedBlocks != 3 || there.MatchedBlocks != 3 {
		t.Fatalf("blocks matched %d and %d, want 3 and 3 (the system prompt)", here.MatchedBlocks, there.MatchedBlocks)
	}
	if want := turn1Tokens(turn1); here.HeldPromptTokens != want || there.HeldPromptTokens != 0 {
		t.Fatalf("held prompt tokens %d and %d, want %d and 0", here.HeldPromptTokens, there.HeldPromptTokens, want)
	}
	if here.UncachedTokens >= there.UncachedTokens || d.Endpoint != at {
		t.Fatalf("uncached %d where the history is, %d elsewhere; picked %s, want %s",
			here.UncachedTokens, there.UncachedTokens, d.Endpoint, at)
	}
}

func turn1Tokens(turn1 []string) int { return (len(turn1[0]) + len(turn1[1])) / 4 }

// On slot engines whose learned count of sequences the live conversations
// fill, a new conversation goes to an endpoint with room, not to the one
// holding its system prompt, where it would push out a conversation that
// is still going; a turn whose earlier prompt is kept stays. Paged engines
// are left as they were.
func TestNewConversationsFillSlotEnginesFirst(t *testing.T) {
	for _, tc := range []struct {
		dialect discovery.Dialect
		moves   bool
	}{{discovery.DialectLlamaCpp, true}, {discovery.DialectOllama, true}, {discovery.DialectVLLM, false}} {
		set := testSet(t, 3)
		for _, e := range set.Endpoints {
			e.SetDialect(tc.dialect)
		}
		p := newTestPrefix(DefaultPrefixParams())
		sys := system(3, 3*testBlock+100)
		a1 := []string{sys, "user: first conversation"}
		at := p.Pick(chat(a1...), set).Endpoint
		a2 := append(a1, "assistant: yes.", "user: go on")
		if d := p.Pick(chat(a2...), set); d.Endpoint != at || d.seqDistance != 0 {
			t.Fatalf("%s: second turn on %s at distance %d, want %s at 0", tc.dialect, d.Endpoint, d.seqDistance, at)
		}
		for range 3 { // the engine keeps one sequence
			p.seqs.outcome(at.ID, 1, false)
			p.seqs.outcome(at.ID, 0, true)
		}
		if k := p.seqs.kept(at.ID); k != 1 {
			t.Fatalf("%s: kept %d sequences, want 1", tc.dialect, k)
		}
		p.seqs.mu.Lock()
		p.seqs.gap, p.seqs.gaps = 10, 1 // turns come 10 s apart: the first conversation is live
		p.seqs.mu.Unlock()
		b := p.Pick(chat(sys, "user: second conversation"), set).Endpoint
		if moved := b != at; moved != tc.moves {
			t.Fatalf("%s: a new conversation went to %s, the first's endpoint %s (moved %v, want %v)", tc.dialect, b, at, moved, tc.moves)
		}
		if tc.moves {
			if d := p.Pick(chat(append(a2, "assistant: done.", "user: thanks")...), set); d.Endpoint != at {
				t.Fatalf("%s: the first conversation's third turn left its endpoint: %s", tc.dialect, d.Endpoint)
			}
		}
	}
}

// The count of sequences pools every distance's answers: a conversation's
// turns come back at scattered distances, one answer at each.
func TestWarmthFitPoolsScatteredDistances(t *testing.T) {
	w := newWarmth()
	w.see(1, 1)
	for _, d := range []int{0, 1, 2} {
		w.outcome(1, d, true)
	}
	for _, d := range []int{5, 7, 9, 11} {
		w.outcome(1, d, false)
	}
	if k := w.kept(1); k < 3 || k > 5 {
		t.Fatalf("kept %d, want 3 to 5 (warm below 3, cold from 5)", k)
	}
}

// A sequence's outcome is read in the engine's tokens: while the learned
// bytes per token is still the prior (4) and the engine counts one token
// per 3 bytes of rendering, a report of the system prompt alone is a miss
// (read with the prior, 1,030 tokens would pass for the earlier prompt's
// 975), and of the whole earlier prompt a hit.
func TestSequenceOutcomeInEngineTokens(t *testing.T) {
	p := newTestPrefix(DefaultPrefixParams())
	e := testSet(t, 1).Endpoints[0]
	p.seqs.see(e.ID, 9)
	keptOneSequence(p, e)
	if k := p.seqs.kept(e.ID); k != 1 {
		t.Fatalf("kept %d, want 1 (warm at distance 0, cold at 1)", k)
	}
}

// keptOneSequence feeds p's sequences three answers of an engine that
// keeps one: warm at distance 0, cold at 1. Each is a 4,400-byte prompt of
// 1,467 engine tokens (one per 3 bytes) matching 3 blocks (3,072 bytes,
// 1,024 tokens), its earlier prompt 3,900 bytes (1,300 tokens), reported
// 1,310 tokens cached (warm) or 1,030 (the system prompt alone).
func keptOneSequence(p *Prefix, e *discovery.Endpoint) {
	d := Decision{Endpoint: e, MatchedBlocks: 3, PromptTokens: 1100, seqBytes: 3900}
	for range 3 {
		d.seqDistance = 0
		p.learnSequence(d, 4400, 1467, 1310)
		d.seqDistance = 1
		p.learnSequence(d, 4400, 1467, 1030)
	}
}

// Replicas learn from each other's answers: what this router's answer says
// of a sequence goes to OnOutcome, and a peer's (PeerOutcome) teaches the
// count as this router's own would; a distance out of range is ignored.
func TestPeerOutcomesTeachTheCount(t *testing.T) {
	p, q := newTestPrefix(DefaultPrefixParams()), newTestPrefix(DefaultPrefixParams())
	e := testSet(t, 1).Endpoints[0]
	p.seqs.see(e.ID, 9)
	q.seqs.see(e.ID, 9)
	p.OnOutcome(q.PeerOutcome)
	q.PeerOutcome(e.ID, -1, false)
	q.PeerOutcome(e.ID, maxWarmKeys, false)
	keptOneSequence(p, e)
	if k := q.seqs.kept(e.ID); k != 1 {
		t.Fatalf("the peer learned a count of %d from this router's answers, want 1", k)
	}
}
