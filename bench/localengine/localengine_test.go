package localengine

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

// skipWithout skips the test where the workplace's shared/engines is
// absent (a user's clone).
func skipWithout(t *testing.T, engines ...string) {
	t.Helper()
	for _, e := range engines {
		_, err := Find(e)
		if errors.Is(err, ErrNoBinary) {
			t.Skipf("real engine %s absent (%v): Ollama and llama-server are in the workplace's ../shared/engines, not in the repository", e, err)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

func TestSettings(t *testing.T) {
	ram := 8
	for _, tc := range []struct {
		name     string
		s        Settings
		args     string // the command line after the binary, or Ollama's environment's tail
		tag, bad string
	}{
		{name: "ollama default", s: Settings{Engine: Ollama}, args: "OLLAMA_NUM_PARALLEL=1", tag: "ollama"},
		{name: "ollama parallel", s: Settings{Engine: Ollama, NumParallel: 4}, args: "OLLAMA_NUM_PARALLEL=4", tag: "ollama-parallel-4"},
		{name: "llama default", s: Settings{Engine: LlamaCpp},
			args: "-m M --alias tiny --host 127.0.0.1 --port 9 -t 1 -c 8192", tag: "llamacpp"},
		{name: "llama flags", s: Settings{Engine: LlamaCpp, Slots: 1, CacheRAMMiB: &ram, Metrics: true},
			args: "-c 8192 -np 1 --cache-ram 8 --metrics", tag: "llamacpp-np-1-cache-ram-8-metrics"},
		{name: "ollama with llama flags", s: Settings{Engine: Ollama, Slots: 1}, bad: "llama-server's"},
		{name: "unknown", s: Settings{Engine: "vllm"}, bad: "engine"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.s.Validate()
			if tc.bad != "" {
				if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tc.bad) {
					t.Fatalf("Validate = %v, want %q", err, tc.bad)
				}
				return
			}
			cmd := tc.s.command(Files{Binary: "B", Models: "M"}, 9, "/h")
			got := strings.Join(cmd.Args[1:], " ")
			if tc.s.Engine == Ollama {
				got = strings.Join(cmd.Env, " ")
				if !strings.Contains(got, "HOME=/h") || !strings.Contains(got, "OLLAMA_HOST=127.0.0.1:9") || !strings.Contains(got, "OLLAMA_MODELS=M") {
					t.Errorf("env %q", got)
				}
			}
			if err != nil || !strings.Contains(got, tc.args) || tc.s.Tag() != tc.tag {
				t.Errorf("Validate %v, command %q (want %q), tag %q (want %q)", err, got, tc.args, tc.s.Tag(), tc.tag)
			}
		})
	}
}

// TestFleets starts two llama-servers and two Ollama servers at once,
// checks that each answers a completion of the tiny model to max_tokens,
// and that Close leaves no process of theirs (Ollama's runner children
// included).
func TestFleets(t *testing.T) {
	skipWithout(t, Ollama, LlamaCpp)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	fleets := make([]*Fleet, 2)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for i, e := range Engines() {
		wg.Go(func() { fleets[i], errs[i] = Start(ctx, Settings{Engine: e}, 2) })
	}
	wg.Wait()
	for i, f := range fleets {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		urls := f.URLs()
		if len(urls) != 2 || urls[0] == urls[1] || !strings.HasPrefix(urls[0], "http://127.0.0.1:") {
			t.Errorf("%s: urls %v", f.Settings.Engine, urls)
		}
		for _, u := range urls {
			if n := completionTokens(t, u); n != 5 {
				t.Errorf("%s: %d completion tokens, want 5 (the model never stops)", u, n)
			}
		}
	}
	for _, f := range fleets {
		if err := f.Close(); err != nil {
			t.Error(err)
		}
		for _, p := range f.procs {
			if p.Lingering(5 * time.Second) {
				t.Errorf("%s: process group %d outlived Close", p.URL, p.Pid())
			}
		}
	}
}

// completionTokens sends u a completion of 5 tokens and returns the
// completion tokens it reports.
func completionTokens(t *testing.T, u string) int {
	t.Helper()
	body := `{"model":"tiny","prompt":"the quick brown fox","max_tokens":5}`
	resp, err := http.Post(u+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var r struct {
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: status %d, %v", u, resp.StatusCode, err)
	}
	return r.Usage.CompletionTokens
}
