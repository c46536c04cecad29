package proxy

import (
	"bytes"
)

// Usage fields kvroute reads from response bodies: the engine's count of
// prompt tokens (usage.prompt_tokens) and of those served from its prefix
// cache (usage.prompt_tokens_details.cached_tokens, present when prompt
// token details are enabled), both in vLLM's non-streaming bodies and in
// the include_usage chunk of a stream.
//
// The scanner looks for what ends both keys, `_tokens":`, and tells them
// apart by the seven bytes before it. Its first byte is rare in a body, so
// bytes.Index skips from one candidate to the next with IndexByte; a
// pattern starting with a quote, as frequent as JSON's strings, made it
// test almost every byte (a fifth of a stream's CPU in kvroute, make
// bench-proxy).
var usageAnchor = []byte(`_tokens":`)

const (
	usageKeyLen = len(`"prompt`) // == len(`"cached`)
	usagePrompt = 1
	usageCached = 2
	usageOutput = 3 // "completion_tokens": the seven bytes before the anchor
)

// usageScanner finds the last numeric values of "prompt_tokens" and
// "cached_tokens" in a response body fed to it chunk by chunk, across chunk
// boundaries, without buffering the body. The zero value is ready.
type usageScanner struct {
	win    [16]byte // the body's last bytes (all of it while shorter)
	nwin   int
	key    int  // the key whose value is being read; 0: none
	digits int  // digits read of the value
	value  int  // the value being read
	over   bool // it passed 2^40: no token count, not kept
	// The last complete values seen.
	Prompt, Cached, Output   int // Output: completion_tokens
	PromptFound, CachedFound bool
}

func (u *usageScanner) feed(p []byte) {
	q := p
	if u.key != 0 {
		q = u.readValue(q)
	} else if u.nwin > 0 {
		// An anchor begun in the previous chunk and ended in this one lies
		// in the window joined with this chunk's first bytes.
		var buf [len(u.win) + 8]byte
		j := append(append(buf[:0], u.win[:u.nwin]...), p[:min(len(p), len(usageAnchor)-1)]...)
		from := max(0, u.nwin-len(usageAnchor)+1)
		if i := bytes.Index(j[from:], usageAnchor); i >= 0 {
			s := from + i
			q = p[s+len(usageAnchor)-u.nwin:]
			if s >= usageKeyLen {
				q = u.start(keyOf(j[s-usageKeyLen:s]), q)
			}
		}
	}
	for len(q) > 0 {
		i := bytes.Index(q, usageAnchor)
		if i < 0 {
			break
		}
		at := len(p) - len(q) + i // the anchor's offset in p
		q = q[i+len(usageAnchor):]
		if at >= usageKeyLen {
			q = u.start(keyOf(p[at-usageKeyLen:at]), q)
		} else if n := usageKeyLen - at; u.nwin >= n {
			var k [usageKeyLen]byte
			copy(k[copy(k[:], u.win[u.nwin-n:u.nwin]):], p[:at])
			q = u.start(keyOf(k[:]), q)
		}
	}
	u.remember(p)
}

// remember keeps the last bytes of the body fed so far in the window.
func (u *usageScanner) remember(p []byte) {
	if len(p) >= len(u.win) {
		u.nwin = copy(u.win[:], p[len(p)-len(u.win):])
		return
	}
	if keep := len(u.win) - len(p); u.nwin > keep {
		copy(u.win[:], u.win[u.nwin-keep:u.nwin])
		u.nwin = keep
	}
	u.nwin += copy(u.win[u.nwin:], p)
}

// keyOf tells which key the seven bytes before an anchor end.
func keyOf(k []byte) int {
	switch string(k) {
	case `"prompt`:
		return usagePrompt
	case `"cached`:
		return usageCached
	case `pletion`:
		return usageOutput
	}
	return 0
}

// start begins reading key's value (none when key is 0) from q, which
// follows the anchor, and returns what is left of q.
func (u *usageScanner) start(key int, q []byte) []byte {
	if key == 0 {
		return q
	}
	u.key, u.digits, u.value, u.over = key, 0, 0, false
	return u.readValue(q)
}

// readValue consumes the number after the key (spaces allowed before it);
// anything else ends the value (null is ignored).
func (u *usageScanner) readValue(p []byte) []byte {
	for i, c := range p {
		switch {
		case c >= '0' && c <= '9':
			if !u.over {
				u.value = u.value*10 + int(c-'0')
				u.over = u.value >= 1<<40
			}
			u.digits++
		case c == ' ' && u.digits == 0:
		default:
			if u.digits > 0 && !u.over {
				switch u.key {
				case usagePrompt:
					u.Prompt, u.PromptFound = u.value, true
				case usageCached:
					u.Cached, u.CachedFound = u.value, true
				default:
					u.Output = u.value
				}
			}
			u.key = 0
			return p[i:]
		}
	}
	return nil
}
