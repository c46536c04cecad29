package routing

import (
	"math"

	"github.com/kvroute/kvroute/discovery"
)

// Disaggregation decisions (the proxy counts them by these labels).
const (
	// PDSplit: a prefill endpoint computes the prompt, the decode endpoint
	// pulls its KV and generates.
	PDSplit = "disaggregated"
	// PDShort: too few uncached tokens on the decode endpoint to be worth
	// a prefill leg; the decode endpoint computes them itself.
	PDShort = "decode_only"
	// PDSingleOnly: several prompts or n > 1 — vLLM's prefill pod holds
	// KV for a one-sequence request only; the decode endpoint serves the
	// request alone (SGLang's protocol takes a room per prompt instead).
	PDSingleOnly = "single_only"
	// PDClientKV: a trusted client brought its own transfer parameters;
	// the request is forwarded as it is.
	PDClientKV = "client_kv"
	// Fallbacks to the decode endpoint alone after choosing to split.
	PDNoPrefill     = "fallback_no_prefill"
	PDPrefillFailed = "fallback_prefill_failed"
	PDNoReference   = "fallback_no_reference"
)

// PDDecider decides whether a request picked onto a decode endpoint is
// disaggregated: only when the prompt tokens the decode endpoint would
// have to compute (the decision's Prefill: the prompt minus the prefix the
// policy believes it holds — decode endpoints hold the prefixes they
// pulled) reach a threshold, llm-d's rule (its prefix-based PD decider).
//
// The threshold is MinUncachedTokens when set. Otherwise it is learned per
// decode endpoint from the cost model: the tokens that endpoint computes
// in one decode step (its prefill rate × its decode step, the priors'
// 20,000 tokens/s × 10 ms = 200 tokens until measured). A shorter prefill
// fits in the steps the endpoint's running streams take anyway (chunked
// prefill shares a step's token budget), so computing it there costs them
// less than one token's time, while a prefill leg adds a second hop and a
// KV transfer to the request's own first token; a longer one stalls every
// stream on the endpoint by more than a token, which a prefill pool
// avoids. The decision's uncached tokens come from an index of whole
// blocks (BlockTokens each): they include the part of the prompt beyond
// the last whole matched block, which the engine may well hold (a repeated
// prompt's tail, a system prompt's end) — up to a block, half a block on
// average. So the learned threshold adds half a block, and is never below
// a whole one: a repeated prompt never gets a prefill leg.
type PDDecider struct {
	MinUncachedTokens int
	// Params returns the cost model's current priors and pins (the prefix
	// policy's parameters).
	Params func() PrefixParams
	// BlockTokens returns the tokens of one index block (nil: no floor).
	BlockTokens func() int
}

// Threshold returns the uncached tokens from which a request on decode
// endpoint e is disaggregated.
func (p *PDDecider) Threshold(e *discovery.Endpoint) int {
	if p.MinUncachedTokens > 0 {
		return p.MinUncachedTokens
	}
	prm := p.Params()
	r := prm.ratesOf(e.Costs(), prm.pins())
	t := max(1, int(math.Round(r.prefill*r.decode)))
	if p.BlockTokens != nil {
		b := p.BlockTokens()
		t = max(t+b/2, b)
	}
	return t
}

// Split reports whether a request decided as d (on a decode endpoint) is
// worth a prefill leg, and the threshold it was held against.
func (p *PDDecider) Split(d Decision) (bool, int) {
	t := p.Threshold(d.Endpoint)
	return d.Prefill >= t, t
}
