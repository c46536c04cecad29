package proxy

import (
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/localengine"
	"github.com/kvroute/kvroute/discovery"
)

// TestOllamaRoomIsWhatItRuns runs kvroute in front of a real Ollama server
// of one slot (OLLAMA_NUM_PARALLEL=1; skipped where ../shared/engines is
// absent). Ollama says nothing of its slots and serves no metrics: kvroute
// learns its room from what it sees it run (a stream runs from its first
// byte), so that six streams at once wait in kvroute's queue rather than
// in Ollama's, and every one is answered.
func TestOllamaRoomIsWhatItRuns(t *testing.T) {
	url := startRealEngine(t, localengine.Settings{Engine: localengine.Ollama})
	h := startFleetProxyWith(t, "prefix", DefaultLimits(), discovery.Options{
		Health: discovery.HealthConfig{Interval: 50 * time.Millisecond, Timeout: 2 * time.Second},
		Models: discovery.ModelsConfig{Interval: 50 * time.Millisecond, Timeout: 2 * time.Second},
		Scrape: discovery.ScrapeConfig{Interval: 50 * time.Millisecond, Timeout: 2 * time.Second, StaleAfter: time.Minute},
	}, url)
	e := h.fleet.Pool().Load().Endpoints[0]
	for deadline := time.Now().Add(30 * time.Second); e.Dialect() != discovery.DialectOllama || e.Models() == nil; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("Ollama and its models not detected")
		}
	}
	if _, l := e.Free(); l != discovery.SlowStart {
		t.Fatalf("room limit before anything ran: %d, want the slow start's %d", l, discovery.SlowStart)
	}
	var wg sync.WaitGroup
	status := make([]int, 6)
	for i := range status {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body := fmt.Sprintf(`{"model":"tiny","prompt":"Question %d: what is the river bank like in the morning?","max_tokens":48,"stream":true}`, i)
			resp := post(t, h.url+"/v1/completions", body)
			readAll(t, resp)
			status[i] = resp.StatusCode
		}()
	}
	wg.Wait()
	for i, s := range status {
		if s != http.StatusOK {
			t.Errorf("stream %d: status %d", i, s)
		}
	}
	// One slot: one stream runs at a time, so the limit is 2 (one more
	// than it was seen running). A stream's end read a moment after the
	// next one's first byte may show two at once: 3.
	if _, l := e.Free(); l < 2 || l >= discovery.SlowStart {
		t.Errorf("room limit after six streams on one slot: %d, want 2 (3 at most)", l)
	}
	if w := counterValue(t, h.reg, "kvroute_tenant_queue_wait_seconds_total", map[string]string{"tenant": "default"}); w <= 0 {
		t.Errorf("no request waited in kvroute's queue (%v s): the streams waited in Ollama's", w)
	}
}
