package proxy

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/kvroute/kvroute/bench/sim"
)

// The near-identical prompt detector: a system prompt sent again with CRLF
// line endings (or a BOM, or trailing blanks) is counted as a near miss by
// model and logged with where the bytes first differ, never the text; the
// same bytes again, or another text, are not.
func TestNearIdenticalPrompts(t *testing.T) {
	fleet := startSimFleet(t, 1, sim.Config{TimeScale: 1000, Model: "m"})
	core, logs := observer.New(zapcore.InfoLevel)
	h := startProxy(t, nil, Options{Logger: zap.New(core), NearMissBlocks: 4}, fleet.URL(0))
	system := strings.Repeat("You are the support assistant of Example Corp.\nAnswer briefly and politely.\n", 60)
	chat := func(sys, user string) {
		t.Helper()
		body := `{"model":"m","max_tokens":1,"messages":[{"role":"system","content":` + jsonString(sys) + `},{"role":"user","content":"` + user + `"}]}`
		resp, err := http.Post(h.url+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	nearMisses := func() float64 {
		return counterValue(t, h.reg, "kvroute_prompt_near_misses_total", map[string]string{"model": "m"})
	}
	chat(system, "first")
	chat(system, "second") // the same bytes
	chat(strings.Replace(system, "support", "sales", 1), "another text")
	if n := nearMisses(); n != 0 {
		t.Fatalf("%v near misses before any near-identical prompt", n)
	}
	chat(strings.ReplaceAll(system, "\n", "\r\n"), "CRLF")
	chat("\uFEFF"+system, "BOM")
	if n := nearMisses(); n != 2 {
		t.Errorf("%v near misses, want 2", n)
	}
	lines := logs.FilterMessageSnippet("near-identical prompt prefix").All()
	if len(lines) != 1 { // one per interval
		t.Fatalf("%d near-miss log lines, want 1", len(lines))
	}
	f := lines[0].ContextMap()
	if f["model"] != "m" || f["normalised_blocks_matched"] != int64(4) || f["exact_blocks_matched"] != int64(0) {
		t.Errorf("log fields %v", f)
	}
	for _, v := range f {
		if s, ok := v.(string); ok && strings.Contains(s, "Example Corp") {
			t.Errorf("the log line quotes the prompt: %v", f)
		}
	}
}

func jsonString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}
