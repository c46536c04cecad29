package proxy

import (
	"bytes"
)

// usagePattern introduces the engine's count of prompt tokens served from
// its prefix cache: usage.prompt_tokens_details.cached_tokens, present in
// vLLM's non-streaming bodies and in the include_usage chunk of a stream
// when prompt token details are enabled.
var usagePattern = []byte(`"cached_tokens":`)

// usageScanner finds the last cached_tokens value in a response body fed
// to it chunk by chunk, across chunk boundaries, without buffering the body.
// bytes.Index does the scanning; a byte-wise state machine only runs across
// a boundary. The zero value is ready.
type usageScanner struct {
	matched int  // bytes of usagePattern matched at the end of the last chunk
	inValue bool // after the pattern: reading the number
	digits  int  // digits read of the current value
	value   int  // the value being read
	// Found and Value are the last complete value seen.
	Found bool
	Value int
}

func (sc *usageScanner) reset() { *sc = usageScanner{} }

func (sc *usageScanner) feed(p []byte) {
	for len(p) > 0 {
		if sc.inValue {
			p = sc.readValue(p)
			continue
		}
		if sc.matched > 0 {
			// Continue a match begun in an earlier chunk, byte by byte, with
			// KMP fallback on a mismatch.
			k := 0
			for k < len(p) && sc.matched > 0 && sc.matched < len(usagePattern) {
				if p[k] == usagePattern[sc.matched] {
					k++
					sc.matched++
					continue
				}
				sc.matched = fallback(sc.matched)
			}
			if sc.matched == len(usagePattern) {
				sc.startValue()
				p = p[k:]
				continue
			}
			if k == len(p) {
				return // the chunk ended inside the pattern
			}
			p = p[k:] // no partial match left: back to bytes.Index
		}
		if i := bytes.Index(p, usagePattern); i >= 0 {
			p = p[i+len(usagePattern):]
			sc.startValue()
			continue
		}
		sc.matched = partialSuffix(p)
		return
	}
}

func (sc *usageScanner) startValue() {
	sc.matched, sc.inValue, sc.digits, sc.value = 0, true, 0, 0
}

// readValue consumes the number after the pattern (spaces allowed before
// it); anything else ends the value (null is ignored).
func (sc *usageScanner) readValue(p []byte) []byte {
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
// proper prefix of usagePattern.
func partialSuffix(p []byte) int {
	for n := min(len(usagePattern)-1, len(p)); n > 0; n-- {
		if bytes.Equal(p[len(p)-n:], usagePattern[:n]) {
			return n
		}
	}
	return 0
}

// fallback returns the length of the longest proper suffix of
// usagePattern[:m] that is also a prefix of it (KMP's failure function).
func fallback(m int) int {
	for j := m - 1; j > 0; j-- {
		if bytes.Equal(usagePattern[m-j:m], usagePattern[:j]) {
			return j
		}
	}
	return 0
}
