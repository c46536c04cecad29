package sim

import (
	"fmt"

	"github.com/valyala/fastjson"
)

// apiError is an OpenAI-style error answer.
type apiError struct {
	status int
	typ    string
	msg    string
}

func badRequest(format string, a ...any) *apiError {
	return &apiError{status: 400, typ: "BadRequestError", msg: fmt.Sprintf(format, a...)}
}

// refKind is the prefill/decode protocol that a kvRef follows.
type refKind uint8

const (
	// refNixl is vLLM's NixlConnector: kv_transfer_params with
	// do_remote_prefill, pulled from the side channel's /kv/pull.
	refNixl refKind = iota
	// refBootstrap is SGLang's bootstrap room, pulled from the prefill
	// pod's bootstrap server (/bootstrap/pull).
	refBootstrap
)

// kvRef tells a decode pod where a prompt's KV is: a NixlConnector
// reference or an SGLang bootstrap room.
type kvRef struct {
	kind      refKind
	engineID  string // NixlConnector remote_engine_id
	requestID string // NixlConnector remote_request_id
	host      string // remote_host or bootstrap_host
	port      int    // remote_port or bootstrap_port
	blockIDs  string // NixlConnector remote_block_ids, compact JSON
	room      uint64 // bootstrap_room
}

// bootstrapFields are SGLang's prefill/decode fields, one element per
// prompt.
type bootstrapFields struct {
	hosts []string
	ports []int
	rooms []uint64
}

// ref returns the decode-side reference of prompt i.
func (b *bootstrapFields) ref(i int) *kvRef {
	return &kvRef{kind: refBootstrap, host: b.hosts[i], port: b.ports[i], room: b.rooms[i]}
}

// apiRequest is a parsed /v1/completions or /v1/chat/completions body.
type apiRequest struct {
	model         string // "" = absent
	prompts       [][]uint32
	maxTokens     int // 0 = absent
	n             int
	stream        bool
	includeUsage  bool
	ignoreEOS     bool
	salt          string
	remoteDecode  bool             // kv_transfer_params.do_remote_decode
	remotePrefill bool             // kv_transfer_params.do_remote_prefill
	ref           *kvRef           // the reference, when do_remote_prefill and well-formed
	boot          *bootstrapFields // bootstrap_host, _port and _room, when present
}

// maxN bounds the n parameter (choices per prompt).
const maxN = 64

