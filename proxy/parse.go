package proxy

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"strings"

	"github.com/valyala/fastjson"

	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// Inference paths whose bodies kvroute parses. Everything else is forwarded
// unparsed (KindOther).
var (
	pathCompletions = []byte("/v1/completions")
	pathChat        = []byte("/v1/chat/completions")
	pathResponses   = []byte("/v1/responses")
	pathEmbeddings  = []byte("/v1/embeddings")
)

// kindOf classifies a request by method and path.
func kindOf(method, path []byte) routing.Kind {
	if !bytes.Equal(method, []byte(fasthttpMethodPost)) {
		return routing.KindOther
	}
	switch {
	case bytes.Equal(path, pathChat):
		return routing.KindChat
	case bytes.Equal(path, pathCompletions):
		return routing.KindCompletions
	case bytes.Equal(path, pathResponses):
		return routing.KindResponses
	case bytes.Equal(path, pathEmbeddings):
		return routing.KindEmbeddings
	}
	return routing.KindOther
}

const fasthttpMethodPost = "POST"

// Separators of the canonical rendering. They are ASCII control characters
// that do not occur in ordinary prompt text.
const (
	sepRecord  = "\x1e" // ends a message; separates list elements
	sepUnit    = "\x1f" // separates a message's header from its body
	sepGroup   = "\x1d" // starts a message
	sepPart    = "\x1c" // starts a non-text content part or extra field
	tagTokenID = "\x00T"
)

// renderer receives the canonical rendering. prefix.Hasher implements it; a
// bytes.Buffer does too (tests, /debug).
type renderer interface {
	io.Writer
	io.StringWriter
}

// tee renders to the block hasher and the normaliser at once.
type tee struct {
	h *prefix.Hasher
	n *prefix.Normalizer
}

func (t *tee) Write(p []byte) (int, error) {
	if !t.n.Done() {
		_, _ = t.n.Write(p)
	}
	return t.h.Write(p)
}

func (t *tee) WriteString(p string) (int, error) {
	if !t.n.Done() {
		_, _ = t.n.WriteString(p)
	}
	return t.h.WriteString(p)
}

// valueSlack is how many JSON values beyond maxTokens a body may hold
// (the other fields, messages and their parts) before it is refused
// without parsing.
const valueSlack = 1 << 16

// jsonValues returns a bound on the number of array elements and object
// members in b, or limit+1 once there are more than limit: the commas
// outside strings, plus one. (Deep nesting without commas is the parser's
// depth limit's to refuse.) It lets a body of millions of token ids be refused before the
// parser allocates a value for each.
func jsonValues(b []byte, limit int) int {
	n, inStr := 1, false
	for i := 0; i < len(b); i++ {
		c := b[i]
		if inStr {
			switch c {
			case '\\':
				i++
			case '"':
				inStr = false
			}
			continue
		}
		switch c {
		case '"':
			inStr = true
		case ',':
			if n++; n > limit {
				return n
			}
		}
	}
	return n
}

// contextLengthError is vLLM's answer to a prompt longer than the model's
// context (its wording, so clients that match it keep working).
func contextLengthError(max, got int, more bool, param string) error {
	q := ""
	if more {
		q = "more than "
	}
	return &badRequestError{msg: fmt.Sprintf("This model's maximum context length is %d tokens. However, you requested %s%d tokens in the %s. Please reduce the length of the %s.",
		max, q, got, param, param), param: param}
}

