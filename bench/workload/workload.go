// Package workload generates the seeded request streams kvbench sends: SGLang's
// generated shared prefix, vLLM's multi-turn conversations, random prompts, a
// hot prefix, near-identical system prompts and Mooncake trace replay. It owns how a session's turns render
// as OpenAI request bodies and the ideal (infinite-cache) prefix hit rate a
// workload allows; it knows nothing of how or where requests are sent.
package workload

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/prefix"
)

// Sentinel errors.
var (
	// ErrConfig is wrapped by every configuration error.
	ErrConfig = errors.New("workload: invalid config")
	// ErrTrace is wrapped by errors reading a Mooncake trace.
	ErrTrace = errors.New("workload: bad trace")
)

// Workload kinds (Config.Kind).
const (
	KindSharedPrefix = "shared-prefix"
	KindMultiTurn    = "multi-turn"
	KindRandom       = "random"
	KindHotPrefix    = "hot-prefix"
	KindTrace        = "trace"
	// KindNearIdentical is shared-prefix whose system prompts some clients
	// render near-identically (nearidentical.go).
	KindNearIdentical = "near-identical"
)

// Kinds returns the workload kinds in documentation order.
func Kinds() []string {
	return []string{KindSharedPrefix, KindMultiTurn, KindRandom, KindHotPrefix, KindNearIdentical, KindTrace}
}

// Workload is a generated, immutable list of sessions. It is deterministic
// in its config (seed included) and safe for concurrent reads.
type Workload struct {
	// Config is what the workload was built from.
	Config Config
	// Sessions are sent in order (open loop) or handed to workers in order
	// (closed loop).
	Sessions []Session
}

// Session is a sequence of requests sent one after another: a conversation
// whose turn k+1 is sent only after turn k's answer arrived, and carries
// that answer in its history. Single-request workloads have one turn per
// session.
type Session struct {
	// System is the shared prefix (system prompt); "" for none. Sessions of
	// one prefix group share the same string.
	System string
	// SystemTokens is System's length in tokens.
	SystemTokens int
	// Turns are the session's requests in order.
	Turns []Turn
	// At is when the session's first request is due, relative to the start
	// of the run, in modelled time (trace replay only; 0 otherwise).
	At time.Duration
	// Group is the prefix group (shared-prefix, hot-prefix,
	// near-identical), else -1.
	Group int
	// Variant is how System is rendered: 0, as written; else an index of
	// Variants (near-identical only).
	Variant int
	// Model is the model the session's requests name ("" for the load's
	// model): one of the LoRA adapters when Config.Adapters > 0.
	Model string
}

// Turn is one request of a session.
type Turn struct {
	// User is the user's text of this turn ("" when Blocks is set).
	User string
	// UserTokens is the user text's length in tokens.
	UserTokens int
	// Blocks, when non-nil, describe the user text instead of User (trace
	// replay, where prompts are too large to keep): block i is the first
	// Tokens words of sim.SyntheticText(TraceBlockTokens, Seed), so equal
	// trace hash ids give equal text.
	Blocks []TextBlock
	// HashIDs are the trace's block hash ids (trace replay only).
	HashIDs []uint64
	// OutputTokens is the request's max_tokens (ignore_eos makes the engine
	// generate exactly this many).
	OutputTokens int
	// AnswerSeed seeds the placeholder answer of OutputTokens words that
	// IdealHitRate assumes for this turn (multi-turn only; the real answer
	// comes from the server).
	AnswerSeed uint64
}

// TextBlock is a run of synthetic words: the first Tokens words of
// sim.SyntheticText(n, Seed) for any n ≥ Tokens.
type TextBlock struct {
	Seed   uint64
	Tokens int
}

// Requests returns the number of requests in w (turns of all sessions).
func (w *Workload) Requests() int {
	n := 0
	for i := range w.Sessions {
		n += len(w.Sessions[i].Turns)
	}
	return n
}

// MultiTurn reports whether some session has more than one turn.
func (w *Workload) MultiTurn() bool {
	for i := range w.Sessions {
		if len(w.Sessions[i].Turns) > 1 {
			return true
		}
	}
	return false
}

