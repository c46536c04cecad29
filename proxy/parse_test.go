package proxy

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

func readFile(t testing.TB, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// renderBody returns the canonical rendering of body (kind) and the parsed
// request fields.
func renderBody(t testing.TB, kind routing.Kind, body []byte) ([]byte, routing.Request) {
	t.Helper()
	var st reqState
	if err := st.parse(kind, body, 64, 1<<20); err != nil {
		t.Fatalf("parse: %v", err)
	}
	v, _ := st.parser.ParseBytes(body)
	var buf bytes.Buffer
	if err := st.render(&buf, kind, v); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes(), st.req
}

func TestParseFields(t *testing.T) {
	tests := []struct {
		name         string
		file         string
		kind         routing.Kind
		model, salt  string
		stream       bool
		includeUsage bool
		maxTokens    int
		rendering    string
	}{
		{name: "completion string", file: "completion-string.json", kind: routing.KindCompletions,
			model: "m", salt: "tenant-a", maxTokens: 32, rendering: "San Francisco is a"},
		{name: "completion tokens", file: "completion-tokens.json", kind: routing.KindCompletions,
			model: "m", maxTokens: 8,
			rendering: "\x00T\x00\xf4\x01\x00\x17\x03\x00\x00\xd0\x1a\x00\x00;\x01\x00\x00^&\x00\x00v\x01\x00\x00"},
		{name: "completion batch of token lists", file: "completion-batch.json", kind: routing.KindCompletions,
			model: "m", maxTokens: 8,
			rendering: "\x00T\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00\x1e\x00T\x04\x00\x00\x00\x05\x00\x00\x00"},
		{name: "completion strings", file: "completion-strings.json", kind: routing.KindCompletions,
			model: "m", maxTokens: 8, rendering: "first prompt\x1esecond prompt"},
		{name: "chat", file: "chat-turn1.json", kind: routing.KindChat,
			model: "meta-llama/Llama-3.1-8B-Instruct", stream: true, includeUsage: true, maxTokens: 64},
		{name: "chat max_completion_tokens", file: "chat-turn2.json", kind: routing.KindChat,
			model: "meta-llama/Llama-3.1-8B-Instruct", stream: true, maxTokens: 64},
		{name: "chat parts and tools", file: "chat-parts-tools.json", kind: routing.KindChat, model: "m",
			rendering: "\x1dtools\x1f" + `[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]` + "\x1e" +
				"\x1duser\x1fWhat is in this image? \x1cimage_url\x1f" + `{"type":"image_url","image_url":{"url":"https://example.com/cat.png"}}` + "\x1e" +
				"\x1dassistant\x1f\x1ctool_calls\x1f" + `[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]` + "\x1e" +
				"\x1dtool\x1fsunny\x1ctool_call_id\x1f\"call_1\"\x1e"},
		{name: "responses", file: "responses.json", kind: routing.KindResponses, model: "m",
			rendering: "\x1dsystem\x1fBe brief.\x1e\x1duser\x1fHello\x1e\x1dfunction_call_output\x1f" + `{"type":"function_call_output","call_id":"c1","output":"42"}` + "\x1e"},
		{name: "embeddings", file: "embeddings.json", kind: routing.KindEmbeddings, model: "m",
			rendering: "embed me\x1eand me"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, r := renderBody(t, tc.kind, readFile(t, filepath.Join("..", "testdata", "requests", tc.file)))
			if r.Model != tc.model || r.CacheSalt != tc.salt || r.Stream != tc.stream ||
				r.IncludeUsage != tc.includeUsage || r.MaxTokens != tc.maxTokens {
				t.Errorf("fields = model %q salt %q stream %v usage %v max %d", r.Model, r.CacheSalt, r.Stream, r.IncludeUsage, r.MaxTokens)
			}
			if tc.rendering != "" && string(got) != tc.rendering {
				t.Errorf("rendering\n got %q\nwant %q", got, tc.rendering)
			}
			if r.PromptBytes != len(got) || r.PromptTokens != len(got)/4 {
				t.Errorf("PromptBytes %d PromptTokens %d, rendering is %d bytes", r.PromptBytes, r.PromptTokens, len(got))
			}
			if want := len(got) / 64; len(r.Hashes) != want {
				t.Errorf("%d hashes, want %d", len(r.Hashes), want)
			}
		})
	}
}

