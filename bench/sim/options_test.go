package sim

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// generationOption is one case of TestGenerationOptions: body posted to
// path on a pod configured by cfg (sped up), answered with choices choices
// that check checks (a stream's events instead, when body streams).
type generationOption struct {
	name    string
	cfg     Config
	path    string
	body    string
	choices int
	check   func(t *testing.T, r completionJSON, events []string)
}

func TestGenerationOptions(t *testing.T) {
	tests := []generationOption{
		{
			name: "default max_tokens for completions", path: "/v1/completions", choices: 1,
			body: `{"prompt":"x"}`,
			check: func(t *testing.T, r completionJSON, _ []string) {
				if r.Usage.CompletionTokens != 16 {
					t.Errorf("completion tokens %d, want vLLM's default 16", r.Usage.CompletionTokens)
				}
			},
		},
		{
			name: "default max_tokens for chat", path: "/v1/chat/completions", choices: 1,
			body: `{"messages":[{"role":"user","content":"x"}]}`,
			check: func(t *testing.T, r completionJSON, _ []string) {
				if r.Usage.CompletionTokens != 256 {
					t.Errorf("completion tokens %d, want 256", r.Usage.CompletionTokens)
				}
			},
		},
		{
			name: "seeded EOS stops early", cfg: Config{EOSProbability: 0.2}, path: "/v1/completions", choices: 1,
			body: `{"prompt":"x","max_tokens":200}`,
			check: func(t *testing.T, r completionJSON, _ []string) {
				n := r.Usage.CompletionTokens
				if *r.Choices[0].FinishReason != "stop" || n >= 200 || CountTokens(r.Choices[0].Text) != n-1 {
					t.Errorf("finish %s after %d tokens, text of %d tokens", *r.Choices[0].FinishReason, n, CountTokens(r.Choices[0].Text))
				}
			},
		},
		{
			name: "ignore_eos generates max_tokens", cfg: Config{EOSProbability: 0.2}, path: "/v1/completions", choices: 1,
			body: `{"prompt":"x","max_tokens":200,"ignore_eos":true}`,
			check: func(t *testing.T, r completionJSON, _ []string) {
				if *r.Choices[0].FinishReason != "length" || r.Usage.CompletionTokens != 200 {
					t.Errorf("finish %s after %d tokens", *r.Choices[0].FinishReason, r.Usage.CompletionTokens)
				}
			},
		},
		{
			name: "batched prompts and n", path: "/v1/completions", choices: 4,
			body: `{"prompt":["one two","three"],"n":2,"max_tokens":3}`,
			check: func(t *testing.T, r completionJSON, _ []string) {
				if r.Usage.CompletionTokens != 12 || r.Usage.PromptTokens != CountTokens("one two")+CountTokens("three") {
					t.Errorf("usage %+v", r.Usage)
				}
				for i, c := range r.Choices {
					if c.Index != i || CountTokens(c.Text) != 3 {
						t.Errorf("choice %d: %+v", i, c)
					}
				}
			},
		},
		{
			name: "stream interval groups tokens", cfg: Config{StreamInterval: 4}, path: "/v1/completions",
			body: `{"prompt":"x","max_tokens":10,"stream":true}`,
			check: func(t *testing.T, _ completionJSON, events []string) {
				var sizes []int
				for _, ev := range events[:len(events)-1] {
					var c completionJSON
					json.Unmarshal([]byte(ev), &c)
					sizes = append(sizes, CountTokens(c.Choices[0].Text))
				}
				if fmt.Sprint(sizes) != "[1 4 4 1]" {
					t.Errorf("tokens per delta %v, want the first token, two groups of 4, the last token", sizes)
				}
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { tc.run(t) })
	}
}

func (tc generationOption) run(t *testing.T) {
	tc.cfg.TimeScale = 1000
	_, url := servePod(t, tc.cfg)
	code, _, body := post(t, newClient(t), url+tc.path, tc.body)
	if code != 200 {
		t.Fatalf("%d %s", code, body)
	}
	if strings.Contains(tc.body, `"stream":true`) {
		tc.check(t, completionJSON{}, sseEvents(t, body))
		return
	}
	r := decodeCompletion(t, body)
	if len(r.Choices) != tc.choices {
		t.Fatalf("%d choices, want %d", len(r.Choices), tc.choices)
	}
	for i := range r.Choices {
		if r.Choices[i].Text == "" {
			r.Choices[i].Text = r.Choices[i].Message.Content
		}
	}
	tc.check(t, r, nil)
}
