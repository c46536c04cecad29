package routing

import (
	"time"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/prefix"
)

// Kind classifies a request path.
type Kind uint8

// Path kinds. KindOther covers every path kvroute forwards without parsing.
const (
	KindOther Kind = iota
	KindCompletions
	KindChat
	KindResponses
	KindEmbeddings
)

// String returns the kind's label, used as the path class in metrics.
func (k Kind) String() string {
	switch k {
	case KindCompletions:
		return "completions"
	case KindChat:
		return "chat"
	case KindResponses:
		return "responses"
	case KindEmbeddings:
		return "embeddings"
	default:
		return "other"
	}
}

// Request is what a policy knows about one request. The proxy fills it from
// one parse of the body; for KindOther only Kind is set. A Request is owned
// by one goroutine and reused through a pool: policies must not retain it.
type Request struct {
	Kind Kind
	// Model is the body's "model" ("" when absent).
	Model string
	// Stream is the body's "stream".
	Stream bool
	// IncludeUsage is the body's "stream_options.include_usage".
	IncludeUsage bool
	// MaxTokens is "max_completion_tokens" or "max_tokens"; 0 when absent.
	MaxTokens int
	// CacheSalt is the body's "cache_salt" ("" when absent).
	CacheSalt string
	// PromptBytes is the length of the prompt's canonical rendering.
	PromptBytes int
	// PromptTokens estimates the prompt's length in tokens as PromptBytes/4
	// (about four bytes of English per token); the prefix policy refines
	// it with the bytes per token it learns from the engines' reports.
	PromptTokens int
	// Hashes are the chained block hashes of the canonical rendering.
	Hashes []uint64
	// Marks are the rendering's last message ends and its end, earliest
	// first (prefix.Mark): where an earlier prompt of the same
	// conversation ended, if one did.
	Marks []prefix.Mark
	// Body is the request body as it is forwarded, valid only during Pick
	// (a policy that tokenizes, as the benchmark's llm-d precise peer
	// does, reads it; kvroute's own policies never do).
	Body []byte
	// Tried lists the endpoints this request was already sent to; policies
	// skip them (retries go to another endpoint).
	Tried []*discovery.Endpoint
	// MaxInFlight, when positive, is the most requests of this router an
	// endpoint may have in flight: one at the cap is saturated, and
	// policies skip it.
	MaxInFlight int64
	// StartNow, set while the fleet is saturated (the request waited in
	// the router's queue), makes only endpoints that would start it now
	// or soon usable (Endpoint.QueueRoom): a warm endpoint's short queue,
	// not a long one that would hold it behind requests the router had
	// no say over.
	StartNow bool
	// Alone, with StartNow, narrows it to the endpoints that start the
	// request at once (Endpoint.HasRoom): nothing else of its tenant
	// waits and its tenant runs less than its share (a quiet tenant's
	// request, not a flood's), so its own latency is what a wait in an
	// engine's queue costs, not a backlog's cache hits.
	Alone bool
	// Held: the request waited once for a busy copy of its prompt
	// (Decision.Hold); it does not wait again.
	Held bool
	// Prefill asks for a prefill endpoint (the Set's Prefill group) for
	// the prefill leg of a disaggregated request; otherwise policies pick
	// among the endpoints that answer clients (Serving).
	Prefill bool
}

// group returns the endpoints of set r is routed among.
func (r *Request) group(set *discovery.Set) []*discovery.Endpoint {
	if r.Prefill {
		return set.Prefill
	}
	return set.Serving
}

// Reset clears r for reuse, keeping its slices' capacity.
func (r *Request) Reset() {
	h, t := r.Hashes[:0], r.Tried[:0]
	*r = Request{Hashes: h, Tried: t}
}

// tried reports whether e is in r.Tried.
func (r *Request) tried(e *discovery.Endpoint) bool {
	for _, t := range r.Tried {
		if t == e {
			return true
		}
	}
	return false
}

// Decision is a policy's answer.
type Decision struct {
	// Endpoint serves the request; nil when no endpoint is usable.
	Endpoint *discovery.Endpoint
	// Reason is a short constant label for metrics and logs.
	Reason string
	// Prefill is the prompt tokens the endpoint is expected to compute
	// (prompt minus the prefix it holds). The proxy adds it to the
	// endpoint's InFlightPrefill until the first response byte.
	Prefill int
	// Loaded is the prompt tokens the endpoint is expected to load from a
	// slower tier than the GPU rather than compute (engine truth's CPU and
	// storage copies).
	Loaded int
	// MatchedBlocks is the prefix blocks the endpoint is believed to hold.
	MatchedBlocks int
	// Home is true when the endpoint is the home of the request's prefix
	// (the prefix policy).
	Home bool
	// PrefixKey is the prefix policy's key of the request's prefix (0: none).
	PrefixKey uint64
	// PromptTokens is the policy's estimate of the prompt's engine tokens.
	PromptTokens int
	// Hold, when not nil, asks the caller not to send the request yet: the
	// endpoint's slots that keep its prompt are all busy (Prefix.hold). It
	// waits until Hold is closed (one of them ended) or HoldFor passed,
	// sets Request.Held and picks again.
	Hold    <-chan struct{}
	HoldFor time.Duration
	// Contended is true when the endpoint was already computing other
	// prompts of this router's at pick time: the engine's cached-token
	// report for this request may then reflect that race, not evictions.
	Contended bool
	// branch is true when PrefixKey is a conversation's own key (a branch
	// of a chained family, see homes.family).
	branch bool
	// busy is true when the endpoint, whose engine caches prompts per
	// slot (discovery.Dialect.Slotted), had requests of this router's in
	// flight at pick time.
	busy bool
	// unplaced is true when PrefixKey is seen for the first time: Pick
	// records where its request went (homes.placed).
	unplaced bool
	// distance is PrefixKey's distance at Endpoint when picked (warmth.see;
	// -1: none or unknown).
	distance int
	// seqFrom is the mark (its hash; 0: none) of the request's earlier
	// prompt that Endpoint's sequences held, seqBytes that prompt's
	// rendering, and seqDistance its distance there when picked (-1: none).
	seqFrom     uint64
	seqBytes    int
	seqDistance int
}
