package llmd

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// binary returns the simulator or skips the test where it is absent.
func binary(t *testing.T) string {
	t.Helper()
	bin, err := Binary("")
	if errors.Is(err, ErrNoBinary) {
		t.Skipf("external engine absent (%v): the llm-d simulator is in the workplace's ../shared/engines, not in the repository", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

func TestArgs(t *testing.T) {
	s := Settings{Model: "m", BlockSize: 16, KVBlocks: 256, MaxNumSeqs: 4, MaxModelLen: 4096,
		PrefillOverhead: 5 * time.Millisecond, PrefillPerToken: 50 * time.Microsecond, InterTokenLatency: 7 * time.Millisecond,
		LoRAs: []string{"a"}, MaxLoRAs: 2}
	got := strings.Join(s.Args(8000), " ")
	for _, want := range []string{"--model m", "--port 8000", "--kv-cache-size 256", "--max-num-seqs 4", "--enable-kvcache",
		"--prefill-time-per-token 50µs", "--inter-token-latency 7ms", `--lora-modules {"name":"a","path":"/lora/a"}`, "--max-loras 2"} {
		if !strings.Contains(got, want) {
			t.Errorf("args %q lack %q", got, want)
		}
	}
}

// TestFleet starts two real simulator processes and checks what the
// benchmark relies on: completions by the served name, a prefix cache that
// reports cached tokens on a repeated prompt, vLLM's prefix-cache counters,
// and the KV capacity it was given.
func TestFleet(t *testing.T) {
	bin := binary(t)
	s := Settings{Model: "sim-model", BlockSize: 16, KVBlocks: 128, MaxNumSeqs: 4, MaxModelLen: 4096,
		PrefillOverhead: time.Millisecond, PrefillPerToken: 10 * time.Microsecond, InterTokenLatency: time.Millisecond, Seed: 1}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	f, err := Start(ctx, bin, []Settings{s, s})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := f.Close(); err != nil {
			t.Error(err)
		}
	}()
	urls := f.URLs()
	if len(urls) != 2 || urls[0] == urls[1] || !strings.HasPrefix(urls[0], "http://127.0.0.1:") {
		t.Fatalf("urls %v", urls)
	}
	prompt := strings.Repeat("alpha beta gamma delta ", 40) // 160 tokens: 10 blocks
	body := `{"model":"sim-model","prompt":"` + prompt + `","max_tokens":4,"ignore_eos":true}`
	cached := func(u string) int {
		t.Helper()
		resp, err := http.Post(u+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var r struct {
			Usage struct {
				PromptTokens  int `json:"prompt_tokens"`
				CompletionTok int `json:"completion_tokens"`
				Details       struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&r); err != nil || resp.StatusCode != 200 {
			t.Fatalf("status %d, %v", resp.StatusCode, err)
		}
		if r.Usage.PromptTokens != 160 || r.Usage.CompletionTok != 4 {
			t.Fatalf("usage %+v", r.Usage)
		}
		return r.Usage.Details.Cached
	}
	if c := cached(urls[0]); c != 0 {
		t.Fatalf("cold prompt: %d cached", c)
	}
	if c := cached(urls[0]); c < 144 {
		t.Fatalf("repeated prompt: %d cached, want ≥ 144 (9 full blocks)", c)
	}
	if c := cached(urls[1]); c != 0 {
		t.Fatalf("other pod: %d cached", c)
	}
	resp, err := http.Get(urls[0] + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	text, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`num_gpu_blocks="128"`, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"} {
		if !bytes.Contains(text, []byte(want)) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	resp, err = http.Post(urls[0]+"/v1/completions", "application/json", strings.NewReader(`{"model":"other","prompt":"x"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("unknown model: status %d, want 404", resp.StatusCode)
	}
}

func TestBinaryMissingPath(t *testing.T) {
	if _, err := Binary("/nonexistent/llm-d-inference-sim"); !errors.Is(err, ErrNoBinary) {
		t.Fatalf("err %v, want ErrNoBinary", err)
	}
}