// parseRequest parses an inference body with p. chat selects the chat
// schema (messages rendered with the fixed template) over the completions
// schema (prompt). Token ids must be below vocab.
func parseRequest(p *fastjson.Parser, body []byte, chat bool, vocab uint32) (*apiRequest, *apiError) {
	v, err := p.ParseBytes(body)
	if err != nil {
		return nil, badRequest("Invalid JSON body: %v", err)
	}
	if v.Type() != fastjson.TypeObject {
		return nil, badRequest("Request body must be a JSON object")
	}
	r := &apiRequest{n: 1}
	if m := v.Get("model"); m != nil && m.Type() != fastjson.TypeNull {
		s, err := m.StringBytes()
		if err != nil {
			return nil, badRequest("model must be a string")
		}
		r.model = string(s)
	}
	if r.stream, err = optBool(v, "stream"); err != nil {
		return nil, badRequest("%v", err)
	}
	if so := v.Get("stream_options"); so != nil && so.Type() != fastjson.TypeNull {
		if so.Type() != fastjson.TypeObject {
			return nil, badRequest("stream_options must be an object")
		}
		if !r.stream {
			return nil, badRequest("Stream options can only be defined when `stream=True`.")
		}
		if r.includeUsage, err = optBool(so, "include_usage"); err != nil {
			return nil, badRequest("%v", err)
		}
	}
	if r.ignoreEOS, err = optBool(v, "ignore_eos"); err != nil {
		return nil, badRequest("%v", err)
	}
	keys := []string{"max_tokens"}
	if chat {
		keys = []string{"max_completion_tokens", "max_tokens"}
	}
	for _, k := range keys {
		n, ok, err := optInt(v, k)
		if err != nil {
			return nil, badRequest("%v", err)
		}
		if ok {
			if n < 1 {
				return nil, badRequest("%s must be at least 1, got %d.", k, n)
			}
			r.maxTokens = n
			break
		}
	}
	if n, ok, err := optInt(v, "n"); err != nil {
		return nil, badRequest("%v", err)
	} else if ok {
		if n < 1 || n > maxN {
			return nil, badRequest("n must be between 1 and %d, got %d.", maxN, n)
		}
		r.n = n
	}
	if s := v.Get("cache_salt"); s != nil && s.Type() != fastjson.TypeNull {
		b, err := s.StringBytes()
		if err != nil || len(b) == 0 {
			return nil, badRequest("cache_salt must be a non-empty string")
		}
		r.salt = string(b)
	}
	if kv := v.Get("kv_transfer_params"); kv != nil && kv.Type() != fastjson.TypeNull {
		if kv.Type() != fastjson.TypeObject {
			return nil, badRequest("kv_transfer_params must be an object")
		}
		r.remoteDecode = kv.GetBool("do_remote_decode")
		r.remotePrefill = kv.GetBool("do_remote_prefill")
		if r.remotePrefill {
			r.ref = parseRef(kv)
		}
	}
	if chat {
		text, aerr := renderChat(v)
		if aerr != nil {
			return nil, aerr
		}
		r.prompts = [][]uint32{appendTokens(nil, string(text), vocab)}
	} else if aerr := r.parsePrompt(v.Get("prompt"), vocab); aerr != nil {
		return nil, aerr
	}
	for _, pr := range r.prompts {
		if len(pr) == 0 {
			return nil, badRequest("The prompt cannot be empty.")
		}
	}
	if aerr := r.parseBootstrap(v); aerr != nil {
		return nil, aerr
	}
	return r, nil
}

// parseRef returns the decode-side reference, or nil when it is unusable.
func parseRef(kv *fastjson.Value) *kvRef {
	ref := &kvRef{
		kind:      refNixl,
		engineID:  string(kv.GetStringBytes("remote_engine_id")),
		requestID: string(kv.GetStringBytes("remote_request_id")),
		host:      string(kv.GetStringBytes("remote_host")),
		port:      kv.GetInt("remote_port"),
	}
	if b := kv.Get("remote_block_ids"); b != nil {
		ref.blockIDs = string(b.MarshalTo(nil))
	}
	if ref.host == "" || ref.port <= 0 || ref.port > 65535 || ref.requestID == "" {
		return nil
	}
	return ref
}

// parseBootstrap parses SGLang's bootstrap_host, bootstrap_port and
// bootstrap_room: all three or none, each a scalar or a list of one element
// per prompt. A scalar host or port serves every prompt; a room names one
// sequence, so several prompts need a list of rooms and n must be 1.
func (r *apiRequest) parseBootstrap(v *fastjson.Value) *apiError {
	host, port, room := present(v, "bootstrap_host"), present(v, "bootstrap_port"), present(v, "bootstrap_room")
	if host == nil && port == nil && room == nil {
		return nil
	}
	if host == nil || port == nil || room == nil {
		return badRequest("bootstrap_host, bootstrap_port and bootstrap_room go together; got only some of them")
	}
	if r.remoteDecode || r.remotePrefill {
		return badRequest("kv_transfer_params (vLLM) and bootstrap_room (SGLang) are two prefill/decode protocols; a request uses one")
	}
	np := len(r.prompts)
	if r.n != 1 || (room.Type() != fastjson.TypeArray && np > 1) {
		return badRequest("bootstrap_room needs one room per sequence: a list of %d rooms, one per prompt, and n of 1", np)
	}
	b := &bootstrapFields{hosts: make([]string, np), ports: make([]int, np), rooms: make([]uint64, np)}
	if aerr := perPrompt(host, "bootstrap_host", "a non-empty string", np, func(i int, x *fastjson.Value) bool {
		s, err := x.StringBytes()
		b.hosts[i] = string(s)
		return err == nil && len(s) > 0
	}); aerr != nil {
		return aerr
	}
	if aerr := perPrompt(port, "bootstrap_port", "a port number (1 to 65535)", np, func(i int, x *fastjson.Value) bool {
		n, err := x.Int()
		b.ports[i] = n
		return err == nil && n > 0 && n <= 65535
	}); aerr != nil {
		return aerr
	}
	if aerr := perPrompt(room, "bootstrap_room", "a non-negative integer below 2^64", np, func(i int, x *fastjson.Value) bool {
		n, err := x.Uint64() // exact: fastjson keeps the number's text
		b.rooms[i] = n
		return err == nil
	}); aerr != nil {
		return aerr
	}
	r.boot = b
	return nil
}

