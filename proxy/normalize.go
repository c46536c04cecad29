package proxy

import (
	"bytes"

	"github.com/valyala/fastjson"

	"github.com/kvroute/kvroute/routing"
)

// --normalize-prompts rewrites the text of prompts (a completion's prompt
// strings, a chat message's content and text parts) to one normal form, so
// that clients that send "the same" system prompt with different line
// endings or trailing blanks share the engine's prefix cache. Outside
// fenced code blocks (lines between ``` or ~~~ fences), and only there:
//   - byte-order marks (U+FEFF) are removed;
//   - a line's trailing carriage return, spaces and tabs are removed (CRLF
//     becomes LF; the last line's trailing blanks go too).
//
// Nothing else changes: not the lines inside a fenced block, not
// indentation, not runs of blanks inside a line, not a lone carriage
// return inside a line, not any other field. (Fence lines themselves are
// normalised like the text outside.) A body whose prompts are already in normal form is
// forwarded byte for byte; one that changed is re-serialised (the same
// members in the same order) and parsed again, so that routing sees what
// the engine will see.

var (
	bomUTF8 = []byte("\uFEFF")
	blanks  = " \t\r"
)

// normalizeText appends the normal form of s to dst and reports whether it
// differs from s.
func normalizeText(dst, s []byte) ([]byte, bool) {
	orig, start, fenced := s, len(dst), false
	for len(s) > 0 {
		line := s
		nl := bytes.IndexByte(s, '\n')
		if nl >= 0 {
			line, s = s[:nl], s[nl+1:]
		} else {
			s = nil
		}
		if isFence(line) {
			fenced = !fenced
		} else if fenced {
			dst = append(dst, line...)
			if nl >= 0 {
				dst = append(dst, '\n')
			}
			continue
		}
		n := len(dst)
		for {
			i := bytes.Index(line, bomUTF8)
			if i < 0 {
				break
			}
			dst = append(dst, line[:i]...)
			line = line[i+len(bomUTF8):]
		}
		dst = append(dst, line...)
		dst = dst[:n+len(bytes.TrimRight(dst[n:], blanks))]
		if nl >= 0 {
			dst = append(dst, '\n')
		}
	}
	return dst, !bytes.Equal(dst[start:], orig)
}

// isFence reports whether line opens or closes a fenced code block
// (CommonMark: up to three spaces of indentation, then ``` or ~~~).
func isFence(line []byte) bool {
	t := bytes.TrimLeft(line, " ")
	if len(line)-len(t) > 3 {
		return false
	}
	return bytes.HasPrefix(t, []byte("```")) || bytes.HasPrefix(t, []byte("~~~"))
}

// normalizePrompts rewrites st's prompts to normal form in its parsed body
// and returns the new body, or nil when every prompt already was.
func (s *Server) normalizePrompts(st *reqState) []byte {
	a := &st.normArena
	changed := false
	text := func(v *fastjson.Value) *fastjson.Value {
		if v == nil || v.Type() != fastjson.TypeString {
			return nil
		}
		b, _ := v.StringBytes()
		out, ch := normalizeText(st.normBuf[:0], b)
		st.normBuf = out[:0]
		if !ch {
			return nil
		}
		changed = true
		return a.NewString(string(out))
	}
	switch st.req.Kind {
	case routing.KindCompletions:
		p := st.root.Get("prompt")
		if nv := text(p); nv != nil {
			st.root.Set("prompt", nv)
		} else if p != nil && p.Type() == fastjson.TypeArray {
			for i, item := range p.GetArray() {
				if nv := text(item); nv != nil {
					p.SetArrayItem(i, nv)
				}
			}
		}
	case routing.KindChat:
		for _, m := range st.root.GetArray("messages") {
			c := m.Get("content")
			if nv := text(c); nv != nil {
				m.Set("content", nv)
				continue
			}
			for _, part := range c.GetArray() {
				if string(part.GetStringBytes("type")) == "text" {
					if nv := text(part.Get("text")); nv != nil {
						part.Set("text", nv)
					}
				}
			}
		}
	}
	if !changed {
		return nil
	}
	return st.root.MarshalTo(nil)
}
