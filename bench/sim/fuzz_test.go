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
		`{"prompt":"x","bootstrap_host":"127.0.0.1","bootstrap_port":8998,"bootstrap_room":9223372036854775807}`,
		`{"prompt":["a","b"],"bootstrap_host":["h","h"],"bootstrap_port":[1,2],"bootstrap_room":[0,18446744073709551615]}`,
		`{"prompt":["a","b"],"bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":[1]}`,
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
		if b := r.boot; b != nil {
			np := len(r.prompts)
			if r.n != 1 || len(b.hosts) != np || len(b.ports) != np || len(b.rooms) != np || r.remoteDecode || r.remotePrefill {
				t.Fatalf("inconsistent bootstrap fields accepted: %+v for %d prompts", b, np)
			}
			for i := range np {
				if b.hosts[i] == "" || b.ports[i] < 1 || b.ports[i] > 65535 {
					t.Fatalf("bad bootstrap element %d accepted: %+v", i, b)
				}
			}
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
