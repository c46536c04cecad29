package proxy

import (
	"regexp"
	"strconv"
	"testing"
)

var usageRE = regexp.MustCompile(`"cached_tokens": *([0-9]+)`)

// reference returns the last cached_tokens value of the whole body.
func reference(body []byte) (int, bool) {
	m := usageRE.FindAllSubmatch(body, -1)
	if len(m) == 0 {
		return 0, false
	}
	v, _ := strconv.Atoi(string(m[len(m)-1][1]))
	return v, true
}

func TestNumScanner(t *testing.T) {
	stream := "data: {\"choices\":[{\"delta\":{\"content\":\"cached_tokens\"}}]}\n\n" +
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2048,\"completion_tokens\":8,\"prompt_tokens_details\":{\"cached_tokens\":2032}}}\n\ndata: [DONE]\n\n"
	tests := []struct {
		name  string
		body  string
		want  int
		found bool
	}{
		{name: "stream", body: stream, want: 2032, found: true},
		{name: "json with spaces", body: `{"usage": {"prompt_tokens_details": {"cached_tokens": 17}}}`, want: 17, found: true},
		{name: "null details", body: `{"usage":{"prompt_tokens":4,"prompt_tokens_details":null}}`},
		{name: "null value", body: `{"cached_tokens":null}`},
		{name: "absent", body: `{"id":"x"}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for split := 1; split <= len(tc.body); split++ { // every chunk size
				var sc numScanner
				sc.reset(patCachedTokens)
				b := []byte(tc.body)
				for len(b) > 0 {
					n := min(split, len(b))
					sc.feed(b[:n])
					b = b[n:]
				}
				if sc.Found != tc.found || sc.Value != tc.want {
					t.Fatalf("chunks of %d: found %v value %d", split, sc.Found, sc.Value)
				}
			}
		})
	}
}

func FuzzNumScanner(f *testing.F) {
	f.Add([]byte(`{"prompt_tokens_details":{"cached_tokens":123}}`), uint8(7))
	f.Add([]byte(`"cached_tokens""cached_tokens":5"cached_tokens": 9x`), uint8(3))
	f.Add([]byte("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2048,\"prompt_tokens_details\":{\"cached_tokens\":2032}}}\n\ndata: [DONE]\n\n"), uint8(5))
	f.Add([]byte(`{"cached_tokens": 99999999999999999999,"cached_tokens":null,"cached_tokens":-1}`), uint8(0))
	f.Add([]byte(`"cached_"cached_tokens"cached_tokens":"cached_tokens":12`), uint8(15))
	f.Fuzz(func(t *testing.T, body []byte, split uint8) {
		n := int(split)%16 + 1
		var sc numScanner
		sc.reset(patCachedTokens)
		for b := body; len(b) > 0; {
			k := min(n, len(b))
			sc.feed(b[:k])
			b = b[k:]
		}
		want, found := reference(body)
		// A value still being read at the end of the body is incomplete.
		if found && sc.Found != found {
			if m := usageRE.FindAllIndex(body, -1); m[len(m)-1][1] == len(body) {
				return
			}
		}
		if sc.Found != found || (found && sc.Value != want && want < 1<<40) {
			if found && m(body) {
				return
			}
			t.Fatalf("scanner found %v %d, reference %v %d", sc.Found, sc.Value, found, want)
		}
	})
}

// m reports whether body's last match ends the body (an unterminated number).
func m(body []byte) bool {
	idx := usageRE.FindAllIndex(body, -1)
	return len(idx) > 0 && idx[len(idx)-1][1] == len(body)
}