// A later turn of a conversation renders to an extension of the earlier
// turn's rendering, so its leading block hashes are the earlier turn's.
func TestRenderingExtendsAcrossTurns(t *testing.T) {
	r1, q1 := renderBody(t, routing.KindChat, readFile(t, "../testdata/requests/chat-turn1.json"))
	r2, q2 := renderBody(t, routing.KindChat, readFile(t, "../testdata/requests/chat-turn2.json"))
	if !bytes.HasPrefix(r2, r1) {
		t.Fatalf("turn 2 rendering does not extend turn 1:\n%q\n%q", r1, r2)
	}
	if len(q1.Hashes) == 0 || len(q2.Hashes) <= len(q1.Hashes) {
		t.Fatalf("hashes: %d then %d", len(q1.Hashes), len(q2.Hashes))
	}
	for i, h := range q1.Hashes {
		if q2.Hashes[i] != h {
			t.Fatalf("block %d differs across turns", i)
		}
	}
	// Turn 2 carries turn 1's end among its messages' marks (routing's
	// sequences find the earlier prompt by it), and ends with a mark of
	// its own.
	end := q1.Marks[len(q1.Marks)-1]
	if end.Bytes != len(r1) || !slices.Contains(q2.Marks, end) || q2.Marks[len(q2.Marks)-1].Bytes != len(r2) {
		t.Fatalf("marks: turn 1 %v (rendering %d bytes), turn 2 %v (%d bytes)", q1.Marks, len(r1), q2.Marks, len(r2))
	}
}

// Model and cache_salt seed the chain: the same prompt never shares hashes
// across models or tenants.
func TestHashesIsolateModelAndSalt(t *testing.T) {
	prompt := strings.Repeat("shared system prompt. ", 20)
	body := func(model, salt string) []byte {
		b, _ := json.Marshal(map[string]any{"model": model, "prompt": prompt, "cache_salt": salt})
		return b
	}
	_, a := renderBody(t, routing.KindCompletions, body("m1", ""))
	_, b := renderBody(t, routing.KindCompletions, body("m2", ""))
	_, c := renderBody(t, routing.KindCompletions, body("m1", "tenant"))
	_, d := renderBody(t, routing.KindCompletions, body("m1", ""))
	if a.Hashes[0] == b.Hashes[0] || a.Hashes[0] == c.Hashes[0] {
		t.Fatal("hashes shared across model or salt")
	}
	if a.Hashes[0] != d.Hashes[0] || a.Hashes[len(a.Hashes)-1] != d.Hashes[len(d.Hashes)-1] {
		t.Fatal("same request hashed differently")
	}
	var h prefix.Hasher
	h.Reset(64, 1<<20, prefix.Seed("m1", ""))
	_, _ = h.WriteString(prompt)
	if h.Hashes[0] != a.Hashes[0] {
		t.Fatal("parse does not hash the rendering with the model seed")
	}
}

func TestParseRejectsBadBodies(t *testing.T) {
	files, err := filepath.Glob("../testdata/bad/*.json")
	if err != nil || len(files) == 0 {
		t.Fatalf("no bad bodies: %v", err)
	}
	for _, f := range files {
		name := filepath.Base(f)
		t.Run(name, func(t *testing.T) {
			kind := routing.KindCompletions
			if strings.Contains(name, "message") || strings.Contains(name, "content") {
				kind = routing.KindChat
			}
			var st reqState
			err := st.parse(kind, readFile(t, f), 64, 1024)
			var bad *badRequestError
			if !errors.As(err, &bad) {
				t.Fatalf("parse = %v, want a bad request", err)
			}
			if status, _, _ := statusOf(err); status != 400 {
				t.Fatalf("status %d", status)
			}
		})
	}
}

func FuzzParse(f *testing.F) {
	for _, dir := range []string{"../testdata/requests", "../testdata/bad"} {
		files, _ := filepath.Glob(filepath.Join(dir, "*.json"))
		for _, p := range files {
			b, _ := os.ReadFile(p)
			f.Add(uint8(routing.KindChat), b)
			f.Add(uint8(routing.KindCompletions), b)
		}
	}
	var st reqState
	f.Fuzz(func(t *testing.T, k uint8, body []byte) {
		kind := routing.Kind(k%4 + 1)
		st.req.Reset()
		err := st.parse(kind, body, 16, 64)
		if err != nil {
			var bad *badRequestError
			if !errors.As(err, &bad) {
				t.Fatalf("non-400 error %v", err)
			}
			return
		}
		if len(st.req.Hashes) > 64 || len(st.req.Hashes) > st.req.PromptBytes/16 {
			t.Fatalf("%d hashes for %d bytes", len(st.req.Hashes), st.req.PromptBytes)
		}
	})
}