// parse fills s.req from an inference body of the given kind, hashing the
// canonical rendering into blocks of blockSize bytes (at most maxBlocks).
// It returns a *badRequestError for malformed JSON and wrong types.
func (s *reqState) parse(kind routing.Kind, body []byte, blockSize, maxBlocks int) error {
	s.tokens = 0
	s.big = s.big || len(body) > pooledBodyBytes
	if limit := s.maxTokens + valueSlack; s.maxTokens > 0 && len(body)/2 >= limit {
		if n := jsonValues(body, limit); n > limit {
			return contextLengthError(s.maxTokens, s.maxTokens, true, "prompt")
		}
	}
	v, err := s.parser.ParseBytes(body)
	if err != nil {
		// fastjson quotes the rest of the body; the answer does not.
		msg, _, _ := strings.Cut(err.Error(), "; unparsed tail")
		return &badRequestError{msg: "invalid JSON body: " + msg}
	}
	if v.Type() != fastjson.TypeObject {
		return &badRequestError{msg: "request body must be a JSON object"}
	}
	r := &s.req
	r.Kind, r.Body = kind, body
	s.root = v
	s.clientKV = false
	for _, k := range clientKVFields {
		if x := v.Get(k); x != nil && x.Type() != fastjson.TypeNull {
			s.clientKV = true
		}
	}
	if s.n, err = optInt(v, "n"); err != nil {
		return err
	}
	switch kind {
	case routing.KindChat:
		s.prompts = 1
	case routing.KindCompletions:
		s.prompts = promptCount(v.Get("prompt"))
	default:
		s.prompts = 0
	}
	if r.Model, err = optString(v, "model"); err != nil {
		return err
	}
	if r.Stream, err = optBool(v, "stream"); err != nil {
		return err
	}
	if so := v.Get("stream_options"); so != nil && so.Type() != fastjson.TypeNull {
		if so.Type() != fastjson.TypeObject {
			return &badRequestError{msg: "stream_options must be an object", param: "stream_options"}
		}
		if r.IncludeUsage, err = optBool(so, "include_usage"); err != nil {
			return err
		}
	}
	if r.MaxTokens, err = optInt(v, "max_completion_tokens"); err != nil {
		return err
	}
	if r.MaxTokens == 0 {
		if r.MaxTokens, err = optInt(v, "max_tokens"); err != nil {
			return err
		}
	}
	if r.CacheSalt, err = optString(v, "cache_salt"); err != nil {
		return err
	}
	if tier := v.Get("service_tier"); tier != nil && tier.Type() != fastjson.TypeNull {
		b, _ := tier.StringBytes()
		var ok bool
		if s.class, ok = classOf(b); !ok || tier.Type() != fastjson.TypeString {
			return &badRequestError{msg: "service_tier must be one of auto, default, flex, scale, priority", param: "service_tier"}
		}
	}
	seed := prefix.Seed(r.Model, r.CacheSalt)
	s.hasher.Reset(blockSize, maxBlocks, seed)
	var w renderer = &s.hasher
	if s.nearBlocks > 0 {
		s.norm.Reset(blockSize, s.nearBlocks, seed)
		s.tee = tee{&s.hasher, &s.norm}
		w = &s.tee
	}
	if err := s.render(w, kind, v); err != nil {
		return err
	}
	s.hasher.Mark() // the prompt's end, which a later prompt may extend
	r.PromptBytes = s.hasher.Len()
	r.PromptTokens = r.PromptBytes / 4
	r.Hashes, r.Marks = s.hasher.Hashes, s.hasher.Marks
	return nil
}

// clientKVFields are the body fields that steer a KV transfer (vLLM's
// NixlConnector, SGLang's bootstrap): kvroute sets them, clients may not.
var clientKVFields = [...]string{"kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"}

// promptCount returns the number of prompts of a completions prompt: one
// for a string or a list of token ids, else the list's length (0 when
// absent).
func promptCount(p *fastjson.Value) int {
	switch {
	case p == nil:
		return 0
	case p.Type() != fastjson.TypeArray:
		return 1
	}
	a := p.GetArray()
	if len(a) > 0 && a[0].Type() == fastjson.TypeNumber {
		return 1 // token ids
	}
	return len(a)
}

