package proxy

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/localengine"
	"github.com/kvroute/kvroute/discovery"
)

// TestHoldForABusySlot runs kvroute in front of a real llama-server (its
// default four slots; skipped where ../shared/engines is absent). A
// request whose prompt the server keeps only in the slot of a request
// still running would compute it afresh in another slot (the engine does
// not share a running slot's prompt); kvroute holds it until that request
// ends, and the server then answers it from cache.
func TestHoldForABusySlot(t *testing.T) {
	cacheRAM := 64
	url := startRealEngine(t, localengine.Settings{Engine: localengine.LlamaCpp, CacheRAMMiB: &cacheRAM})
	h := startFleetProxyWith(t, "prefix", DefaultLimits(), discovery.Options{
		Health: discovery.HealthConfig{Interval: 50 * time.Millisecond, Timeout: 2 * time.Second},
		Models: discovery.ModelsConfig{Interval: 50 * time.Millisecond, Timeout: 2 * time.Second},
	}, url)
	e := h.fleet.Pool().Load().Endpoints[0]
	for deadline := time.Now().Add(30 * time.Second); e.Dialect() != discovery.DialectLlamaCpp || e.Info() == nil || e.Info().Slots == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("llama.cpp and its slots not detected")
		}
	}
	prompt := strings.Repeat("The quick brown fox jumps over the lazy dog near the river bank. ", 60)
	// stream sends a streamed completion of the prompt and question, and
	// returns its body once the first event came. A few tokens out: a
	// turn is far shorter than the prompt's cold prefill, on a busy
	// machine too.
	stream := func(q string) *bufio.Reader {
		body := fmt.Sprintf(`{"model":"tiny","prompt":%q,"max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}`, prompt+q)
		resp := post(t, h.url+"/v1/completions", body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, readAll(t, resp))
		}
		t.Cleanup(func() { _ = resp.Body.Close() })
		rd := bufio.NewReader(resp.Body)
		if _, err := rd.ReadString('\n'); err != nil {
			t.Fatal(err)
		}
		return rd
	}
	// cached reads the rest of a stream and returns the cached tokens its
	// usage reported.
	cached := func(rd *bufio.Reader) int {
		n := -1
		for {
			line, err := rd.ReadString('\n')
			if err != nil {
				return n
			}
			var ev struct {
				Usage *struct {
					Details struct {
						Cached int `json:"cached_tokens"`
					} `json:"prompt_tokens_details"`
				} `json:"usage"`
			}
			if d, ok := strings.CutPrefix(strings.TrimSpace(line), "data: "); ok && json.Unmarshal([]byte(d), &ev) == nil && ev.Usage != nil {
				n = ev.Usage.Details.Cached
			}
		}
	}
	// Warm: the prompt cached, the endpoint's costs measured.
	for i := range 6 {
		cached(stream(fmt.Sprintf(" Warm-up question %d?", i)))
	}
	// The first request's 8 tokens may end before the second picks (then
	// its slot is free and nothing holds, rightly: 5 of 63 runs): up to
	// three pairs, until one holds.
	ended := func() float64 {
		return counterValue(t, h.reg, "kvroute_prompt_holds_total", map[string]string{"outcome": "ended"})
	}
	for i := 0; i < 3 && ended() == 0; i++ {
		a := stream(fmt.Sprintf(" First question %d?", i))
		b := stream(fmt.Sprintf(" Second question %d?", i)) // sent while the first decodes
		cached(a)
		if n := cached(b); n < 1000 {
			t.Errorf("the second request's cached tokens: %d; want the prompt's (it waited for the first)", n)
		}
	}
	if n := ended(); n != 1 {
		t.Errorf("holds ended: %v, want 1", n)
	}
}

// startRealEngine starts one real server of s until the test ends and
// returns its base URL; the test is skipped where ../shared/engines is
// absent.
func startRealEngine(t *testing.T, s localengine.Settings) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srv, err := localengine.Start(ctx, s, 1)
	if errors.Is(err, localengine.ErrNoBinary) {
		t.Skipf("the real %s is not at hand (it is in the workplace's ../shared/engines): %v", s.Engine, err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := srv.Close(); err != nil {
			t.Errorf("stopping %s: %v", s.Engine, err)
		}
	})
	return srv.URLs()[0]
}