// present returns the field key of v, or nil when it is absent or null.
func present(v *fastjson.Value, key string) *fastjson.Value {
	f := v.Get(key)
	if f == nil || f.Type() == fastjson.TypeNull {
		return nil
	}
	return f
}

// perPrompt calls ok for each of n prompts with its element of f, a list
// of n elements or a scalar that serves every prompt; ok stores the element
// and reports whether it is valid, what describing a valid one.
func perPrompt(f *fastjson.Value, key, what string, n int, ok func(i int, x *fastjson.Value) bool) *apiError {
	if f.Type() != fastjson.TypeArray {
		for i := range n {
			if !ok(i, f) {
				return badRequest("%s must be %s or a list of them, one per prompt", key, what)
			}
		}
		return nil
	}
	items := f.GetArray()
	if len(items) != n {
		return badRequest("%s has %d elements for %d prompts; it needs one per prompt", key, len(items), n)
	}
	for i, x := range items {
		if !ok(i, x) {
			return badRequest("%s[%d] must be %s", key, i, what)
		}
	}
	return nil
}

func (r *apiRequest) parsePrompt(p *fastjson.Value, vocab uint32) *apiError {
	if p == nil || p.Type() == fastjson.TypeNull {
		return badRequest("prompt is required")
	}
	switch p.Type() {
	case fastjson.TypeString:
		r.prompts = [][]uint32{appendTokens(nil, string(p.GetStringBytes()), vocab)}
		return nil
	case fastjson.TypeArray:
	default:
		return badRequest("prompt must be a string, an array of strings, an array of token ids or an array of such arrays")
	}
	items := p.GetArray()
	if len(items) == 0 {
		return badRequest("The prompt cannot be empty.")
	}
	switch items[0].Type() {
	case fastjson.TypeNumber:
		ids, aerr := tokenIDs(items, vocab)
		if aerr != nil {
			return aerr
		}
		r.prompts = [][]uint32{ids}
	case fastjson.TypeString:
		for _, it := range items {
			s, err := it.StringBytes()
			if err != nil {
				return badRequest("prompt array items must all be strings")
			}
			r.prompts = append(r.prompts, appendTokens(nil, string(s), vocab))
		}
	case fastjson.TypeArray:
		for _, it := range items {
			inner, err := it.Array()
			if err != nil {
				return badRequest("prompt array items must all be arrays of token ids")
			}
			ids, aerr := tokenIDs(inner, vocab)
			if aerr != nil {
				return aerr
			}
			r.prompts = append(r.prompts, ids)
		}
	default:
		return badRequest("prompt must be a string, an array of strings, an array of token ids or an array of such arrays")
	}
	return nil
}

func tokenIDs(items []*fastjson.Value, vocab uint32) ([]uint32, *apiError) {
	ids := make([]uint32, len(items))
	for i, it := range items {
		n, err := it.Int64()
		if err != nil {
			return nil, badRequest("token ids must be integers")
		}
		if n < 0 || n >= int64(vocab) {
			return nil, badRequest("Token id %d is out of vocabulary", n)
		}
		ids[i] = uint32(n)
	}
	return ids, nil
}

func optBool(v *fastjson.Value, key string) (bool, error) {
	f := v.Get(key)
	if f == nil || f.Type() == fastjson.TypeNull {
		return false, nil
	}
	b, err := f.Bool()
	if err != nil {
		return false, fmt.Errorf("%s must be a boolean", key)
	}
	return b, nil
}