// render writes the canonical rendering of v's prompt to w. The rendering
// is defined in docs/routing.md ("Canonical prompt rendering"); its one promise is
// that a request whose prompt extends another's (a later turn of the same
// conversation, the same system prompt with another question) renders to
// bytes that extend the other's rendering.
func (s *reqState) render(w renderer, kind routing.Kind, v *fastjson.Value) error {
	switch kind {
	case routing.KindCompletions:
		p := v.Get("prompt")
		if p == nil {
			if v.Get("prompt_embeds") != nil {
				return nil // embeddings carry no text to route on
			}
			return &badRequestError{msg: "prompt is required", param: "prompt"}
		}
		return s.renderInput(w, p, "prompt")
	case routing.KindEmbeddings:
		p := v.Get("input")
		if p == nil {
			return &badRequestError{msg: "input is required", param: "input"}
		}
		return s.renderInput(w, p, "input")
	case routing.KindChat:
		if t := v.Get("tools"); t != nil && t.Type() != fastjson.TypeNull {
			if t.Type() != fastjson.TypeArray {
				return &badRequestError{msg: "tools must be an array", param: "tools"}
			}
			s.renderJSON(w, "tools", t)
		}
		msgs := v.Get("messages")
		if msgs == nil || msgs.Type() != fastjson.TypeArray {
			return &badRequestError{msg: "messages is required and must be an array", param: "messages"}
		}
		arr := msgs.GetArray()
		for i, m := range arr {
			if err := s.renderMessage(w, m, "messages"); err != nil {
				return err
			}
			if i >= len(arr)-prefix.MaxMarks {
				s.hasher.Mark() // a later turn continues from a message's end
			}
		}
		return nil
	case routing.KindResponses:
		if t := v.Get("tools"); t != nil && t.Type() != fastjson.TypeNull {
			if t.Type() != fastjson.TypeArray {
				return &badRequestError{msg: "tools must be an array", param: "tools"}
			}
			s.renderJSON(w, "tools", t)
		}
		instr, err := optString(v, "instructions")
		if err != nil {
			return err
		}
		if instr != "" {
			writeMessage(w, "system", instr)
			s.hasher.Mark()
		}
		in := v.Get("input")
		switch {
		case in == nil:
			return &badRequestError{msg: "input is required", param: "input"}
		case in.Type() == fastjson.TypeString:
			writeMessage(w, "user", b2s(in.GetStringBytes()))
			return nil
		case in.Type() == fastjson.TypeArray:
			arr := in.GetArray()
			for i, item := range arr {
				if err := s.renderMessage(w, item, "input"); err != nil {
					return err
				}
				if i >= len(arr)-prefix.MaxMarks {
					s.hasher.Mark()
				}
			}
			return nil
		default:
			return &badRequestError{msg: "input must be a string or an array", param: "input"}
		}
	}
	return nil
}

// renderInput renders a completions prompt or an embeddings input: a string,
// an array of strings, an array of token ids, or an array of arrays of
// token ids. Array elements are separated by sepRecord; token ids are 4
// little-endian bytes each, after tagTokenID.
func (s *reqState) renderInput(w renderer, p *fastjson.Value, param string) error {
	switch p.Type() {
	case fastjson.TypeString:
		_, _ = w.Write(p.GetStringBytes())
		return nil
	case fastjson.TypeArray:
	default:
		return &badRequestError{msg: param + " must be a string, an array of strings, or token ids", param: param}
	}
	arr := p.GetArray()
	if len(arr) == 0 {
		return &badRequestError{msg: param + " must not be empty", param: param}
	}
	switch arr[0].Type() {
	case fastjson.TypeNumber:
		return s.renderTokens(w, arr, param)
	case fastjson.TypeString:
		for i, e := range arr {
			if e.Type() != fastjson.TypeString {
				return &badRequestError{msg: fmt.Sprintf("%s[%d] must be a string", param, i), param: param}
			}
			if i > 0 {
				_, _ = w.WriteString(sepRecord)
			}
			_, _ = w.Write(e.GetStringBytes())
		}
		return nil
	case fastjson.TypeArray:
		for i, e := range arr {
			if e.Type() != fastjson.TypeArray {
				return &badRequestError{msg: fmt.Sprintf("%s[%d] must be an array of token ids", param, i), param: param}
			}
			if i > 0 {
				_, _ = w.WriteString(sepRecord)
			}
			if err := s.renderTokens(w, e.GetArray(), param); err != nil {
				return err
			}
		}
		return nil
	}
	return &badRequestError{msg: param + " must be a string, an array of strings, or token ids", param: param}
}

// renderTokens renders token ids, which must be integers in [0, 2^32).
func (s *reqState) renderTokens(w renderer, ids []*fastjson.Value, param string) error {
	if s.tokens += len(ids); s.maxTokens > 0 && s.tokens > s.maxTokens {
		return contextLengthError(s.maxTokens, s.tokens, false, param)
	}
	b := append(s.scratch[:0], tagTokenID...)
	for i, e := range ids {
		id, err := e.Uint()
		if err != nil || id > 1<<32-1 {
			return &badRequestError{msg: fmt.Sprintf("%s: token id %d must be a non-negative integer", param, i), param: param}
		}
		b = binary.LittleEndian.AppendUint32(b, uint32(id))
	}
	_, _ = w.Write(b)
	s.scratch = b
	return nil
}

