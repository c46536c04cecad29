package discovery

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/localengine"
)

// The real engines of ../shared/engines (see their READMEs): llama.cpp's
// llama-server and Ollama, each with a tiny random-weight Llama, started
// as kvbench starts them (bench/localengine: unpacked into the module's
// bin/, one process group per server, ready and warm). The tests skip
// when the directory is absent.

// startReal starts one server of s until the test ends and returns its
// base URL.
func startReal(t *testing.T, s localengine.Settings) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	f, err := localengine.Start(ctx, s, 1)
	if errors.Is(err, localengine.ErrNoBinary) {
		t.Skipf("the real %s is not at hand: %v", s.Engine, err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := f.Close(); err != nil {
			t.Errorf("stopping %s: %v", s.Engine, err)
		}
	})
	return f.URLs()[0]
}

// startLlamaServer starts llama-server with the tiny model (with
// --metrics when metrics) and returns its base URL.
func startLlamaServer(t *testing.T, metrics bool) string {
	cacheRAM := 64
	return startReal(t, localengine.Settings{Engine: localengine.LlamaCpp, Metrics: metrics, CacheRAMMiB: &cacheRAM})
}

// startOllama starts `ollama serve` over the tiny model's store and
// returns its base URL.
func startOllama(t *testing.T) string {
	return startReal(t, localengine.Settings{Engine: localengine.Ollama})
}

// realOptions probes every 50 ms (the engines are real processes on a
// shared machine) and scrapes and reads models as often.
func realOptions() Options {
	return Options{
		Health: HealthConfig{Interval: 50 * time.Millisecond, Timeout: 2 * time.Second, Jitter: 0.01},
		Scrape: ScrapeConfig{Interval: 50 * time.Millisecond, Timeout: 2 * time.Second, StaleAfter: time.Minute},
		Models: ModelsConfig{Interval: 50 * time.Millisecond, Timeout: 2 * time.Second},
	}
}

// TestRealLlamaServer: a Fleet over the real llama-server, with and
// without --metrics, detects llama.cpp, keeps it up, reads its slots and
// context, serves any model name, and scrapes its load only when it
// exports metrics, without a failed scrape when it does not.
func TestRealLlamaServer(t *testing.T) {
	for _, metrics := range []bool{true, false} {
		t.Run("metrics="+strconv.FormatBool(metrics), func(t *testing.T) {
			url := startLlamaServer(t, metrics)
			f, rec, eps := staticFleet(t, realOptions(), url)
			e := eps[0]
			run(t, f)
			want := "absent"
			if metrics {
				want = "scraped"
			}
			rec.until(t, "llama.cpp detected, its props read, its metrics settled", func() bool {
				i := e.Info()
				return e.Dialect() == DialectLlamaCpp && i != nil && i.Slots > 0 && statusOf(f, e).Metrics == want
			})
			from := rec.mark()
			rec.wait(t, from, "probe-ok", e, 3)
			st := statusOf(f, e)
			if st.State != StateUp || st.Info.Slots != 4 || st.Info.ContextTokens != 8192 || st.Info.KVCapacityTokens != 8192 {
				t.Errorf("state %v, info %+v: want up, 4 slots, 8192 tokens", st.State, st.Info)
			}
			if !e.Serves("tiny") || !e.Serves("gpt-4o") {
				t.Error("llama-server serves any model name")
			}
			if n := rec.count(from, "scrape-fail", e) + rec.count(from, "probe-fail", e); n != 0 {
				t.Errorf("%d failed scrapes or probes once up, want none", n)
			}
			if s := e.Engine(); metrics != (s != nil) || s != nil && s.Engine != "llamacpp" {
				t.Errorf("engine stats %+v with metrics=%v", s, metrics)
			}
		})
	}
}

// TestRealOllama: a Fleet over a real Ollama server detects it, keeps it
// up although it has no /health, never fails a scrape, serves the spellings
// of its model Ollama accepts, and reads the loaded model's context.
func TestRealOllama(t *testing.T) {
	url := startOllama(t)
	f, rec, eps := staticFleet(t, realOptions(), url)
	e := eps[0]
	run(t, f)
	rec.until(t, "ollama detected, its models read", func() bool {
		return e.Dialect() == DialectOllama && e.Models() != nil
	})
	from := rec.mark()
	rec.wait(t, from, "probe-ok", e, 3)
	for m, want := range map[string]bool{"tiny": true, "TINY": true, "tiny:latest": true, "library/tiny": true, "nope": false} {
		if e.Serves(m) != want {
			t.Errorf("Serves(%q) = %v, want %v", m, !want, want)
		}
	}
	// A request loads the model (the warm-up did); /api/ps then states
	// its context.
	resp, err := http.Post(url+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"TINY","prompt":"hello","max_tokens":2}`))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("completion for TINY: %s", resp.Status)
	}
	rec.until(t, "the loaded model's context read", func() bool {
		i := e.Info()
		return i != nil && i.ContextTokens > 0
	})
	st := statusOf(f, e)
	if st.State != StateUp || st.Metrics != "absent" || st.Info.ContextTokens != 4096 || st.Info.Version != "0.24.0" {
		t.Errorf("status %+v, info %+v: want up, no metrics, context 4096, version 0.24.0", st, st.Info)
	}
	if n := rec.count(from, "scrape-fail", e) + rec.count(from, "probe-fail", e); n != 0 {
		t.Errorf("%d failed scrapes or probes once up, want none", n)
	}
}
