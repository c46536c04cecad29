package workload

import (
	"strings"

	"github.com/kvroute/kvroute/bench/sim"
)

// Near-identical system prompts: the same system prompt sent by several
// clients, some of which render it with other line endings, trailing
// blanks, a byte-order mark or doubled spaces. The engine tokenizes each
// rendering differently and caches it apart; a prefix-aware router sees
// different block hashes. The workload is shared-prefix's (groups of
// questions after a system prompt) with the system prompt written as lines
// and, for VariantShare of the requests, rendered as one of Variants.

// Variant is one rendering of a system prompt's lines.
type Variant struct {
	// Name says what differs from the prompt as written.
	Name string
	// Normalized reports whether kvroute's --normalize-prompts rewrites
	// this rendering back to the prompt as written (it removes byte-order
	// marks and each line's trailing carriage return and blanks, nothing
	// else).
	Normalized bool
	// join renders the lines.
	join func(lines []string) string
}

// Variants are the renderings of near-identical's system prompts; the
// first is the prompt as written.
var Variants = []Variant{
	{Name: "as written (LF)", Normalized: true, join: func(l []string) string { return strings.Join(l, "\n") }},
	{Name: "CRLF line endings", Normalized: true, join: func(l []string) string { return strings.Join(l, "\r\n") }},
	{Name: "a blank before every line end", Normalized: true, join: func(l []string) string { return strings.Join(l, " \n") + " " }},
	{Name: "a byte-order mark first", Normalized: true, join: func(l []string) string { return "\uFEFF" + strings.Join(l, "\n") }},
	{Name: "two spaces inside every line", Normalized: false, join: func(l []string) string {
		d := make([]string, len(l))
		for i, line := range l {
			// Two spaces after the line's eighth word, as after a full
			// stop on a typewriter.
			if n := nthSpace(line, lineWords/2); n >= 0 {
				line = line[:n] + " " + line[n:]
			}
			d[i] = line
		}
		return strings.Join(d, "\n")
	}},
}

// lineWords is the words per line of a near-identical system prompt.
const lineWords = 16

// nthSpace returns the index of the nth space of s (counting from 1), -1
// if s has fewer.
func nthSpace(s string, n int) int {
	for i := range len(s) {
		if s[i] == ' ' {
			if n--; n == 0 {
				return i
			}
		}
	}
	return -1
}

// systemLines returns synthetic words seeded seed as lines of lineWords
// words, n tokens in all as written (n−1 when n is one more than a whole
// number of lines): each word and each line feed is a token.
func systemLines(n int, seed uint64) []string {
	w := n
	for w > 1 && w+(w+lineWords-1)/lineWords-1 > n {
		w--
	}
	words := strings.Fields(sim.SyntheticText(w, seed))
	var lines []string
	for len(words) > 0 {
		k := min(lineWords, len(words))
		lines = append(lines, strings.Join(words[:k], " "))
		words = words[k:]
	}
	return lines
}

// nearIdentical is shared-prefix (SGLang's generated-shared-prefix, rows
// shuffled) whose system prompts are lines, rendered for c.VariantShare
// of the requests as one of the near-identical Variants, drawn evenly.
func nearIdentical(c Config) []Session {
	ss := sharedPrefix(c.Seed, c.Groups, c.PromptsPerGroup, c.SystemTokens, c.QuestionTokens, c.OutputTokens)
	renders := make([][]string, c.Groups) // per group, per variant
	for i := range ss {
		s := &ss[i]
		if renders[s.Group] == nil {
			lines := systemLines(c.SystemTokens, mix(c.Seed, domSystem, uint64(s.Group)))
			renders[s.Group] = make([]string, len(Variants))
			for v := range Variants {
				renders[s.Group][v] = Variants[v].join(lines)
			}
		}
		if unit(mix(c.Seed, domVariant, uint64(i), 0)) < c.VariantShare {
			s.Variant = 1 + int(mix(c.Seed, domVariant, uint64(i), 1)%uint64(len(Variants)-1))
		}
		s.System = renders[s.Group][s.Variant]
		s.SystemTokens = sim.CountTokens(s.System)
	}
	return ss
}

// unit maps x to [0, 1).
func unit(x uint64) float64 { return float64(x>>11) / (1 << 53) }

// NearIdentical returns how many of the first n requests of w, sent in
// order (n ≤ 0: every request once; sessions reused cyclically), render their group's system prompt otherwise than the
// first of them did: what kvroute's near-identical prompt detector should
// count (kvroute_prompt_near_misses_total), when the first request of
// each group reaches it first. With normalized, renderings are counted
// as --normalize-prompts forwards them (Variant.Normalized ones as
// written).
func (w *Workload) NearIdentical(n int, normalized bool) int {
	if n <= 0 {
		n = len(w.Sessions)
	}
	first := map[int]int{}
	count := 0
	for i := range n {
		s := &w.Sessions[i%len(w.Sessions)]
		if s.Group < 0 {
			continue
		}
		v := s.Variant
		if normalized && Variants[v].Normalized {
			v = 0
		}
		if f, ok := first[s.Group]; !ok {
			first[s.Group] = v
		} else if f != v {
			count++
		}
	}
	return count
}
