package sim

import (
	"strings"
	"unicode/utf8"

	"github.com/zeebo/xxh3"
)

// maxPieceBytes bounds one pseudo-token. Text is cut into word-ish pieces (an
// optional leading space plus a run of ASCII letters and digits, or one other
// character) and every piece into chunks of at most this many bytes. With 6,
// English prose averages ≈ 4 bytes per token, like a BPE tokenizer
// (OpenAI's rule of thumb: a token is about four characters of English).
const maxPieceBytes = 6

// Tokenize returns the pseudo-token ids of text for a vocabulary of vocabSize
// ids. It is deterministic and prefix-stable at piece boundaries: if text
// ends at a non-alphanumeric character (a newline, punctuation), the tokens
// of text are a prefix of the tokens of text+more. Safe for concurrent use.
func Tokenize(text string, vocabSize int) []uint32 {
	return appendTokens(nil, text, uint32(vocabSize))
}

// CountTokens returns len(Tokenize(text, n)) without allocating.
func CountTokens(text string) int {
	n := 0
	forEachPiece(text, func(string) { n++ })
	return n
}

func appendTokens(dst []uint32, text string, vocab uint32) []uint32 {
	forEachPiece(text, func(p string) { dst = append(dst, pieceID(p, vocab)) })
	return dst
}

func pieceID(p string, vocab uint32) uint32 { return uint32(xxh3.HashString(p) % uint64(vocab)) }

func isAlnum(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// forEachPiece calls fn with every token-sized piece of text, in order.
func forEachPiece(text string, fn func(string)) {
	for i := 0; i < len(text); {
		c := text[i]
		j := i + 1
		switch {
		case isAlnum(c) || c == ' ' && j < len(text) && isAlnum(text[j]):
			for j < len(text) && isAlnum(text[j]) {
				j++
			}
		case c >= utf8.RuneSelf:
			_, n := utf8.DecodeRuneInString(text[i:])
			j = i + n
		}
		for k := i; k < j; k += maxPieceBytes {
			fn(text[k:min(k+maxPieceBytes, j)])
		}
		i = j
	}
}

// outputWords are the synthetic generated tokens. Each is a leading space and
// at most five letters, so it is exactly one pseudo-token and generated text
// re-tokenizes to exactly the generated ids (a later chat turn that quotes
// the answer hits the blocks the answer filled).
var outputWords = [...]string{
	" the", " of", " and", " to", " in", " is", " it", " that", " for", " on",
	" was", " with", " as", " at", " by", " this", " from", " or", " an", " be",
	" are", " which", " but", " not", " have", " one", " all", " were", " they", " we",
	" when", " there", " can", " more", " also", " some", " into", " time", " only", " other",
	" new", " would", " these", " first", " two", " may", " then", " any", " like", " over",
	" such", " our", " what", " most", " made", " after", " where", " used", " many", " its",
	" than", " well", " them", " those", " could", " shall", " each", " just", " very", " part",
	" world", " year", " state", " both", " under", " never", " same", " while", " last", " might",
	" great", " since", " long", " found", " still", " place", " until", " small", " large", " high",
	" every", " model", " cache", " token", " block", " route", " pod", " fast", " data", " light",
}

// outputWord returns the text of generated token i of a sequence seeded seed.
func outputWord(seed uint64, i int) string {
	return outputWords[splitmix(seed+uint64(i))%uint64(len(outputWords))]
}

// isEOS reports whether generated token i of a sequence is a seeded
// end-of-sequence draw with probability p.
func isEOS(seed uint64, i int, p float64) bool {
	if p <= 0 {
		return false
	}
	return float64(splitmix(seed^0x9e3779b97f4a7c15+uint64(i))>>11)/(1<<53) < p
}

// splitmix is SplitMix64's finaliser: a fast, well-mixed hash of x.
func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

// SyntheticText returns English-looking text of exactly n pseudo-tokens
// (n words from the generator's vocabulary), deterministic in seed. Load
// generators use it to build prompts of known token length; concatenating
// two results adds their token counts.
func SyntheticText(n int, seed uint64) string {
	var b strings.Builder
	b.Grow(n * 5)
	for i := range n {
		b.WriteString(outputWord(seed, i))
	}
	return b.String()
}