// Config describes a workload. Fields that do not apply to Kind are
// ignored; zero fields take the kind's published default (see Defaults).
// Lengths are in tokens (the simulator's tokenizer: one synthetic word is
// one token, ~4.8 bytes).
type Config struct {
	Kind string `json:"kind"`
	// Seed makes the workload reproducible.
	Seed uint64 `json:"seed"`

	// shared-prefix (SGLang generated-shared-prefix), hot-prefix and
	// near-identical.
	Groups          int `json:"groups,omitempty"`
	PromptsPerGroup int `json:"prompts_per_group,omitempty"`
	SystemTokens    int `json:"system_tokens,omitempty"`
	QuestionTokens  int `json:"question_tokens,omitempty"`
	// OutputTokens is max_tokens of every request (shared-prefix,
	// hot-prefix, near-identical, random).
	OutputTokens int `json:"output_tokens,omitempty"`
	// VariantShare is the share of near-identical's requests whose system
	// prompt is rendered as one of the near-identical Variants (evenly
	// over them); the others send it as written.
	VariantShare float64 `json:"variant_share,omitempty"`
	// Adapters > 0 sends every request to one of that many LoRA adapters,
	// named by AdapterName: a prefix group's requests to adapter group mod
	// Adapters (one tenant's fine-tune behind its system prompts), other
	// sessions' drawn uniformly (shared-prefix, near-identical, random).
	Adapters int `json:"adapters,omitempty"`

	// random and hot-prefix.
	Requests    int `json:"requests,omitempty"`
	InputTokens int `json:"input_tokens,omitempty"`

	// multi-turn (vLLM benchmarks/multi_turn shape): a common prefix for
	// all conversations, then turns of user text and answers; bounds are
	// inclusive and drawn uniformly.
	Conversations int `json:"conversations,omitempty"`
	PrefixTokens  int `json:"prefix_tokens,omitempty"`
	TurnsMin      int `json:"turns_min,omitempty"`
	TurnsMax      int `json:"turns_max,omitempty"`
	UserMin       int `json:"user_min,omitempty"`
	UserMax       int `json:"user_max,omitempty"`
	AnswerMin     int `json:"answer_min,omitempty"`
	AnswerMax     int `json:"answer_max,omitempty"`

	// trace: a Mooncake JSONL file (see ReadTrace).
	TracePath string `json:"trace_path,omitempty"`
	// TraceLimit replays only the first TraceLimit lines (0: all).
	TraceLimit int `json:"trace_limit,omitempty"`
	// TraceSpeedup divides the trace's timestamps (2: twice the rate).
	TraceSpeedup float64 `json:"trace_speedup,omitempty"`
	// TraceMaxInput truncates longer prompts to their first TraceMaxInput
	// tokens (whole 512-token blocks kept first); 0: no limit.
	TraceMaxInput int `json:"trace_max_input,omitempty"`
	// TraceMaxOutput caps output lengths; 0: no limit.
	TraceMaxOutput int `json:"trace_max_output,omitempty"`
}

// Defaults returns c with every zero field of its kind set to the
// published default: SGLang's generated-shared-prefix dataset 64 × 16,
// system 2,048, question 128, output 256 (python/sglang/bench_serving.py,
// --dataset-name generated-shared-prefix); vLLM's multi-turn benchmark
// 500-token common prefix, 12–18 turns, user 120–160, answers 80–120
// (benchmarks/multi_turn/generate_multi_turn.json); vLLM's random dataset
// 1,024 in / 128 out (`vllm bench serve --dataset-name random`). Hot-prefix
// and near-identical take shared-prefix's lengths; near-identical renders
// half of its requests' system prompts near-identically.
func (c Config) Defaults() Config {
	set := func(p *int, v int) {
		if *p == 0 {
			*p = v
		}
	}
	switch c.Kind {
	case KindSharedPrefix, KindHotPrefix, KindNearIdentical:
		if c.Kind == KindHotPrefix {
			set(&c.Requests, 1024)
		} else {
			set(&c.Groups, 64)
			set(&c.PromptsPerGroup, 16)
		}
		if c.Kind == KindNearIdentical && c.VariantShare == 0 {
			c.VariantShare = 0.5
		}
		set(&c.SystemTokens, 2048)
		set(&c.QuestionTokens, 128)
		set(&c.OutputTokens, 256)
	case KindRandom:
		set(&c.Requests, 1024)
		set(&c.InputTokens, 1024)
		set(&c.OutputTokens, 128)
	case KindMultiTurn:
		set(&c.Conversations, 64)
		set(&c.PrefixTokens, 500)
		set(&c.TurnsMin, 12)
		set(&c.TurnsMax, 18)
		set(&c.UserMin, 120)
		set(&c.UserMax, 160)
		set(&c.AnswerMin, 80)
		set(&c.AnswerMax, 120)
	case KindTrace:
		if c.TraceSpeedup == 0 {
			c.TraceSpeedup = 1
		}
	}
	return c
}