func optInt(v *fastjson.Value, key string) (int, bool, error) {
	f := v.Get(key)
	if f == nil || f.Type() == fastjson.TypeNull {
		return 0, false, nil
	}
	n, err := f.Int()
	if err != nil {
		return 0, false, fmt.Errorf("%s must be an integer", key)
	}
	return n, true, nil
}

// Chat template markers (Llama 3 style). A conversation renders as
//
//	<|begin_of_text|>[tools header]{<|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|>}…
//	<|start_header_id|>assistant<|end_header_id|>\n\n
//
// so an earlier turn's prompt is a text prefix of a later turn's, and (the
// generation prompt ending in a newline) a token prefix too.
//
// The markers are exported so that a client can predict the rendering (the
// benchmark's ideal hit rate does).
const (
	ChatBOS    = "<|begin_of_text|>"
	ChatStart  = "<|start_header_id|>"
	ChatEnd    = "<|end_header_id|>\n\n"
	ChatEOT    = "<|eot_id|>"
	ChatGenHdr = ChatStart + "assistant" + ChatEnd
)

// renderChat renders messages (and tools, first) into prompt text.
func renderChat(v *fastjson.Value) ([]byte, *apiError) {
	msgs := v.Get("messages")
	if msgs == nil || msgs.Type() != fastjson.TypeArray {
		return nil, badRequest("messages must be an array")
	}
	items := msgs.GetArray()
	if len(items) == 0 {
		return nil, badRequest("messages must not be empty")
	}
	addGen := true
	if g := v.Get("add_generation_prompt"); g != nil && g.Type() != fastjson.TypeNull {
		b, err := g.Bool()
		if err != nil {
			return nil, badRequest("add_generation_prompt must be a boolean")
		}
		addGen = b
	}
	// vLLM's continue_final_message: the last message (the assistant's,
	// partial) stays open, for the model to continue.
	cont := false
	if c := v.Get("continue_final_message"); c != nil && c.Type() != fastjson.TypeNull {
		b, err := c.Bool()
		if err != nil {
			return nil, badRequest("continue_final_message must be a boolean")
		}
		cont = b
	}
	if cont && addGen {
		return nil, badRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
	}
	b := append(make([]byte, 0, 256), ChatBOS...)
	if tools := v.Get("tools"); tools != nil && tools.Type() != fastjson.TypeNull {
		if tools.Type() != fastjson.TypeArray {
			return nil, badRequest("tools must be an array")
		}
		b = append(b, ChatStart+"system"+ChatEnd+"Tools: "...)
		b = tools.MarshalTo(b)
		b = append(b, ChatEOT...)
	}
	for i, m := range items {
		if m.Type() != fastjson.TypeObject {
			return nil, badRequest("each message must be an object")
		}
		role := m.GetStringBytes("role")
		if len(role) == 0 {
			return nil, badRequest("each message needs a string role")
		}
		b = append(b, ChatStart...)
		b = append(b, role...)
		b = append(b, ChatEnd...)
		if c := m.Get("content"); c != nil {
			switch c.Type() {
			case fastjson.TypeNull:
			case fastjson.TypeString:
				b = append(b, c.GetStringBytes()...)
			case fastjson.TypeArray:
				for _, part := range c.GetArray() {
					typ := part.GetStringBytes("type")
					switch {
					case string(typ) == "text":
						b = append(b, part.GetStringBytes("text")...)
					case len(typ) > 0:
						b = append(b, "<|"...)
						b = append(b, typ...)
						b = append(b, "|>"...)
					default:
						return nil, badRequest("content parts need a type")
					}
				}
			default:
				return nil, badRequest("message content must be a string, an array of parts or null")
			}
		}
		if tc := m.Get("tool_calls"); tc != nil && tc.Type() == fastjson.TypeArray && len(tc.GetArray()) > 0 {
			b = tc.MarshalTo(b)
		}
		if cont && i == len(items)-1 {
			break
		}
		b = append(b, ChatEOT...)
	}
	if addGen {
		b = append(b, ChatGenHdr...)
	}
	return b, nil
}
