package sim

import (
	"strconv"
	"unicode/utf8"
)

// The response writers below append vLLM's JSON shapes by hand: key order and
// null fields follow the captured vLLM responses in shared/vllm-wire
// (completion.json, chat-completion.json, pd-prefill-response.json and the
// .sse transcripts), and no reflection runs per token.

const hexDigits = "0123456789abcdef"

// appendJSONString appends s as a JSON string literal.
func appendJSONString(b []byte, s string) []byte {
	b = append(b, '"')
	b = AppendJSONEscaped(b, s)
	return append(b, '"')
}

// AppendJSONEscaped appends s escaped for the inside of a JSON string
// literal (no quotes); invalid UTF-8 becomes U+FFFD. The load generator
// builds its request bodies with it too.
func AppendJSONEscaped(b []byte, s string) []byte {
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c >= utf8.RuneSelf {
			r, n := utf8.DecodeRuneInString(s[i:])
			if r == utf8.RuneError && n == 1 {
				b = append(b, s[start:i]...)
				b = append(b, `\ufffd`...)
				i++
				start = i
				continue
			}
			i += n
			continue
		}
		if c >= 0x20 && c != '"' && c != '\\' {
			i++
			continue
		}
		b = append(b, s[start:i]...)
		switch c {
		case '"':
			b = append(b, `\"`...)
		case '\\':
			b = append(b, `\\`...)
		case '\n':
			b = append(b, `\n`...)
		case '\r':
			b = append(b, `\r`...)
		case '\t':
			b = append(b, `\t`...)
		default:
			b = append(b, `\u00`...)
			b = append(b, hexDigits[c>>4], hexDigits[c&0xf])
		}
		i++
		start = i
	}
	return append(b, s[start:]...)
}

// appendErrorBody appends vLLM's (≥ v0.10.1) nested error envelope.
func appendErrorBody(b []byte, e *apiError) []byte {
	b = append(b, `{"error":{"message":`...)
	b = appendJSONString(b, e.msg)
	b = append(b, `,"type":`...)
	b = appendJSONString(b, e.typ)
	b = append(b, `,"param":null,"code":`...)
	b = strconv.AppendInt(b, int64(e.status), 10)
	return append(b, "}}"...)
}

// appendHead appends the fields every response and chunk starts with.
func appendHead(b []byte, r *request, object string) []byte {
	b = append(b, `{"id":`...)
	b = appendJSONString(b, r.id)
	b = append(b, `,"object":"`...)
	b = append(b, object...)
	b = append(b, `","created":`...)
	b = strconv.AppendInt(b, r.created, 10)
	b = append(b, `,"model":`...)
	return appendJSONString(b, r.model)
}

// usage is a request's token accounting; noCached leaves cached_tokens
// out.
type usage struct {
	prompt, completion, cached int
	noCached                   bool
}

func appendUsage(b []byte, u usage) []byte {
	b = append(b, `{"prompt_tokens":`...)
	b = strconv.AppendInt(b, int64(u.prompt), 10)
	b = append(b, `,"total_tokens":`...)
	b = strconv.AppendInt(b, int64(u.prompt+u.completion), 10)
	b = append(b, `,"completion_tokens":`...)
	b = strconv.AppendInt(b, int64(u.completion), 10)
	if u.noCached {
		return append(b, '}')
	}
	b = append(b, `,"prompt_tokens_details":{"cached_tokens":`...)
	b = strconv.AppendInt(b, int64(u.cached), 10)
	return append(b, "}}"...)
}

func appendFinish(b []byte, finish string) []byte {
	if finish == "" {
		return append(b, "null"...)
	}
	b = append(b, '"')
	b = append(b, finish...)
	return append(b, '"')
}

// appendSeqText appends the text of generated tokens [from, to) of s. The
// end-of-sequence token that ends a "stop" sequence has no text.
func appendSeqText(b []byte, s *seq, from, to int, pub seqPub) []byte {
	for i := from; i < to; i++ {
		if pub.finish == "stop" && i == pub.generated-1 {
			break
		}
		b = append(b, outputWord(s.seed, i)...)
	}
	return b
}

// appendKVParams appends the prefill pod's handoff reference.
func appendKVParams(b []byte, h *kvHold, p *Pod) []byte {
	b = append(b, `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":`...)
	b = appendBlockIDs(b, h.blocks)
	b = append(b, `,"remote_engine_id":`...)
	b = appendJSONString(b, p.engineID)
	b = append(b, `,"remote_request_id":`...)
	b = appendJSONString(b, h.id)
	b = append(b, `,"remote_host":`...)
	b = appendJSONString(b, p.cfg.SideChannelHost)
	b = append(b, `,"remote_port":`...)
	b = strconv.AppendInt(b, int64(p.sidePort), 10)
	b = append(b, `,"tp_size":`...)
	b = strconv.AppendInt(b, int64(p.cfg.TPSize), 10)
	return append(b, '}')
}

// appendBlockIDs appends block ids as current vLLM does: one list per KV
// cache group (one group here).
func appendBlockIDs(b []byte, ids []int32) []byte {
	b = append(b, "[["...)
	for i, id := range ids {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, int64(id), 10)
	}
	return append(b, "]]"...)
}

// appendFull appends a non-streaming response for a finished request.
func appendFull(b []byte, r *request, pubs []seqPub, kv *kvHold, p *Pod) []byte {
	object := "text_completion"
	if r.chat {
		object = "chat.completion"
	}
	b = appendHead(b, r, object)
	b = append(b, `,"choices":[`...)
	for i, s := range r.seqs {
		if i > 0 {
			b = append(b, ',')
		}
		pub := pubs[i]
		b = append(b, `{"index":`...)
		b = strconv.AppendInt(b, int64(s.index), 10)
		if r.chat {
			b = append(b, `,"message":{"role":"assistant","reasoning_content":null,"content":"`...)
			b = appendSeqText(b, s, 0, pub.generated, pub)
			b = append(b, `","tool_calls":[]},"logprobs":null,"finish_reason":`...)
			b = appendFinish(b, pub.finish)
			b = append(b, `,"stop_reason":null}`...)
		} else {
			b = append(b, `,"text":"`...)
			b = appendSeqText(b, s, 0, pub.generated, pub)
			b = append(b, `","logprobs":null,"finish_reason":`...)
			b = appendFinish(b, pub.finish)
			b = append(b, `,"stop_reason":null,"token_ids":null,"prompt_logprobs":null,"prompt_token_ids":null}`...)
		}
	}
	b = append(b, `],"service_tier":null,"system_fingerprint":null,"usage":`...)
	b = appendUsage(b, requestUsage(r, pubs))
	if r.chat {
		b = append(b, `,"prompt_logprobs":null`...)
	}
	b = append(b, `,"kv_transfer_params":`...)
	if kv != nil {
		b = appendKVParams(b, kv, p)
	} else {
		b = append(b, "null"...)
	}
	return append(b, '}')
}

// requestUsage sums a request's usage; a prompt shared by n choices counts once.
func requestUsage(r *request, pubs []seqPub) usage {
	u := usage{noCached: r.noCached}
	var last []uint32
	for i, s := range r.seqs {
		u.completion += pubs[i].generated
		if i == 0 || &s.prompt[0] != &last[0] {
			u.prompt += len(s.prompt)
			u.cached += pubs[i].cached
		}
		last = s.prompt
	}
	return u
}
