package sim

import (
	"testing"

	"github.com/valyala/fastjson"
)

// FuzzParseRequest checks that the request parser never panics and that an
// accepted request is internally consistent.
func FuzzParseRequest(f *testing.F) {
	seeds := []string{
		`{"model":"m","prompt":"hello","max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}`,
		`{"prompt":[1,2,3]}`,
		`{"prompt":[[1,2],[3]],"n":2}`,
		`{"prompt":["a","b"],"cache_salt":"s"}`,
		`{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":2}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"x"},{"type":"image_url"}]}],"tools":[{"type":"function"}]}`,
		`{"prompt":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"127.0.0.1","remote_port":1,"remote_request_id":"r","remote_block_ids":[[1]]}}`,
		`{"prompt":"x","kv_transfer_params":{"do_remote_decode":true}}`,
		`{"prompt":[]}`, `[]`, `{"prompt":[-1]}`, `{"max_tokens":1e99,"prompt":"x"}`, `{`,
	}
	for _, s := range seeds {
		f.Add([]byte(s), false)
		f.Add([]byte(s), true)
	}
	var p fastjson.Parser
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		r, aerr := parseRequest(&p, body, chat, 1000)
		if aerr != nil {
			if aerr.status != 400 || aerr.msg == "" {
				t.Fatalf("error %+v", aerr)
			}
			appendErrorBody(nil, aerr)
			return
		}
		if len(r.prompts) == 0 || r.n < 1 || r.n > maxN || r.maxTokens < 0 {
			t.Fatalf("accepted inconsistent request %+v", r)
		}
		for _, pr := range r.prompts {
			if len(pr) == 0 {
				t.Fatal("empty prompt accepted")
			}
			for _, id := range pr {
				if id >= 1000 {
					t.Fatalf("token id %d ≥ vocab", id)
				}
			}
		}
		if r.includeUsage && !r.stream {
			t.Fatal("include_usage without stream accepted")
		}
		if r.ref != nil && (r.ref.host == "" || r.ref.port <= 0 || r.ref.requestID == "") {
			t.Fatalf("malformed reference accepted: %+v", r.ref)
		}
	})
}

func FuzzJSONString(f *testing.F) {
	for _, s := range []string{"", "plain", "quote\"back\\slash", "ctl\x00\x1f\n", "bad\xffutf8", "日本"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		b := appendJSONString(nil, s)
		if !fastjson.Exists(append(append([]byte(`{"k":`), b...), '}'), "k") {
			t.Fatalf("invalid JSON string %q for %q", b, s)
		}
	})
}
