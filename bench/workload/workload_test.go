package workload

import (
	"bytes"
	"encoding/json"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/bench/leakcheck"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/prefix"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

func build(t *testing.T, c Config) *Workload {
	t.Helper()
	w, err := c.Build()
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func TestWorkloadDeterministic(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{name: "shared-prefix", cfg: Config{Kind: KindSharedPrefix, Groups: 4, PromptsPerGroup: 3, SystemTokens: 64, QuestionTokens: 8, OutputTokens: 4}},
		{name: "multi-turn", cfg: Config{Kind: KindMultiTurn, Conversations: 3}},
		{name: "random", cfg: Config{Kind: KindRandom, Requests: 5, InputTokens: 32}},
		{name: "hot-prefix", cfg: Config{Kind: KindHotPrefix, Requests: 5, SystemTokens: 64}},
		{name: "near-identical", cfg: Config{Kind: KindNearIdentical, Groups: 3, PromptsPerGroup: 8, SystemTokens: 64, QuestionTokens: 8, OutputTokens: 4}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := tc.cfg, tc.cfg
			a.Seed, b.Seed = 7, 7
			wa, wb := build(t, a), build(t, b)
			if !reflect.DeepEqual(wa.Sessions, wb.Sessions) {
				t.Fatal("same seed gave different workloads")
			}
			b.Seed = 8
			if wc := build(t, b); reflect.DeepEqual(wa.Sessions, wc.Sessions) {
				t.Fatal("another seed gave the same workload")
			}
		})
	}
}

func TestSharedPrefixShape(t *testing.T) {
	const groups, per, sys, q, out = 6, 5, 100, 20, 7
	w := build(t, Config{Kind: KindSharedPrefix, Seed: 1, Groups: groups, PromptsPerGroup: per,
		SystemTokens: sys, QuestionTokens: q, OutputTokens: out})
	if got := w.Requests(); got != groups*per {
		t.Fatalf("requests = %d, want %d", got, groups*per)
	}
	bySystem := map[string]int{}
	questions := map[string]bool{}
	inOrder := true
	for i, s := range w.Sessions {
		bySystem[s.System]++
		turn := s.Turns[0]
		questions[turn.User] = true
		if i > 0 && s.Group < w.Sessions[i-1].Group {
			inOrder = false
		}
		prompt := string(appendCompletionPrompt(nil, &s, 0, nil, appendRaw))
		if got, want := sim.CountTokens(prompt), sys+2+q; got != want {
			t.Fatalf("prompt of %d tokens, want %d (system + \\n\\n + question)", got, want)
		}
		if sim.CountTokens(s.System) != sys || sim.CountTokens(turn.User) != q || turn.OutputTokens != out {
			t.Fatalf("lengths %d/%d/%d", sim.CountTokens(s.System), sim.CountTokens(turn.User), turn.OutputTokens)
		}
	}
	if len(bySystem) != groups {
		t.Fatalf("%d distinct system prompts, want %d", len(bySystem), groups)
	}
	for _, n := range bySystem {
		if n != per {
			t.Fatalf("a group has %d prompts, want %d", n, per)
		}
	}
	if len(questions) != groups*per {
		t.Fatalf("%d distinct questions, want %d", len(questions), groups*per)
	}
	if inOrder {
		t.Fatal("rows are not shuffled")
	}
}

func TestMultiTurnShape(t *testing.T) {
	c := Config{Kind: KindMultiTurn, Seed: 3, Conversations: 8}.Defaults()
	w := build(t, c)
	for _, s := range w.Sessions {
		if s.System != w.Sessions[0].System || sim.CountTokens(s.System) != 500 {
			t.Fatal("conversations do not share the 500-token prefix")
		}
		if n := len(s.Turns); n < 12 || n > 18 {
			t.Fatalf("%d turns, want 12–18", n)
		}
		for _, turn := range s.Turns {
			if u := sim.CountTokens(turn.User); u != turn.UserTokens || u < 120 || u > 160 {
				t.Fatalf("user turn of %d tokens (declared %d), want 120–160", u, turn.UserTokens)
			}
			if turn.OutputTokens < 80 || turn.OutputTokens > 120 {
				t.Fatalf("answer of %d tokens, want 80–120", turn.OutputTokens)
			}
		}
	}
}

