package kvevents_test

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/kvevents"
	"github.com/kvroute/kvroute/prefix"
)

// The tokenizer's tests are of package kvevents_test: they run the
// simulated engine (bench/sim), which imports kvevents for its ZMTP.

// startSimFleet serves n simulated pods until the test ends.
func startSimFleet(t testing.TB, n int, cfg sim.Config) *sim.Fleet {
	t.Helper()
	fleet, err := sim.StartFleet(n, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fleet.Close() })
	return fleet
}

// instantAnswer is a fasthttp server on loopback that answers every
// request at once with the JSON answer.
func instantAnswer(tb testing.TB, answer string) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	s := &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
		ctx.SetContentType("application/json")
		ctx.SetBodyString(answer)
	}}
	go func() { _ = s.Serve(ln) }()
	tb.Cleanup(func() { _ = s.Shutdown() })
	return "http://" + ln.Addr().String()
}

// recordingLinker is prefix.Truth with its calls observed: it links, and
// tells the test when a link or a failure arrived.
type recordingLinker struct {
	*prefix.Truth
	mu     sync.Mutex
	tokens [][]uint32
	failed int
	done   chan struct{}
}

func (l *recordingLinker) Link(lora string, hashes []uint64, promptBytes int, tokens []uint32) {
	l.Truth.Link(lora, hashes, promptBytes, tokens)
	l.mu.Lock()
	l.tokens = append(l.tokens, tokens)
	l.mu.Unlock()
	l.done <- struct{}{}
}

func (l *recordingLinker) Unlinked(hashes []uint64, retry bool) {
	l.Truth.Unlinked(hashes, retry)
	l.mu.Lock()
	l.failed++
	l.mu.Unlock()
	l.done <- struct{}{}
}

// TestTokenizerLinksWhatWasForwarded: an offered completion body is
// tokenized by the engine it was forwarded to, once, and the tokens are
// the engine's.
func TestTokenizerLinksWhatWasForwarded(t *testing.T) {
	fleet := startSimFleet(t, 1, sim.DefaultConfig())
	ep, err := discovery.NewEndpoint(fleet.URLs()[0], discovery.RoleMixed)
	if err != nil {
		t.Fatal(err)
	}
	index := prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: 64})
	l := &recordingLinker{Truth: prefix.NewTruth(index, prefix.TruthConfig{BlockBytes: 64}), done: make(chan struct{}, 4)}
	// One endpoint on engine truth, or nothing is worth linking.
	l.Stored(ep.ID, 0, false, []uint64{1}, make([]uint32, 16), 16, "", 0)
	tok := kvevents.NewTokenizer(l, kvevents.TokenizerConfig{Rate: 1000})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); tok.Run(ctx) }()
	defer func() { cancel(); <-done }()

	text := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 20)
	body := []byte(`{"model":"` + sim.DefaultConfig().Model + `","prompt":"` + text + `","max_tokens":4,"stream":true}`)
	hashes := []uint64{11, 12, 13}
	tok.Offer(ep, "", hashes, len(text), body)
	tok.Offer(ep, "", hashes, len(text), body) // under way: not offered twice
	select {
	case <-l.done:
	case <-time.After(10 * time.Second):
		t.Fatal("the offer was never tokenized")
	}
	if st := tok.Stats(); st.OK != 1 || st.Failed != 0 {
		t.Fatalf("stats %+v, want one tokenization", st)
	}
	want := sim.Tokenize(text, sim.DefaultConfig().VocabSize)
	if got := l.tokens[0]; len(got) != len(want) || got[0] != want[0] || got[len(got)-1] != want[len(want)-1] {
		t.Fatalf("tokens %d (first %d), want the engine's %d (first %d)", len(got), got[0], len(want), want[0])
	}
	if l.NeedsLink(hashes) {
		t.Fatal("a linked chain is asked for again")
	}

	// An engine that cannot tokenize: the chain is not asked for again on
	// every request.
	bad, _ := discovery.NewEndpoint("http://127.0.0.1:1", discovery.RoleMixed)
	other := []uint64{21, 22}
	tok.Offer(bad, "", other, 100, body)
	select {
	case <-l.done:
	case <-time.After(10 * time.Second):
		t.Fatal("the failed offer was never ended")
	}
	if tok.Stats().Failed != 1 || l.NeedsLink(other) {
		t.Fatalf("a failed tokenization: stats %+v; the chain must not be asked for again at once", tok.Stats())
	}
}

// TestTokenizeBadAnswers: whatever an engine answers to /tokenize is an
// error or tokens, never a crash.
func TestTokenizeBadAnswers(t *testing.T) {
	for _, c := range []struct{ name, answer string }{
		{"no tokens", `{"id":"cmpl-0","object":"text_completion","choices":[{"index":0,"text":" a city.","finish_reason":"length"}]}`},
		{"tokens not an array", `{"tokens":7}`},
		{"a token not an id", `{"tokens":[1,-2]}`},
		{"a token too large", `{"tokens":[4294967296]}`},
		{"not JSON", `tokens`},
	} {
		t.Run(c.name, func(t *testing.T) {
			ep, err := discovery.NewEndpoint(instantAnswer(t, c.answer), discovery.RoleMixed)
			if err != nil {
				t.Fatal(err)
			}
			toks, err := kvevents.Tokenize(&fasthttp.HostClient{Addr: ep.Addr}, ep, []byte(`{"prompt":"x"}`), 5*time.Second)
			if !errors.Is(err, kvevents.ErrTokenize) {
				t.Fatalf("tokens %v, err %v: want ErrTokenize", toks, err)
			}
		})
	}
}
