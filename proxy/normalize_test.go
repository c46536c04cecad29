package proxy

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/kvroute/kvroute/routing"
)

func TestNormalizeText(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"already normal\nlines\n", "already normal\nlines\n"},
		{"crlf\r\nlines\r\n", "crlf\nlines\n"},
		{"trailing  \t\nblanks \n end  ", "trailing\nblanks\n end"},
		{"\uFEFFbom at the start", "bom at the start"},
		{"keep  inner   runs\n    and indentation\n", "keep  inner   runs\n    and indentation\n"},
		{"a lone\rreturn stays", "a lone\rreturn stays"},
		{"text  \r\n```py\r\nx = 1  \r\n```  \r\nafter  ", "text\n```py\nx = 1  \r\n```\nafter"},
		{"~~~\r\ncode \r\n", "~~~\ncode \r\n"}, // an unclosed fence keeps the rest
		{"", ""},
	} {
		got, changed := normalizeText(nil, []byte(tc.in))
		if string(got) != tc.want || changed != (tc.in != tc.want) {
			t.Errorf("normalizeText(%q) = %q, %v; want %q, %v", tc.in, got, changed, tc.want, tc.in != tc.want)
		}
	}
}

// With --normalize-prompts, requests whose prompts differ only by line
// endings, trailing blanks or a BOM reach the engine as the same bytes
// and route by the same hashes; a body already in normal form is
// forwarded byte for byte; other fields and code blocks never change.
func TestNormalizePromptsRewrite(t *testing.T) {
	var mu sync.Mutex
	var got []string
	be := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = append(got, string(b))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"id":"x","object":"chat.completion","choices":[]}`))
	}))
	defer be.Close()
	h := startProxy(t, nil, Options{NormalizePrompts: true}, be.URL)
	send := func(body string) string {
		t.Helper()
		resp, err := http.Post(h.url+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		mu.Lock()
		defer mu.Unlock()
		return got[len(got)-1]
	}
	normal := `{"model":"m","messages":[{"role":"system","content":"Be brief.\nUse:\n` + "```" + `\nx  \n` + "```" + `"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"temperature":0.5}`
	if b := send(normal); b != normal {
		t.Errorf("a body in normal form was changed:\n%s\n%s", normal, b)
	}
	variant := `{"model":"m","messages":[{"role":"system","content":"\ufeffBe brief.  \r\nUse:\r\n` + "```" + `\nx  \n` + "```" + `"},{"role":"user","content":[{"type":"text","text":"hi \r\n"}]}],"temperature":0.5}`
	if b := send(variant); b != `{"model":"m","messages":[{"role":"system","content":"Be brief.\nUse:\n`+"```"+`\nx  \n`+"```"+`"},{"role":"user","content":[{"type":"text","text":"hi\n"}]}],"temperature":0.5}` {
		t.Errorf("the variant reached the engine as %s", b)
	}
	if n := counterValue(t, h.reg, "kvroute_prompt_normalizations_total", nil); n != 1 {
		t.Errorf("%v rewrites counted, want 1", n)
	}

	// Routing sees the rewritten prompt: both variants hash alike.
	hashes := func(body string) []uint64 {
		var st reqState
		if err := st.parse(routing.KindChat, []byte(body), 16, 64); err != nil {
			t.Fatal(err)
		}
		if b := h.srv.normalizePrompts(&st); b != nil {
			if err := st.parse(routing.KindChat, b, 16, 64); err != nil {
				t.Fatal(err)
			}
		}
		return append([]uint64(nil), st.req.Hashes...)
	}
	a := hashes(strings.Replace(normal, `"hi"`, `"hi\n"`, 1))
	b := hashes(variant)
	if len(a) == 0 || len(a) != len(b) || a[len(a)-1] != b[len(b)-1] {
		t.Errorf("the variants route by different hashes: %x, %x", a, b)
	}
}
