package proxy

import (
	"context"
	"time"

	"github.com/valyala/fastjson"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// reqState is one request's parse state, pooled: the routing.Request, the
// hasher its Hashes live in, and the JSON parser whose memory its strings
// point into. Nothing in it may be retained after release.
type reqState struct {
	req    routing.Request
	hasher prefix.Hasher
	// With nearBlocks > 0, norm hashes the normal form of the rendering's
	// first nearBlocks blocks too (the near-identical prompt detector).
	nearBlocks int
	norm       prefix.Normalizer
	tee        tee
	// The body's new values (--normalize-prompts, --engine-priority),
	// reset with the state, and a scratch buffer.
	normArena fastjson.Arena
	normBuf   []byte
	parser    fastjson.Parser
	scratch   []byte
	lease     discovery.Lease // the endpoint being tried; handed to the response body
	att       *attempt        // the answering attempt; handed to the response body
	uri       []byte          // the client's request URI, kept across retries
	// The W3C trace context of the upstream requests: the client's trace
	// id and flags, or new ones (traceparent).
	traceID [32]byte
	flags   [2]byte
	tp      []byte // scratch for the traceparent value
	// With tracing: the request's span and its context (the parent of the
	// pick and attempt spans); nil otherwise.
	span trace.Span
	tctx context.Context
	// maxTokens, when positive, caps the prompt's token ids (set before
	// parse); tokens counts them.
	maxTokens int
	tokens    int
	// big: this request's body was large, so the parser and buffers grew
	// with it; the state is dropped rather than pooled.
	big bool
	// root is the parsed body (it lives in parser); prompts counts its
	// prompts (completions and chat; 0 for other kinds) and n is its "n";
	// one prompt and n at most 1 is what a vLLM prefill leg can hand over.
	// clientKV is true when it carries transfer parameters of its own
	// (kv_transfer_params, bootstrap_*).
	root       *fastjson.Value
	prompts, n int
	clientKV   bool
	pd         pdState
	// migrating: the request continues a streamed answer (migrate.go); its
	// retry was counted. resumed: the answer was cut for another request
	// (preempt.go), and the continuation queues as its flow's next, in
	// the place resumeSeq of the queue's order.
	migrating, resumed bool
	resumeSeq          uint64
	// legs counts the legs of the answer before this one (a
	// continuation's), offered when its first was offered for a cut.
	legs    int
	offered time.Time
	// pre: the first bytes of a whole answer, read before it is passed on
	// (peekBody).
	pre []byte
	// tenant is who asks (tenant.go: a hash; 0 the default tenant), class
	// how urgently (service_tier); wait is the request's place in the
	// queue, granted whether it holds a grant not yet handed on.
	tenant  uint64
	class   class
	wait    waiter
	granted bool
	// admitted: the request went to the fleet (counted once), after
	// waiting waited in the queue.
	admitted bool
	waited   time.Duration
	// held is how long it waited for a busy copy of its prompt
	// (Decision.Hold).
	held time.Duration
	// label is its tenant's metric label when admitted: its series keep
	// it to the end, whatever a budgets reload renames.
	label string
	// charge is what its tenant's budget was charged (budgets.go).
	charge budgetCharge
	// fails are the kinds of its failed attempts, comma-separated (the
	// access log's failed_attempts).
	fails []byte
}

// reset readies a pooled st for a new request; the rest of its fields are
// set where the request sets them (parse, handle).
func (st *reqState) reset() {
	st.req.Reset()
	st.att, st.root, st.prompts, st.n, st.clientKV = nil, nil, 0, 0, false
	st.span, st.tctx, st.migrating, st.resumed, st.pre = nil, nil, false, false, st.pre[:0]
	st.legs, st.offered = 0, time.Time{}
	st.pd.reset()
	st.tenant, st.class, st.granted, st.admitted, st.waited, st.held = 0, classDefault, false, false, 0, 0
	st.charge, st.label, st.fails = budgetCharge{}, "", st.fails[:0]
	st.normArena.Reset()
	st.wait.state, st.wait.since, st.wait.req, st.wait.tenant = waitOut, time.Time{}, nil, nil
}

// maxFails bounds failed_attempts: a request that found endpoint after
// endpoint out of connections may fail many times before it is answered.
const maxFails = 64

// failed records a failed attempt of kind (kvroute_upstream_errors_total's
// kind label).
func (st *reqState) failed(kind string) {
	if len(st.fails)+1+len(kind) > maxFails {
		return
	}
	if len(st.fails) > 0 {
		st.fails = append(st.fails, ',')
	}
	st.fails = append(st.fails, kind...)
}

// pooledBodyBytes is the largest body whose parse state is pooled for the
// next request: a parser keeps the memory of the largest body it parsed,
// about 80 bytes per JSON value.
const pooledBodyBytes = 1 << 20

// release returns st to the pool, unless a large body made it large.
func (s *Server) release(st *reqState) {
	if !st.big {
		s.states.Put(st)
	}
}