// Validate reports the first problem of c (after Defaults).
func (c Config) Validate() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s: "+format, append([]any{ErrConfig, c.Kind}, a...)...)
	}
	pos := func(name string, v int) error {
		if v < 1 {
			return bad("%s must be ≥ 1, got %d", name, v)
		}
		return nil
	}
	rng := func(name string, lo, hi int) error {
		if lo < 1 || hi < lo {
			return bad("%s range %d–%d is empty or not positive", name, lo, hi)
		}
		return nil
	}
	var errs []error
	switch c.Kind {
	case KindSharedPrefix, KindHotPrefix, KindNearIdentical:
		if c.Kind == KindHotPrefix {
			errs = append(errs, pos("requests", c.Requests))
		} else {
			errs = append(errs, pos("groups", c.Groups), pos("prompts per group", c.PromptsPerGroup))
		}
		if c.Adapters < 0 {
			errs = append(errs, bad("adapters must not be negative"))
		}
		if !(c.VariantShare >= 0 && c.VariantShare <= 1) {
			errs = append(errs, bad("variant share %v must be between 0 and 1", c.VariantShare))
		}
		errs = append(errs, pos("system tokens", c.SystemTokens), pos("question tokens", c.QuestionTokens),
			pos("output tokens", c.OutputTokens))
	case KindRandom:
		errs = append(errs, pos("requests", c.Requests), pos("input tokens", c.InputTokens), pos("output tokens", c.OutputTokens))
		if c.Adapters < 0 {
			errs = append(errs, bad("adapters must not be negative"))
		}
	case KindMultiTurn:
		errs = append(errs, pos("conversations", c.Conversations), rng("turns", c.TurnsMin, c.TurnsMax),
			rng("user tokens", c.UserMin, c.UserMax), rng("answer tokens", c.AnswerMin, c.AnswerMax))
		if c.PrefixTokens < 0 {
			errs = append(errs, bad("prefix tokens must not be negative"))
		}
	case KindTrace:
		if c.TracePath == "" {
			errs = append(errs, bad("no trace file"))
		}
		if !(c.TraceSpeedup > 0) {
			errs = append(errs, bad("speedup %v must be positive", c.TraceSpeedup))
		}
		if c.TraceLimit < 0 || c.TraceMaxInput < 0 || c.TraceMaxOutput < 0 {
			errs = append(errs, bad("limits must not be negative"))
		}
	default:
		return fmt.Errorf("%w: unknown workload %q (want one of %v)", ErrConfig, c.Kind, Kinds())
	}
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// Build fills defaults, validates and generates the workload.
func (c Config) Build() (*Workload, error) {
	c = c.Defaults()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	w := &Workload{Config: c}
	switch c.Kind {
	case KindSharedPrefix:
		w.Sessions = sharedPrefix(c.Seed, c.Groups, c.PromptsPerGroup, c.SystemTokens, c.QuestionTokens, c.OutputTokens)
	case KindHotPrefix:
		w.Sessions = sharedPrefix(c.Seed, 1, c.Requests, c.SystemTokens, c.QuestionTokens, c.OutputTokens)
	case KindNearIdentical:
		w.Sessions = nearIdentical(c)
	case KindRandom:
		w.Sessions = random(c)
	case KindMultiTurn:
		w.Sessions = multiTurn(c)
	case KindTrace:
		s, err := traceSessions(c)
		if err != nil {
			return nil, err
		}
		w.Sessions = s
	}
	if c.Adapters > 0 {
		for i := range w.Sessions {
			s := &w.Sessions[i]
			a := int(mix(c.Seed, domAdapter, uint64(i)) % uint64(c.Adapters))
			if s.Group >= 0 {
				a = s.Group % c.Adapters
			}
			s.Model = AdapterName(a)
		}
	}
	return w, nil
}

