package sim

import (
	"slices"
	"strings"
	"testing"
)

func TestTokenizer(t *testing.T) {
	for _, w := range outputWords {
		if n := CountTokens(w); n != 1 {
			t.Errorf("output word %q is %d tokens, want 1", w, n)
		}
	}
	tests := []struct {
		name   string
		prefix string
		rest   string
	}{
		{name: "newline boundary", prefix: "The quick brown fox\n", rest: "jumps over the lazy dog."},
		{name: "punctuation boundary", prefix: "Hello, world!", rest: " How are you?"},
		{name: "chat turn", prefix: ChatBOS + ChatStart + "user" + ChatEnd + "hi" + ChatEOT + ChatGenHdr, rest: " the answer" + ChatEOT},
		{name: "unicode", prefix: "naïve café — ", rest: "日本語のテキスト"},
		{name: "synthetic", prefix: SyntheticText(100, 1), rest: SyntheticText(50, 2)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a := Tokenize(tc.prefix, 128256)
			ab := Tokenize(tc.prefix+tc.rest, 128256)
			if !slices.Equal(ab[:len(a)], a) {
				t.Errorf("tokens of %q are not a prefix of the tokens of the longer text", tc.prefix)
			}
			if !slices.Equal(a, Tokenize(tc.prefix, 128256)) {
				t.Error("not deterministic")
			}
		})
	}
	if n := CountTokens(SyntheticText(1234, 9)); n != 1234 {
		t.Errorf("SyntheticText(1234) has %d tokens", n)
	}
	prose := strings.Repeat("Prefix caching lets a router send requests that share a prompt prefix to the pod that already holds its KV blocks, until that pod saturates. ", 20)
	if bpt := float64(len(prose)) / float64(CountTokens(prose)); bpt < 3.5 || bpt > 5 {
		t.Errorf("%.2f bytes per token on English prose, want ≈ 4", bpt)
	}
}
