package sim

import (
	"bytes"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
)

// keySet returns the sorted keys of a JSON object.
func keySet(t *testing.T, raw []byte) []string {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatalf("not a JSON object: %s: %v", raw, err)
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// field returns the raw JSON at a path of object keys and array indexes ("0").
func field(t *testing.T, raw []byte, path ...string) []byte {
	t.Helper()
	cur := json.RawMessage(raw)
	for _, p := range path {
		if len(cur) > 0 && cur[0] == '[' {
			var arr []json.RawMessage
			if err := json.Unmarshal(cur, &arr); err != nil || len(arr) == 0 {
				t.Fatalf("path %v: %s is not a non-empty array", path, cur)
			}
			cur = arr[0]
			continue
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal(cur, &m); err != nil {
			t.Fatalf("path %v: %s: %v", path, cur, err)
		}
		v, ok := m[p]
		if !ok {
			t.Fatalf("path %v: key %q missing in %s", path, p, cur)
		}
		cur = v
	}
	return cur
}

func readWire(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(wireDir(t), name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// wireEvents returns the JSON data events of a captured SSE transcript,
// skipping the author's "..." elisions and [DONE].
func wireEvents(t *testing.T, name string) [][]byte {
	t.Helper()
	var out [][]byte
	for _, line := range strings.Split(string(readWire(t, name)), "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if ok && data != "[DONE]" {
			out = append(out, []byte(data))
		}
	}
	return out
}

// requireSuperset fails unless have ⊇ want.
func requireSuperset(t *testing.T, what string, have, want []string) {
	t.Helper()
	for _, k := range want {
		if !slices.Contains(have, k) {
			t.Errorf("%s: key %q of the vLLM sample missing; have %v", what, k, have)
		}
	}
}

// requireSubset fails unless have ⊆ allowed.
func requireSubset(t *testing.T, what string, have, allowed []string) {
	t.Helper()
	for _, k := range have {
		if !slices.Contains(allowed, k) {
			t.Errorf("%s: key %q is not in any vLLM sample (%v)", what, k, allowed)
		}
	}
}

func union(sets ...[]string) []string {
	var out []string
	for _, s := range sets {
		for _, k := range s {
			if !slices.Contains(out, k) {
				out = append(out, k)
			}
		}
	}
	return out
}

func TestWireNonStreaming(t *testing.T) {
	_, url := servePod(t, fastConfig())
	c := newClient(t)
	pd := readWire(t, "pd-prefill-response.json")
	tests := []struct {
		name   string
		path   string
		body   string
		sample string
		paths  [][]string // objects whose key sets must match the sample's
	}{
		{
			name: "completion", path: "/v1/completions", sample: "completion.json",
			body:  `{"model":"meta-llama/Llama-3.1-8B-Instruct","prompt":"San Francisco is a","max_tokens":32}`,
			paths: [][]string{{}, {"choices", "0"}, {"usage"}},
		},
		{
			name: "chat", path: "/v1/chat/completions", sample: "chat-completion.json",
			body:  `{"messages":[{"role":"user","content":[{"type":"text","text":"What is in the image?"},{"type":"image_url","image_url":{"url":"x"}}]}],"max_tokens":40}`,
			paths: [][]string{{}, {"choices", "0"}, {"choices", "0", "message"}, {"usage"}},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, hdr, body := post(t, c, url+tc.path, tc.body)
			if code != 200 {
				t.Fatalf("status %d: %s", code, body)
			}
			if ct := hdr.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
				t.Errorf("Content-Type %q", ct)
			}
			sample := readWire(t, tc.sample)
			for _, p := range tc.paths {
				have := keySet(t, field(t, body, p...))
				want := keySet(t, field(t, sample, p...))
				allowed := want
				if tc.name == "completion" {
					// the newest sample (PD prefill, 2026) adds fields to the older one
					allowed = union(want, keySet(t, field(t, pd, p...)))
				} else if len(p) == 0 {
					allowed = union(want, []string{"service_tier", "system_fingerprint"})
				}
				requireSuperset(t, strings.Join(p, "."), have, want)
				requireSubset(t, strings.Join(p, "."), have, allowed)
			}
			u := decodeCompletion(t, body).Usage
			if u.cached() < 0 {
				t.Errorf("usage.prompt_tokens_details.cached_tokens missing: %s", body)
			}
			if u.TotalTokens != u.PromptTokens+u.CompletionTokens {
				t.Errorf("usage does not add up: %+v", u)
			}
		})
	}
}

func TestWireStreaming(t *testing.T) {
	_, url := servePod(t, fastConfig())
	c := newClient(t)
	tests := []struct {
		name      string
		path      string
		body      string
		sample    string
		maxTokens int
		chat      bool
	}{
		{name: "completion", path: "/v1/completions", sample: "completion-stream.sse", maxTokens: 7,
			body: `{"prompt":"San Francisco is a","max_tokens":7,"stream":true,"stream_options":{"include_usage":true}}`},
		{name: "chat", path: "/v1/chat/completions", sample: "chat-completion-stream.sse", maxTokens: 5, chat: true,
			body: `{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":5,"stream":true,"stream_options":{"include_usage":true}}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req, _ := http.NewRequest(http.MethodPost, url+tc.path, strings.NewReader(tc.body))
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			var buf bytes.Buffer
			_, err = buf.ReadFrom(resp.Body)
			resp.Body.Close()
			if err != nil {
				t.Fatal(err)
			}
			if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
				t.Errorf("Content-Type %q", ct)
			}
			if !slices.Contains(resp.TransferEncoding, "chunked") {
				t.Errorf("Transfer-Encoding %v, want chunked", resp.TransferEncoding)
			}
			events := sseEvents(t, buf.Bytes())
			if n := len(events); n < 2 || events[n-1] != "[DONE]" {
				t.Fatalf("stream does not end with [DONE]: %q", events)
			}
			usageChunk := []byte(events[len(events)-2])
			chunks := events[:len(events)-2]
			if string(field(t, usageChunk, "choices")) != "[]" {
				t.Errorf("usage chunk choices = %s, want []", field(t, usageChunk, "choices"))
			}
			var u struct{ Usage usageJSON }
			if err := json.Unmarshal(usageChunk, &u); err != nil {
				t.Fatal(err)
			}
			if u.Usage.CompletionTokens != tc.maxTokens || u.Usage.cached() < 0 {
				t.Errorf("usage %+v, want %d completion tokens and cached_tokens", u.Usage, tc.maxTokens)
			}
			// One token per delta: chat has one extra role chunk.
			wantChunks := tc.maxTokens
			if tc.chat {
				wantChunks++
			}
			if len(chunks) != wantChunks {
				t.Errorf("%d chunks, want %d", len(chunks), wantChunks)
			}
			samples := wireEvents(t, tc.sample)
			var sTop, sChoice, sDelta, oTop, oChoice, oDelta []string
			for _, s := range samples {
				sTop = union(sTop, keySet(t, s))
				sChoice = union(sChoice, keySet(t, field(t, s, "choices", "0")))
				if tc.chat {
					sDelta = union(sDelta, keySet(t, field(t, s, "choices", "0", "delta")))
				}
			}
			for i, ch := range chunks {
				top := keySet(t, []byte(ch))
				choice := keySet(t, field(t, []byte(ch), "choices", "0"))
				oTop, oChoice = union(oTop, top), union(oChoice, choice)
				requireSubset(t, "chunk", top, sTop)
				requireSubset(t, "chunk.choices.0", choice, sChoice)
				if tc.chat {
					oDelta = union(oDelta, keySet(t, field(t, []byte(ch), "choices", "0", "delta")))
				}
				last := i == len(chunks)-1
				fr := string(field(t, []byte(ch), "choices", "0", "finish_reason"))
				if last != (fr != "null") {
					t.Errorf("chunk %d finish_reason %s", i, fr)
				}
			}
			requireSuperset(t, "chunks", oTop, sTop)
			requireSuperset(t, "chunks.choices.0", oChoice, sChoice)
			requireSuperset(t, "chunks.choices.0.delta", oDelta, sDelta)
			if tc.chat && string(field(t, []byte(chunks[0]), "choices", "0", "delta")) != `{"role":"assistant","content":""}` {
				t.Errorf("first chat chunk %s", chunks[0])
			}
		})
	}
}

func TestWireErrorsAndModels(t *testing.T) {
	_, url := servePod(t, fastConfig())
	c := newClient(t)
	envelope := readWire(t, "error-400.json")
	tests := []struct {
		name, path, body string
		status           int
		typ              string
	}{
		{"unknown model", "/v1/completions", `{"model":"nope","prompt":"x"}`, 404, "NotFoundError"},
		{"too long", "/v1/completions", `{"prompt":[1,2,3],"max_tokens":40000}`, 400, "BadRequestError"},
		{"bad json", "/v1/chat/completions", `{"messages":`, 400, "BadRequestError"},
		{"max_tokens 0", "/v1/completions", `{"prompt":"x","max_tokens":0}`, 400, "BadRequestError"},
		{"stream options without stream", "/v1/completions", `{"prompt":"x","stream_options":{"include_usage":true}}`, 400, "BadRequestError"},
		{"empty messages", "/v1/chat/completions", `{"messages":[]}`, 400, "BadRequestError"},
		{"token out of vocab", "/v1/completions", `{"prompt":[999999999]}`, 400, "BadRequestError"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, _, body := post(t, c, url+tc.path, tc.body)
			if code != tc.status {
				t.Fatalf("status %d, want %d: %s", code, tc.status, body)
			}
			if got, want := keySet(t, body), keySet(t, envelope); !slices.Equal(got, want) {
				t.Errorf("envelope keys %v, want %v", got, want)
			}
			inner := field(t, body, "error")
			if got, want := keySet(t, inner), keySet(t, field(t, envelope, "error")); !slices.Equal(got, want) {
				t.Errorf("error keys %v, want %v", got, want)
			}
			var e struct {
				Error struct {
					Type string
					Code int
				}
			}
			json.Unmarshal(body, &e)
			if e.Error.Type != tc.typ || e.Error.Code != tc.status {
				t.Errorf("error %+v, want %s/%d", e.Error, tc.typ, tc.status)
			}
		})
	}
	t.Run("models", func(t *testing.T) {
		code, body := get(t, c, url+"/v1/models")
		if code != 200 {
			t.Fatalf("status %d", code)
		}
		sample := readWire(t, "models.json")
		for _, p := range [][]string{{}, {"data", "0"}, {"data", "0", "permission", "0"}} {
			if got, want := keySet(t, field(t, body, p...)), keySet(t, field(t, sample, p...)); !slices.Equal(got, want) {
				t.Errorf("%v keys %v, want %v", p, got, want)
			}
		}
	})
	t.Run("health", func(t *testing.T) {
		if code, body := get(t, c, url+"/health"); code != 200 || len(body) != 0 {
			t.Errorf("health %d %q", code, body)
		}
	})
	t.Run("tokenize", func(t *testing.T) {
		code, _, body := post(t, c, url+"/tokenize", `{"prompt":"Hello world"}`)
		if code != 200 {
			t.Fatalf("status %d: %s", code, body)
		}
		var r struct {
			Count  int
			Tokens []uint32
		}
		json.Unmarshal(body, &r)
		if want := Tokenize("Hello world", 128256); r.Count != len(want) || !slices.Equal(r.Tokens, want) {
			t.Errorf("tokenize %s, want %v", body, want)
		}
	})
}

func TestWireMetrics(t *testing.T) {
	_, url := servePod(t, fastConfig())
	c := newClient(t)
	post(t, c, url+"/v1/completions", `{"prompt":"warm up","max_tokens":2}`)
	ours := scrape(t, c, url)
	ref := parseMetrics(t, readWire(t, "vllm-metrics.txt"))
	required := []string{
		"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
		"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:cache_config_info",
		"vllm:time_to_first_token_seconds", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
		"process_start_time_seconds",
	}
	for _, name := range required {
		if _, ok := ours[name]; !ok {
			t.Errorf("metric %s missing", name)
		}
	}
	labelNames := func(name string, mfs map[string]*dtoFamily) []string {
		var out []string
		for _, m := range mfs[name].GetMetric() {
			for _, l := range m.GetLabel() {
				if !slices.Contains(out, l.GetName()) {
					out = append(out, l.GetName())
				}
			}
		}
		sort.Strings(out)
		return out
	}
	for name, mf := range ours {
		rf, ok := ref[name]
		if !ok {
			if strings.HasPrefix(name, "vllm:") && name != "vllm:nixl_num_failed_transfers" {
				t.Errorf("metric %s is not in the vLLM scrape", name)
			}
			continue
		}
		if mf.GetType() != rf.GetType() {
			t.Errorf("%s type %v, vLLM %v", name, mf.GetType(), rf.GetType())
		}
		if mf.GetHelp() != rf.GetHelp() {
			t.Errorf("%s help %q, vLLM %q", name, mf.GetHelp(), rf.GetHelp())
		}
		got, want := labelNames(name, ours), labelNames(name, ref)
		if name == "vllm:cache_config_info" {
			requireSubset(t, name, got, want)
			requireSuperset(t, name, got, []string{"block_size", "engine", "num_gpu_blocks"})
			continue
		}
		if !slices.Equal(got, want) {
			t.Errorf("%s labels %v, vLLM %v", name, got, want)
		}
		if mf.GetType() == dtoHistogram {
			var gb, wb []float64
			for _, b := range mf.GetMetric()[0].GetHistogram().GetBucket() {
				gb = append(gb, b.GetUpperBound())
			}
			for _, b := range rf.GetMetric()[0].GetHistogram().GetBucket() {
				wb = append(wb, b.GetUpperBound())
			}
			if !slices.Equal(gb, wb) {
				t.Errorf("%s buckets %v, vLLM %v", name, gb, wb)
			}
		}
	}
}
