package proxy

import (
	"regexp"
	"strconv"
	"testing"
)

var usageRE = regexp.MustCompile(`"(prompt|cached)_tokens": *([0-9]+)`)

// reference returns the last prompt_tokens and cached_tokens values of the
// whole body, and whether each was found; a number that ends the body is
// incomplete and left out.
func reference(body []byte) (prompt, cached int, pOK, cOK bool) {
	for _, m := range usageRE.FindAllSubmatchIndex(body, -1) {
		if m[1] == len(body) {
			continue
		}
		v, err := strconv.Atoi(string(body[m[4]:m[5]]))
		if err != nil || v >= 1<<40 {
			continue // the scanner caps a value; nothing this large is a token count
		}
		if string(body[m[2]:m[3]]) == "prompt" {
			prompt, pOK = v, true
		} else {
			cached, cOK = v, true
		}
	}
	return prompt, cached, pOK, cOK
}

// scanChunks feeds body to a new scanner in chunks of n bytes.
func scanChunks(body []byte, n int) *usageScanner {
	var u usageScanner
	for len(body) > 0 {
		k := min(n, len(body))
		u.feed(body[:k])
		body = body[k:]
	}
	return &u
}

func TestUsageScanner(t *testing.T) {
	stream := "data: {\"choices\":[{\"delta\":{\"content\":\"cached_tokens\\\":1 x_tokens\\\":5\"}}]}\n\n" +
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2048,\"completion_tokens\":8,\"prompt_tokens_details\":{\"cached_tokens\":2032}}}\n\ndata: [DONE]\n\n"
	tests := []struct {
		name           string
		body           string
		prompt, cached int
		pOK, cOK       bool
	}{
		{name: "stream", body: stream, prompt: 2048, cached: 2032, pOK: true, cOK: true},
		{name: "json with spaces", body: `{"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 17}}}`, prompt: 9, cached: 17, pOK: true, cOK: true},
		{name: "null details", body: `{"usage":{"prompt_tokens":4,"prompt_tokens_details":null}}`, prompt: 4, pOK: true},
		{name: "null value", body: `{"cached_tokens":null}`},
		{name: "other keys", body: `{"completion_tokens":3,"total_tokens":7,"max_tokens":1}`},
		{name: "absent", body: `{"id":"x"}`},
		{name: "key at the start", body: `"cached_tokens":5,`, cached: 5, cOK: true},
		{name: "last value wins", body: `{"prompt_tokens":1,"prompt_tokens":22}`, prompt: 22, pOK: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for split := 1; split <= len(tc.body); split++ { // every chunk size
				u := scanChunks([]byte(tc.body), split)
				if u.Prompt != tc.prompt || u.PromptFound != tc.pOK || u.Cached != tc.cached || u.CachedFound != tc.cOK {
					t.Fatalf("chunks of %d: prompt %v %d, cached %v %d", split, u.PromptFound, u.Prompt, u.CachedFound, u.Cached)
				}
			}
		})
	}
}

func FuzzUsageScanner(f *testing.F) {
	f.Add([]byte(`{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":123}}`), uint8(7))
	f.Add([]byte(`"cached_tokens""cached_tokens":5"cached_tokens": 9x`), uint8(3))
	f.Add([]byte("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2048,\"prompt_tokens_details\":{\"cached_tokens\":2032}}}\n\ndata: [DONE]\n\n"), uint8(5))
	f.Add([]byte(`{"cached_tokens": 99999999999999999999,"cached_tokens":null,"cached_tokens":-1}`), uint8(0))
	f.Add([]byte(`"cached_"cached_tokens"cached_tokens":"cached_tokens":12_tokens":3,`), uint8(15))
	f.Fuzz(func(t *testing.T, body []byte, split uint8) {
		u := scanChunks(body, int(split)%24+1)
		p, c, pOK, cOK := reference(body)
		if u.PromptFound != pOK || u.CachedFound != cOK || pOK && u.Prompt != p || cOK && u.Cached != c {
			t.Fatalf("scanner: prompt %v %d, cached %v %d; reference: prompt %v %d, cached %v %d",
				u.PromptFound, u.Prompt, u.CachedFound, u.Cached, pOK, p, cOK, c)
		}
	})
}
