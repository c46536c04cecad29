package proxy

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvroute/kvroute/discovery"
)

// fakeOllama is a loopback server speaking Ollama's wire as seen on v0.24:
// no /health, /api/version, /v1/models listing "tiny:latest", and a
// completion that echoes the model name it was sent.
func fakeOllama(t *testing.T) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var completions atomic.Int64
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/api/version":
			fmt.Fprint(w, `{"version":"0.24.0"}`)
		case "/v1/models":
			fmt.Fprint(w, `{"object":"list","data":[{"id":"tiny:latest","object":"model","created":1796283923,"owned_by":"library"}]}`)
		case "/v1/completions":
			completions.Add(1)
			var body struct {
				Model string `json:"model"`
			}
			b, _ := io.ReadAll(r.Body)
			_ = json.Unmarshal(b, &body)
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"id":"cmpl-1","object":"text_completion","model":%q,"choices":[{"text":"x","index":0,"finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`, body.Model)
		default:
			w.WriteHeader(http.StatusNotFound)
			fmt.Fprint(w, "404 page not found")
		}
	}))
	t.Cleanup(s.Close)
	return s, &completions
}

// TestOllamaModelNames: behind kvroute with default discovery, Ollama
// servers listing "tiny:latest" serve requests for "tiny", "TINY",
// "tiny:latest" and "library/tiny", forwarded with the client's spelling;
// "nope" gets kvroute's own OpenAI-style 404 without reaching them; and
// /v1/models lists the model once for all of them.
func TestOllamaModelNames(t *testing.T) {
	var backends []string
	var hits []*atomic.Int64
	for range 4 {
		s, n := fakeOllama(t)
		backends, hits = append(backends, s.URL), append(hits, n)
	}
	h := startFleetProxyWith(t, "prefix", DefaultLimits(), discovery.Options{
		Health: discovery.HealthConfig{Interval: 5 * time.Millisecond, Timeout: time.Second},
		Scrape: discovery.ScrapeConfig{Interval: 5 * time.Millisecond, StaleAfter: time.Minute},
		Models: discovery.ModelsConfig{Interval: 5 * time.Millisecond, Timeout: time.Second},
	}, backends...)
	f, url := h.fleet, h.url
	ready := func() bool {
		for _, e := range f.Pool().Load().Endpoints {
			if e.Dialect() != discovery.DialectOllama || e.Models() == nil {
				return false
			}
		}
		return true
	}
	for deadline := time.Now().Add(guardWait); !ready(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("Ollama endpoints not detected: %+v", f.Endpoints())
		}
	}

	for i, model := range []string{"tiny", "TINY", "tiny:latest", "library/tiny"} {
		resp := post(t, url+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"hello %d","max_tokens":1}`, model, i))
		body := readAll(t, resp)
		var got struct {
			Model string `json:"model"`
		}
		if resp.StatusCode != http.StatusOK || json.Unmarshal([]byte(body), &got) != nil || got.Model != model {
			t.Errorf("model %q: status %d, body %s; want 200 echoing %q", model, resp.StatusCode, body, model)
		}
	}
	var before int64
	for _, n := range hits {
		before += n.Load()
	}
	assertOpenAIError(t, post(t, url+"/v1/completions", `{"model":"nope","prompt":"hello","max_tokens":1}`), http.StatusNotFound)
	var after int64
	for _, n := range hits {
		after += n.Load()
	}
	if before != 4 || after != before {
		t.Errorf("completions reaching the servers: %d, then %d after nope; want 4, 4", before, after)
	}

	resp, err := testClient.Get(url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if body := readAll(t, resp); json.Unmarshal([]byte(body), &list) != nil || len(list.Data) != 1 || list.Data[0].ID != "tiny:latest" {
		t.Errorf("/v1/models: %s; want one entry, tiny:latest", body)
	}
}
