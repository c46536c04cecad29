package proxy

import (
	"bytes"
)

// Usage fields kvroute reads from response bodies: the engine's count of
// prompt tokens served from its prefix cache
// (usage.prompt_tokens_details.cached_tokens, present when prompt token
// details are enabled) and of prompt tokens (usage.prompt_tokens), both in
// vLLM's non-streaming bodies and in the include_usage chunk of a stream.
var (
	patCachedTokens = []byte(`"cached_tokens":`)
	patPromptTokens = []byte(`"prompt_tokens":`)
)

// numScanner finds the last numeric value of one JSON key (its pattern,
// quote to colon) in a response body fed to it chunk by chunk, across chunk
// boundaries, without buffering the body. bytes.Index does the scanning; a
// byte-wise state machine only runs across a boundary. Set pat, then feed.
type numScanner struct {
	pat     []byte
	matched int  // bytes of pat matched at the end of the last chunk
	inValue bool // after the pattern: reading the number
	digits  int  // digits read of the current value
	value   int  // the value being read
	// Found and Value are the last complete value seen.
	Found bool
	Value int
}

func (sc *numScanner) reset(pat []byte) { *sc = numScanner{pat: pat} }

func (sc *numScanner) feed(p []byte) {
	for len(p) > 0 {
		if sc.inValue {
			p = sc.readValue(p)
			continue
		}
		if sc.matched > 0 {
			// Continue a match begun in an earlier chunk, byte by byte, with
			// KMP fallback on a mismatch.
			k := 0
			for k < len(p) && sc.matched > 0 && sc.matched < len(sc.pat) {
				if p[k] == sc.pat[sc.matched] {
					k++
					sc.matched++
					continue
				}
				sc.matched = fallback(sc.pat, sc.matched)
			}
			if sc.matched == len(sc.pat) {
				sc.startValue()
				p = p[k:]
				continue
			}
			if k == len(p) {
				return // the chunk ended inside the pattern
			}
			p = p[k:] // no partial match left: back to bytes.Index
		}
		if i := bytes.Index(p, sc.pat); i >= 0 {
			p = p[i+len(sc.pat):]
			sc.startValue()
			continue
		}
		sc.matched = partialSuffix(sc.pat, p)
		return
	}
}

func (sc *numScanner) startValue() {
	sc.matched, sc.inValue, sc.digits, sc.value = 0, true, 0, 0
}

// readValue consumes the number after the pattern (spaces allowed before
// it); anything else ends the value (null is ignored).
func (sc *numScanner) readValue(p []byte) []byte {
	for i, c := range p {
		switch {
		case c >= '0' && c <= '9' && sc.value < 1<<40:
			sc.value = sc.value*10 + int(c-'0')
			sc.digits++
		case c == ' ' && sc.digits == 0:
		default:
			if sc.digits > 0 {
				sc.Found, sc.Value = true, sc.value
			}
			sc.inValue = false
			return p[i:]
		}
	}
	return nil
}

// partialSuffix returns the length of the longest suffix of p that is a
// proper prefix of pat.
func partialSuffix(pat, p []byte) int {
	for n := min(len(pat)-1, len(p)); n > 0; n-- {
		if bytes.Equal(p[len(p)-n:], pat[:n]) {
			return n
		}
	}
	return 0
}

// fallback returns the length of the longest proper suffix of pat[:m]
// that is also a prefix of pat (KMP's failure function).
func fallback(pat []byte, m int) int {
	for j := m - 1; j > 0; j-- {
		if bytes.Equal(pat[m-j:m], pat[:j]) {
			return j
		}
	}
	return 0
}
