package workload

import (
	"strconv"

	"github.com/kvroute/kvroute/bench/sim"
)

// Prompt rendering. A session's turn k is rendered so that it extends turn
// k−1's prompt followed by turn k−1's answer, token for token, which is what
// lets an engine's prefix cache reuse a conversation's history:
//
//	completions: [system "\n\n"] user₀ answer₀ "\n\n" user₁ answer₁ … "\n\n" userₖ
//	chat:        [system] user₀ assistant(answer₀) … userₖ
//
// Synthetic words start with a space, so an answer (which does too) joins
// the user text at a token boundary.

// promptSep separates the system prompt from the first question and one
// exchange from the next (SGLang's generated-shared-prefix uses "\n\n").
const promptSep = "\n\n"

// appendText appends a piece of text to a prompt: as it is (appendRaw, the
// prompt the engine sees) or escaped for a JSON string
// (sim.AppendJSONEscaped, the prompt inside a request body).
type appendText func(b []byte, text string) []byte

func appendRaw(b []byte, text string) []byte { return append(b, text...) }

// appendUserText appends turn t's user text with add.
func appendUserText(b []byte, t *Turn, add appendText) []byte {
	if t.Blocks == nil {
		return add(b, t.User)
	}
	for _, blk := range t.Blocks {
		b = add(b, sim.SyntheticText(blk.Tokens, blk.Seed))
	}
	return b
}

// appendCompletionPrompt appends the completions prompt of turn k of s with
// add; answers holds the answers of turns 0…k−1.
func appendCompletionPrompt(b []byte, s *Session, k int, answers []string, add appendText) []byte {
	if s.System != "" {
		b = add(b, s.System)
		b = add(b, promptSep)
	}
	for i := 0; i <= k; i++ {
		if i > 0 {
			b = add(b, answers[i-1])
			b = add(b, promptSep)
		}
		b = appendUserText(b, &s.Turns[i], add)
	}
	return b
}

// appendChatPrompt appends the simulator's rendering of the chat messages of
// turn k of s, generation header included (for IdealHitRate only: a real
// server applies its own template).
func appendChatPrompt(b []byte, s *Session, k int, answers []string) []byte {
	b = append(b, sim.ChatBOS...)
	msg := func(role string, content func([]byte) []byte) {
		b = append(b, sim.ChatStart...)
		b = append(b, role...)
		b = append(b, sim.ChatEnd...)
		b = content(b)
		b = append(b, sim.ChatEOT...)
	}
	if s.System != "" {
		msg("system", func(b []byte) []byte { return append(b, s.System...) })
	}
	for i := 0; i <= k; i++ {
		if i > 0 {
			msg("assistant", func(b []byte) []byte { return append(b, answers[i-1]...) })
		}
		msg("user", func(b []byte) []byte { return appendUserText(b, &s.Turns[i], appendRaw) })
	}
	return append(b, sim.ChatGenHdr...)
}

// appendPrompt appends the prompt of turn k as the simulated engine sees it.
func appendPrompt(b []byte, api API, s *Session, k int, answers []string) []byte {
	if api == APIChat {
		return appendChatPrompt(b, s, k, answers)
	}
	return appendCompletionPrompt(b, s, k, answers, appendRaw)
}

// AppendBody appends the JSON body of turn k of s: streaming with a usage
// chunk, max_tokens = the turn's output length, ignore_eos so exactly that
// many tokens are generated. model "" leaves the field out (the server's
// default model).
func AppendBody(b []byte, api API, model string, s *Session, k int, answers []string) []byte {
	b = append(b, '{')
	if model != "" {
		b = append(b, `"model":"`...)
		b = sim.AppendJSONEscaped(b, model)
		b = append(b, `",`...)
	}
	if api == APIChat {
		b = append(b, `"messages":[`...)
		first := true
		msg := func(role string, text func([]byte) []byte) {
			if !first {
				b = append(b, ',')
			}
			first = false
			b = append(b, `{"role":"`...)
			b = append(b, role...)
			b = append(b, `","content":"`...)
			b = text(b)
			b = append(b, `"}`...)
		}
		if s.System != "" {
			msg("system", func(b []byte) []byte { return sim.AppendJSONEscaped(b, s.System) })
		}
		for i := 0; i <= k; i++ {
			if i > 0 {
				msg("assistant", func(b []byte) []byte { return sim.AppendJSONEscaped(b, answers[i-1]) })
			}
			msg("user", func(b []byte) []byte { return appendUserText(b, &s.Turns[i], sim.AppendJSONEscaped) })
		}
		b = append(b, "],"...)
	} else {
		b = append(b, `"prompt":"`...)
		b = appendCompletionPrompt(b, s, k, answers, sim.AppendJSONEscaped)
		b = append(b, `",`...)
	}
	b = append(b, `"max_tokens":`...)
	b = strconv.AppendInt(b, int64(s.Turns[k].OutputTokens), 10)
	return append(b, `,"stream":true,"stream_options":{"include_usage":true},"ignore_eos":true}`...)
}