// Turn k+1's prompt must extend turn k's prompt followed by its answer,
// token for token, for both APIs: that is what a prefix cache reuses.
func TestConversationPrefixStable(t *testing.T) {
	w := build(t, Config{Kind: KindMultiTurn, Seed: 5, Conversations: 1, TurnsMin: 4, TurnsMax: 4})
	s := &w.Sessions[0]
	var answers []string
	for k := range s.Turns {
		answers = append(answers, sim.SyntheticText(s.Turns[k].OutputTokens, uint64(k)))
	}
	vocab := sim.DefaultConfig().VocabSize
	for _, api := range []API{APICompletions, APIChat} {
		t.Run(api.String(), func(t *testing.T) {
			for k := 0; k+1 < len(s.Turns); k++ {
				cur := string(appendPrompt(nil, api, s, k, answers)) + answers[k]
				next := string(appendPrompt(nil, api, s, k+1, answers))
				a, b := sim.Tokenize(cur, vocab), sim.Tokenize(next, vocab)
				if len(b) <= len(a) || !slices.Equal(a, b[:len(a)]) {
					t.Fatalf("turn %d: prompt+answer (%d tokens) is not a token prefix of the next prompt", k, len(a))
				}
			}
		})
	}
}

func TestBodies(t *testing.T) {
	w := build(t, Config{Kind: KindMultiTurn, Seed: 5, Conversations: 1, TurnsMin: 2, TurnsMax: 2})
	s := &w.Sessions[0]
	answers := []string{" quote \" back\\slash\nnew\tline \x01 \xff"}
	for _, tc := range []struct {
		name string
		api  API
	}{
		{name: "completions", api: APICompletions},
		{name: "chat", api: APIChat},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var body struct {
				Model         string `json:"model"`
				Prompt        string `json:"prompt"`
				Messages      []struct{ Role, Content string }
				MaxTokens     int  `json:"max_tokens"`
				Stream        bool `json:"stream"`
				IgnoreEOS     bool `json:"ignore_eos"`
				StreamOptions struct {
					IncludeUsage bool `json:"include_usage"`
				} `json:"stream_options"`
			}
			raw := AppendBody(nil, tc.api, "m", s, 1, answers)
			if err := json.Unmarshal(raw, &body); err != nil {
				t.Fatalf("%v\n%s", err, raw)
			}
			if body.Model != "m" || !body.Stream || !body.IgnoreEOS || !body.StreamOptions.IncludeUsage || body.MaxTokens != s.Turns[1].OutputTokens {
				t.Fatalf("body fields wrong: %+v", body)
			}
			want := strings.ToValidUTF8(answers[0], "\uFFFD")
			if tc.api == APIChat {
				roles := []string{}
				for _, m := range body.Messages {
					roles = append(roles, m.Role)
				}
				if !slices.Equal(roles, []string{"system", "user", "assistant", "user"}) || body.Messages[2].Content != want {
					t.Fatalf("messages %v, answer %q", roles, body.Messages[2].Content)
				}
			} else if !strings.Contains(body.Prompt, want) || !strings.HasPrefix(body.Prompt, s.System+"\n\n") {
				t.Fatalf("prompt does not carry the system prompt and the answer")
			}
		})
	}
}

func TestIdealHitRateClosedForm(t *testing.T) {
	for _, tc := range []struct {
		name                  string
		groups, per, sys, que int
	}{
		{name: "sglang-shape", groups: 8, per: 16, sys: 2048, que: 128},
		{name: "few-per-group", groups: 12, per: 3, sys: 512, que: 64},
		{name: "one-group", groups: 1, per: 40, sys: 256, que: 256},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := build(t, Config{Kind: KindSharedPrefix, Seed: 9, Groups: tc.groups, PromptsPerGroup: tc.per,
				SystemTokens: tc.sys, QuestionTokens: tc.que, OutputTokens: 8})
			got := IdealHitRate(w, APICompletions, 0, 16)
			p, s, q := float64(tc.per), float64(tc.sys), float64(tc.que)
			want := (p - 1) / p * s / (s + q)
			if math.Abs(got-want) > 0.01 {
				t.Fatalf("ideal hit rate %.4f, closed form (P−1)/P·S/(S+Q) = %.4f", got, want)
			}
		})
	}
}

