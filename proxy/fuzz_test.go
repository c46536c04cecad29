package proxy

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/valyala/fastjson"

	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// FuzzRender checks the canonical rendering of every body the parser
// accepts (FuzzParse checks the parser's verdicts): it is deterministic,
// what parse hashed is exactly the rendering, and it keeps its one promise:
// a body whose prompt extends another's (one more message, one more
// string, one more token id) renders to bytes that extend the other's
// rendering, so its leading block hashes are the same.
func FuzzRender(f *testing.F) {
	for _, dir := range []string{"../testdata/requests", "../testdata/bad"} {
		files, _ := filepath.Glob(filepath.Join(dir, "*.json"))
		for _, p := range files {
			b, _ := os.ReadFile(p)
			for _, k := range []routing.Kind{routing.KindCompletions, routing.KindChat, routing.KindResponses, routing.KindEmbeddings} {
				f.Add(uint8(k), b)
			}
		}
	}
	f.Add(uint8(routing.KindChat), []byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"u"}}]},{"role":"assistant","content":null,"tool_calls":[]}]}`))
	f.Add(uint8(routing.KindResponses), []byte(`{"model":"m","instructions":"be brief","input":[{"role":"user","content":"hi"},{"type":"function_call","call_id":"c"}]}`))
	f.Add(uint8(routing.KindCompletions), []byte(`{"model":"m","prompt":[[1,2],[3]],"cache_salt":"s"}`))
	f.Add(uint8(routing.KindEmbeddings), []byte(`{"model":"m","input":["a","b\u0000"]}`))

	const blockSize, maxBlocks = 16, 1 << 12
	var a, b reqState
	var p, q fastjson.Parser
	f.Fuzz(func(t *testing.T, k uint8, body []byte) {
		kind := routing.Kind(k%4 + 1)
		a.req.Reset()
		if err := a.parse(kind, body, blockSize, maxBlocks); err != nil {
			var bad *badRequestError
			if !errors.As(err, &bad) {
				t.Fatalf("parse: %v is not a bad request", err)
			}
			return
		}
		hashes := slices.Clone(a.req.Hashes)
		promptBytes := a.req.PromptBytes

		// Rendered again, to a buffer: the same bytes, the same hashes.
		v, err := p.ParseBytes(body)
		if err != nil {
			t.Fatalf("parse accepted a body fastjson rejects: %v", err)
		}
		var r1, r2 bytes.Buffer
		if err := b.render(&r1, kind, v); err != nil {
			t.Fatalf("render after a successful parse: %v", err)
		}
		if err := b.render(&r2, kind, v); err != nil || !bytes.Equal(r1.Bytes(), r2.Bytes()) {
			t.Fatalf("rendering is not deterministic: %v", err)
		}
		if r1.Len() != promptBytes {
			t.Fatalf("parse counted %d prompt bytes, the rendering is %d", promptBytes, r1.Len())
		}
		var h prefix.Hasher
		h.Reset(blockSize, maxBlocks, prefix.Seed(a.req.Model, a.req.CacheSalt))
		_, _ = h.Write(r1.Bytes())
		if !slices.Equal(h.Hashes, hashes) {
			t.Fatalf("parse's hashes are not the rendering's")
		}

		// The prompt extended by one element renders to an extension. The
		// body is parsed afresh: rendering unescapes strings in place, and
		// fastjson re-escapes them Go's way, not JSON's.
		orig, err := q.ParseBytes(body)
		if err != nil {
			t.Fatal(err)
		}
		ext := extendPrompt(kind, orig)
		if ext == nil {
			return
		}
		b.req.Reset()
		if err := b.parse(kind, ext, blockSize, maxBlocks); err != nil {
			t.Fatalf("the extended body %q is rejected: %v", ext, err)
		}
		v2, err := p.ParseBytes(ext)
		if err != nil {
			t.Fatal(err)
		}
		var r3 bytes.Buffer
		if err := b.render(&r3, kind, v2); err != nil {
			t.Fatal(err)
		}
		if !bytes.HasPrefix(r3.Bytes(), r1.Bytes()) || r3.Len() == r1.Len() {
			t.Fatalf("the extended prompt's rendering does not extend the prompt's:\n%q\n%q\nextended body %q", r1.Bytes(), r3.Bytes(), ext)
		}
		if len(b.req.Hashes) < len(hashes) || !slices.Equal(b.req.Hashes[:len(hashes)], hashes) {
			t.Fatalf("the extended prompt's leading hashes differ")
		}
	})
}

// extendPrompt returns a body whose prompt is v's with one more element
// (a user message, a string, a token id, a list of token ids), with v's
// model, cache salt and the other fields that render (tools,
// instructions); nil when v's prompt has no list to extend.
func extendPrompt(kind routing.Kind, v *fastjson.Value) []byte {
	b := []byte(`{`)
	for _, k := range []string{"model", "cache_salt", "tools", "instructions"} {
		if x := v.Get(k); x != nil {
			b = append(b, `"`+k+`":`...)
			b = x.MarshalTo(b)
			b = append(b, ',')
		}
	}
	var key string
	switch kind {
	case routing.KindChat:
		key = "messages"
	case routing.KindCompletions:
		key = "prompt"
	default:
		key = "input"
	}
	list := v.Get(key)
	if list == nil || list.Type() != fastjson.TypeArray {
		return nil
	}
	arr := list.GetArray()
	// The elements are copied before any Type call: Type unescapes a
	// string in place, and MarshalTo would then escape it Go's way.
	b = append(b, `"`+key+`":[`...)
	for _, e := range arr {
		b = e.MarshalTo(b)
		b = append(b, ',')
	}
	var more string
	switch {
	case kind == routing.KindChat || kind == routing.KindResponses:
		more = `{"role":"user","content":"one more turn"}`
	case len(arr) == 0:
		return nil
	case arr[0].Type() == fastjson.TypeString:
		more = `"one more string"`
	case arr[0].Type() == fastjson.TypeNumber:
		more = `7`
	case arr[0].Type() == fastjson.TypeArray:
		more = `[7,8]`
	default:
		return nil
	}
	b = append(b, more+`]}`...)
	return b
}
