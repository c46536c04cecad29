package proxy

import (
	"time"

	"github.com/kvroute/kvroute/discovery"
)

// Limits bound a Server's requests and upstream connections; Config and
// Options share them. Zero durations mean "no limit", except
// UpstreamIdleTimeout; in Options, zero sizes and UpstreamIdleTimeout take
// DefaultConfig's values.
type Limits struct {
	// MaxBodyBytes caps request bodies (413 beyond).
	MaxBodyBytes int
	// Retries is how many times a request may be re-sent to another
	// endpoint before its first response byte.
	Retries int
	// ConnectTimeout bounds dialing an endpoint.
	ConnectTimeout time.Duration
	// ResponseHeaderTimeout bounds the wait from sending a request to the
	// first response byte.
	ResponseHeaderTimeout time.Duration
	// StreamIdleTimeout bounds the gap between two reads of a response body.
	StreamIdleTimeout time.Duration
	// UpstreamIdleTimeout closes idle upstream keep-alive connections
	// (see discovery.EngineIdleTimeout).
	UpstreamIdleTimeout time.Duration
	// ClientIdleTimeout closes idle client keep-alive connections.
	ClientIdleTimeout time.Duration
	// MaxConnsPerEndpoint caps upstream connections per endpoint; every
	// streaming request holds one for its whole life. An endpoint at the
	// cap is busy, not broken: the request goes elsewhere or waits.
	MaxConnsPerEndpoint int
	// ClientHeaderTimeout bounds reading a request's header block from
	// its first byte (on a new connection, from the accept).
	ClientHeaderTimeout time.Duration
	// ClientBodyTimeout bounds every read of a request body: a body may
	// arrive slowly, but not stop.
	ClientBodyTimeout time.Duration
	// MaxHeaderBytes caps a request's header block (431 beyond).
	MaxHeaderBytes int
	// MaxPromptTokens caps the token ids of a request's prompt (a
	// context-length error beyond); the router's memory for a request
	// stays a small multiple of its body.
	MaxPromptTokens int
	// RetryBudget is the share of recent requests that may be retries
	// (over a sliding window of 10 s); at least MinRetries retries
	// per window are always allowed. 0: no budget.
	RetryBudget float64
	// MinRetries: see RetryBudget.
	MinRetries int
	// MaxMigrations is how many times a streamed answer whose endpoint
	// failed mid-stream may be continued on another (migrate.go); each
	// counts as a retry in RetryBudget. 0: never.
	MaxMigrations int
	// QueueTimeout is how long a request waits in kvroute when every
	// eligible endpoint is saturated, before a 429; 0 answers at once.
	QueueTimeout time.Duration
	// MaxQueue caps the requests waiting; beyond it, 429 at once.
	MaxQueue int
	// MaxInFlightPerEndpoint caps this router's requests in flight per
	// endpoint (0: none but MaxConnsPerEndpoint): an endpoint at the cap
	// is saturated.
	MaxInFlightPerEndpoint int
}

// DefaultLimits returns the limits and timeouts kvroute runs with unless
// configured otherwise (the flags' defaults); New takes a zero size from
// them.
func DefaultLimits() Limits {
	return Limits{
		MaxBodyBytes: 64 << 20,
		Retries:      2,
		// Dialing a pod on the cluster network takes milliseconds; 5 s
		// covers a node under pressure without holding a request long
		// on a dead address.
		ConnectTimeout: 5 * time.Second,
		// A non-streaming request answers only after the whole
		// generation.
		ResponseHeaderTimeout: 10 * time.Minute,
		// A healthy engine streams a token every few tens of ms; its
		// longest pause is recomputing a preempted sequence (a 100k-token
		// context at 2k tokens/s: 50 s). Twice that, then the stream is
		// presumed stalled (nginx's proxy_read_timeout is 60 s, Envoy's
		// stream idle timeout 5 min).
		StreamIdleTimeout:   2 * time.Minute,
		UpstreamIdleTimeout: discovery.EngineIdleTimeout,
		ClientIdleTimeout:   2 * time.Minute,
		MaxConnsPerEndpoint: 4096,
		// nginx's client_header_timeout and client_body_timeout.
		ClientHeaderTimeout: 60 * time.Second,
		ClientBodyTimeout:   60 * time.Second,
		// Bearer tokens and cookies of 8 KiB occur; nginx accepts up to
		// 4 × 8 KiB buffers, Envoy 60 KiB.
		MaxHeaderBytes: 16 << 10,
		// Llama 3.1's context; an engine's own limit may be lower, and
		// it answers longer prompts with the same error.
		MaxPromptTokens: 131072,
		// Envoy's retry budget: 20% of requests, at least 3 retries.
		RetryBudget:   0.2,
		MinRetries:    3,
		MaxMigrations: 2,
		QueueTimeout:  5 * time.Second,
		MaxQueue:      1024,
	}
}

// HashVersion names how requests are rendered and hashed into blocks: bump
// it whenever the same request would hash otherwise, so that router
// replicas of different versions do not exchange placements that could
// never match (the gossip's fingerprint).
const HashVersion = "1"

// Defaults of Options.BlockSize and Options.MaxBlocks.
const (
	// DefaultBlockBytes: 1 KiB of rendering ≈ 256 tokens.
	DefaultBlockBytes = 1024
	// DefaultMaxBlocks: 256 blocks cover ≈ 64k tokens.
	DefaultMaxBlocks = 256
)