// renderMessage renders one chat message or Responses input item:
// sepGroup role [sepPart name] sepUnit content [sepPart field sepUnit json]... sepRecord.
// Content is a string, null, or an array of parts; text parts render as
// their text, other parts as sepPart type sepUnit JSON.
func (s *reqState) renderMessage(w renderer, m *fastjson.Value, param string) error {
	if m.Type() != fastjson.TypeObject {
		return &badRequestError{msg: param + " items must be objects", param: param}
	}
	role, err := optString(m, "role")
	if err != nil {
		return err
	}
	if role == "" {
		// A Responses item without a role (function_call, reasoning, ...):
		// its JSON is its rendering.
		typ, err := optString(m, "type")
		if err != nil || typ == "" {
			return &badRequestError{msg: param + " items need a role", param: param}
		}
		s.renderJSON(w, typ, m)
		return nil
	}
	_, _ = w.WriteString(sepGroup)
	_, _ = w.WriteString(role)
	if name, err := optString(m, "name"); err != nil {
		return err
	} else if name != "" {
		_, _ = w.WriteString(sepPart)
		_, _ = w.WriteString(name)
	}
	_, _ = w.WriteString(sepUnit)
	c := m.Get("content")
	switch {
	case c == nil || c.Type() == fastjson.TypeNull:
	case c.Type() == fastjson.TypeString:
		_, _ = w.Write(c.GetStringBytes())
	case c.Type() == fastjson.TypeArray:
		for _, part := range c.GetArray() {
			if part.Type() != fastjson.TypeObject {
				return &badRequestError{msg: param + ": content parts must be objects", param: param}
			}
			typ, err := optString(part, "type")
			if err != nil {
				return err
			}
			if t := part.Get("text"); t != nil && t.Type() == fastjson.TypeString {
				_, _ = w.Write(t.GetStringBytes())
				continue
			}
			if typ == "" {
				return &badRequestError{msg: param + ": content parts need a type", param: param}
			}
			_, _ = w.WriteString(sepPart)
			_, _ = w.WriteString(typ)
			_, _ = w.WriteString(sepUnit)
			s.scratch = part.MarshalTo(s.scratch[:0])
			_, _ = w.Write(s.scratch)
		}
	default:
		return &badRequestError{msg: param + ": content must be a string, an array of parts, or null", param: param}
	}
	for _, f := range [...]string{"tool_calls", "tool_call_id", "function_call"} {
		if x := m.Get(f); x != nil && x.Type() != fastjson.TypeNull {
			_, _ = w.WriteString(sepPart)
			_, _ = w.WriteString(f)
			_, _ = w.WriteString(sepUnit)
			s.scratch = x.MarshalTo(s.scratch[:0])
			_, _ = w.Write(s.scratch)
		}
	}
	_, _ = w.WriteString(sepRecord)
	return nil
}

// renderJSON renders a structured item as a message whose role is label and
// whose content is the item's compact JSON.
func (s *reqState) renderJSON(w renderer, label string, v *fastjson.Value) {
	_, _ = w.WriteString(sepGroup)
	_, _ = w.WriteString(label)
	_, _ = w.WriteString(sepUnit)
	s.scratch = v.MarshalTo(s.scratch[:0])
	_, _ = w.Write(s.scratch)
	_, _ = w.WriteString(sepRecord)
}

// writeMessage renders a message with string content.
func writeMessage(w renderer, role, content string) {
	_, _ = w.WriteString(sepGroup)
	_, _ = w.WriteString(role)
	_, _ = w.WriteString(sepUnit)
	_, _ = w.WriteString(content)
	_, _ = w.WriteString(sepRecord)
}

func optString(v *fastjson.Value, key string) (string, error) {
	x := v.Get(key)
	if x == nil || x.Type() == fastjson.TypeNull {
		return "", nil
	}
	if x.Type() != fastjson.TypeString {
		return "", &badRequestError{msg: key + " must be a string", param: key}
	}
	return b2s(x.GetStringBytes()), nil
}

func optBool(v *fastjson.Value, key string) (bool, error) {
	x := v.Get(key)
	if x == nil || x.Type() == fastjson.TypeNull {
		return false, nil
	}
	b, err := x.Bool()
	if err != nil {
		return false, &badRequestError{msg: key + " must be a boolean", param: key}
	}
	return b, nil
}

func optInt(v *fastjson.Value, key string) (int, error) {
	x := v.Get(key)
	if x == nil || x.Type() == fastjson.TypeNull {
		return 0, nil
	}
	n, err := x.Int()
	if err != nil || n < 0 {
		return 0, &badRequestError{msg: key + " must be a non-negative integer", param: key}
	}
	return n, nil
}