func TestIdealHitRateCases(t *testing.T) {
	t.Run("random shares nothing", func(t *testing.T) {
		w := build(t, Config{Kind: KindRandom, Seed: 1, Requests: 20, InputTokens: 256})
		if got := IdealHitRate(w, APICompletions, 0, 16); got != 0 {
			t.Fatalf("hit rate %v, want 0", got)
		}
	})
	t.Run("cycling repeats whole prompts", func(t *testing.T) {
		w := build(t, Config{Kind: KindRandom, Seed: 1, Requests: 10, InputTokens: 160})
		// Second pass: each prompt of 160 tokens hits 9 blocks (never the
		// last token, so not the 10th).
		got := IdealHitRate(w, APICompletions, 20, 16)
		if want := 0.5 * 144.0 / 160; math.Abs(got-want) > 1e-9 {
			t.Fatalf("hit rate %v, want %v", got, want)
		}
	})
	t.Run("multi-turn reuses history", func(t *testing.T) {
		w := build(t, Config{Kind: KindMultiTurn, Seed: 1, Conversations: 4})
		for _, api := range []API{APICompletions, APIChat} {
			if got := IdealHitRate(w, api, 0, 16); got < 0.8 || got > 0.99 {
				t.Fatalf("%s: hit rate %v, want most of the history reused", api, got)
			}
		}
	})
}

func TestTrace(t *testing.T) {
	const jsonl = `{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]}
{"timestamp": 10, "input_length": 1030, "output_length": 7, "hash_ids": [1, 2, 4]}
{"timestamp": 10, "input_length": 600, "output_length": 9, "hash_ids": [1, 5]}
{"timestamp": 2000, "input_length": 100, "output_length": 1, "hash_ids": [9]}
`
	recs, err := ReadTrace(strings.NewReader(jsonl), 0)
	if err != nil {
		t.Fatal(err)
	}
	ss := TraceSessions(recs, Config{Kind: KindTrace, Seed: 3, TraceSpeedup: 2})
	if got := ss[3].At.Milliseconds(); got != 1000 {
		t.Fatalf("At = %d ms, want 1000 (2× speed)", got)
	}
	text := func(s Session) string { return string(appendUserText(nil, &s.Turns[0], appendRaw)) }
	a, b, c := text(ss[0]), text(ss[1]), text(ss[2])
	if sim.CountTokens(a) != 1100 || sim.CountTokens(b) != 1030 {
		t.Fatalf("lengths %d, %d", sim.CountTokens(a), sim.CountTokens(b))
	}
	vocab := sim.DefaultConfig().VocabSize
	ta, tb, tc := sim.Tokenize(a, vocab), sim.Tokenize(b, vocab), sim.Tokenize(c, vocab)
	if !slices.Equal(ta[:1024], tb[:1024]) || slices.Equal(ta[1024:1030], tb[1024:1030]) {
		t.Fatal("equal hash ids must give equal blocks, different ids different ones")
	}
	if !slices.Equal(ta[:512], tc[:512]) || slices.Equal(ta[512:600], tc[512:600]) {
		t.Fatal("block 0 shared, block 1 not")
	}
	// Hand count at 16-token blocks: request 2 hits 1024 of 1030; request 3
	// hits 512 of 600; request 4 nothing.
	w := &Workload{Config: Config{Kind: KindTrace}, Sessions: ss}
	want := (1024.0 + 512) / (1100 + 1030 + 600 + 100)
	if got := IdealHitRate(w, APICompletions, 0, 16); math.Abs(got-want) > 1e-9 {
		t.Fatalf("trace hit rate %v, want %v", got, want)
	}

	t.Run("limits", func(t *testing.T) {
		ss := TraceSessions(recs, Config{Kind: KindTrace, TraceMaxInput: 700, TraceMaxOutput: 6})
		if tr := ss[0].Turns[0]; tr.UserTokens != 700 || len(tr.Blocks) != 2 || tr.Blocks[1].Tokens != 188 || tr.OutputTokens != 5 {
			t.Fatalf("truncated turn %+v", tr)
		}
		if ss[1].Turns[0].OutputTokens != 6 {
			t.Fatal("output not capped")
		}
	})
	t.Run("bad", func(t *testing.T) {
		for _, bad := range []string{
			`{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}`,
			`{"timestamp": 5, "input_length": 6, "output_length": 1, "hash_ids": [1]}` + "\n" + `{"timestamp": 4, "input_length": 6, "output_length": 1, "hash_ids": [1]}`,
			`{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}`,
			`not json`,
			``,
		} {
			if _, err := ReadTrace(strings.NewReader(bad), 0); err == nil {
				t.Errorf("accepted %q", bad)
			}
		}
	})
	if recs, err := ReadTrace(bytes.NewReader([]byte(jsonl)), 2); err != nil || len(recs) != 2 {
		t.Fatalf("limit: %d records, %v", len(recs), err)
	}
}