// AdapterName is the name of LoRA adapter i of a workload with Adapters.
func AdapterName(i int) string { return "adapter-" + strconv.Itoa(i) }

// Seed domains keep the texts of different roles apart.
const (
	domSystem uint64 = iota + 1
	domQuestion
	domUser
	domAnswer
	domTraceBlock
	domShuffle
	domLengths
	domVariant
	domAdapter
)

// mix hashes a seed and a few integers into a well-spread 64-bit value
// (SplitMix64's finaliser folded over the inputs), so every piece of a
// workload gets its own reproducible seed.
func mix(seed uint64, parts ...uint64) uint64 {
	x := splitmix(seed)
	for _, p := range parts {
		x = splitmix(x ^ splitmix(p+0x632be59bd9b4e019))
	}
	return x
}

// splitmix is SplitMix64's step: the golden-ratio increment, then its
// finaliser.
func splitmix(x uint64) uint64 { return prefix.Mix64(x + 0x9e3779b97f4a7c15) }

// sharedPrefix is SGLang's generated-shared-prefix dataset: groups system
// prompts, perGroup questions each, prompt = system + "\n\n" + question,
// rows shuffled.
func sharedPrefix(seed uint64, groups, perGroup, sys, q, out int) []Session {
	ss := make([]Session, 0, groups*perGroup)
	for g := range groups {
		system := sim.SyntheticText(sys, mix(seed, domSystem, uint64(g)))
		for p := range perGroup {
			ss = append(ss, Session{
				System: system, SystemTokens: sys, Group: g,
				Turns: []Turn{{
					User:       sim.SyntheticText(q, mix(seed, domQuestion, uint64(g), uint64(p))),
					UserTokens: q, OutputTokens: out,
				}},
			})
		}
	}
	r := rand.New(rand.NewPCG(seed, domShuffle))
	r.Shuffle(len(ss), func(i, j int) { ss[i], ss[j] = ss[j], ss[i] })
	return ss
}

// random is the no-sharing case: every prompt is its own text.
func random(c Config) []Session {
	ss := make([]Session, c.Requests)
	for i := range ss {
		ss[i] = Session{Group: -1, Turns: []Turn{{
			User:       sim.SyntheticText(c.InputTokens, mix(c.Seed, domUser, uint64(i))),
			UserTokens: c.InputTokens, OutputTokens: c.OutputTokens,
		}}}
	}
	return ss
}

// multiTurn builds conversations with a common prefix and uniform turn,
// user and answer lengths.
func multiTurn(c Config) []Session {
	r := rand.New(rand.NewPCG(c.Seed, domLengths))
	between := func(lo, hi int) int { return lo + r.IntN(hi-lo+1) }
	prefix := sim.SyntheticText(c.PrefixTokens, mix(c.Seed, domSystem))
	ss := make([]Session, c.Conversations)
	for i := range ss {
		turns := make([]Turn, between(c.TurnsMin, c.TurnsMax))
		for k := range turns {
			u := between(c.UserMin, c.UserMax)
			turns[k] = Turn{
				User:         sim.SyntheticText(u, mix(c.Seed, domUser, uint64(i), uint64(k))),
				UserTokens:   u,
				OutputTokens: between(c.AnswerMin, c.AnswerMax),
				AnswerSeed:   mix(c.Seed, domAnswer, uint64(i), uint64(k)),
			}
		}
		ss[i] = Session{System: prefix, SystemTokens: c.PrefixTokens, Turns: turns, Group: -1}
	}
	return ss
}