// Near-identical renderings tokenize differently (the engine caches them
// apart) but have the detector's normal form, and differ from the prompt
// as written in the first block; about VariantShare of the requests use
// one, every variant is used, and the truth counts what a detector that
// remembers each group's first rendering would.
func TestNearIdenticalShape(t *testing.T) {
	c := Config{Kind: KindNearIdentical, Seed: 3, Groups: 16, PromptsPerGroup: 32, SystemTokens: 600, QuestionTokens: 16, OutputTokens: 4}
	w := build(t, c)
	if w.Config.VariantShare != 0.5 {
		t.Fatalf("default variant share %v, want 0.5", w.Config.VariantShare)
	}
	const block = 1024
	var asWritten []uint64
	var rawFirst uint64
	used := map[int]int{}
	for i := range w.Sessions {
		s := &w.Sessions[i]
		used[s.Variant]++
		if s.Group != 0 {
			continue
		}
		var n prefix.Normalizer
		n.Reset(block, 2, 1)
		n.WriteString(s.System)
		if len(n.Hashes()) != 2 {
			t.Fatalf("system prompt of %d bytes gave %d normalised blocks", len(s.System), len(n.Hashes()))
		}
		toks := sim.CountTokens(s.System)
		if s.Variant == 0 {
			if asWritten == nil {
				asWritten, rawFirst = slices.Clone(n.Hashes()), n.Raw[0]
				if toks != s.SystemTokens || toks > c.SystemTokens || toks < c.SystemTokens-1 {
					t.Fatalf("system prompt: %d tokens, session says %d, config %d", toks, s.SystemTokens, c.SystemTokens)
				}
			}
			continue
		}
		if asWritten != nil {
			if !slices.Equal(n.Hashes(), asWritten) {
				t.Errorf("variant %q: normal form differs from the prompt as written", Variants[s.Variant].Name)
			}
			if n.Raw[0] == rawFirst {
				t.Errorf("variant %q: same bytes as written in the first block", Variants[s.Variant].Name)
			}
		}
	}
	if len(used) != len(Variants) {
		t.Fatalf("variants used %v, want all %d", used, len(Variants))
	}
	if share := 1 - float64(used[0])/float64(len(w.Sessions)); math.Abs(share-0.5) > 0.06 {
		t.Errorf("share of near-identical renderings %.3f, want ≈ 0.5", share)
	}
	for v := 1; v < len(Variants); v++ {
		lines := systemLines(2*lineWords, 1)
		if Variants[v].join(lines) == Variants[0].join(lines) || sim.CountTokens(Variants[v].join(lines)) == sim.CountTokens(Variants[0].join(lines)) {
			t.Errorf("variant %q: same tokens as written", Variants[v].Name)
		}
	}

	// The truth: per group, every request rendered otherwise than the
	// group's first.
	t.Run("truth", func(t *testing.T) {
		ws := &Workload{Sessions: []Session{
			{Group: 0, Variant: 1}, {Group: 0, Variant: 0}, {Group: 1, Variant: 0}, {Group: 0, Variant: 1},
			{Group: 1, Variant: 4}, {Group: 0, Variant: 2}, {Group: -1},
		}}
		if got := ws.NearIdentical(0, false); got != 3 {
			t.Errorf("as sent: %d, want 3", got)
		}
		if got := ws.NearIdentical(0, true); got != 1 { // only the doubled spaces stay
			t.Errorf("normalised: %d, want 1", got)
		}
		if got := ws.NearIdentical(14, false); got != 3+3 { // the second pass counts the same
			t.Errorf("two passes: %d, want 6", got)
		}
	})
}

// With Adapters, a prefix group's requests all name one adapter (group mod
// Adapters) and other sessions' are spread over every adapter.
func TestAdapters(t *testing.T) {
	w := build(t, Config{Kind: KindSharedPrefix, Seed: 2, Groups: 12, PromptsPerGroup: 3, SystemTokens: 16, QuestionTokens: 4, OutputTokens: 2, Adapters: 5})
	for _, s := range w.Sessions {
		if s.Model != AdapterName(s.Group%5) {
			t.Fatalf("group %d names %q", s.Group, s.Model)
		}
	}
	r := build(t, Config{Kind: KindRandom, Seed: 2, Requests: 200, InputTokens: 8, Adapters: 4})
	seen := map[string]int{}
	for _, s := range r.Sessions {
		seen[s.Model]++
	}
	if len(seen) != 4 || seen[AdapterName(0)] < 30 {
		t.Fatalf("random sessions' adapters %v, want all 4 used", seen)
	}
	if _, err := (Config{Kind: KindRandom, Adapters: -1}).Build(); err == nil {
		t.Error("negative adapters accepted")
	}
}
