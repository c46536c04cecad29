package proxy

import (
	"crypto/sha256"
	"encoding/binary"

	"github.com/valyala/fasthttp"
	"github.com/valyala/fastjson"
)

// TenantOptions say who asks and how urgently.
type TenantOptions struct {
	// Header, when set, names the request header that says the tenant
	// (a gateway in front sets it); otherwise the tenant is the request's
	// API key (Authorization: Bearer). Either is kept only as a hash.
	Header string
	// PriorityHeader, when set, names a request header whose value
	// (priority, default or flex) sets the request's class, over its
	// body's service_tier.
	PriorityHeader string
	// MaxQueue bounds one tenant's requests waiting in the queue: beyond
	// it the tenant's requests get 429 while others still queue.
	MaxQueue int
	// MetricTenants is how many tenants have metric labels of their own
	// (the busiest: labels.go); the rest share "other".
	MetricTenants int
	// EnginePriority passes each request's class on to the engine, as
	// vLLM's "priority" body field (lower is earlier: priority -1, flex
	// 1, default none), for engines run with --scheduling-policy
	// priority; a client's own "priority" is replaced.
	EnginePriority bool
	// FIFO orders the queue by arrival alone, as one tenant of one class
	// (the order before tenants; the benchmarks' anchor). Tenants and
	// classes are still counted.
	FIFO bool
	// Reserve is the fleet's free places that a flow (a tenant's requests
	// of one class) running its share of the fleet's places or more leaves,
	// while the fleet is saturated, to the active flows of its class
	// running less than theirs and to any active flow of a higher class
	// (reserve.go); 0: the queue is fully work-conserving. Not under FIFO.
	Reserve int
	// Preempt lets the queue take a place back for a flow below its share
	// or of a higher class: it cuts a stream of a flow above its share
	// (or of a lower class), which continues on the fleet as its flow's
	// next request (preempt.go). Not under FIFO. Off by default: with one
	// reserved place it gave kvsim's quiet tenants their best p90 at 0.93×
	// output, but on llama.cpp the cuts cost more than they freed (issue
	// #38, bench/results/tenants-38e).
	Preempt bool
}

// DefaultTenantOptions are the flags' defaults.
func DefaultTenantOptions() TenantOptions {
	return TenantOptions{MaxQueue: 256, MetricTenants: 32, Reserve: 2}
}

// tenantOf returns the tenant of a request with header h: a hash of its
// API key (or of its tenant header's value), never the value itself; 0,
// the default tenant, when it has none.
func (s *Server) tenantOf(h *fasthttp.RequestHeader) uint64 {
	var v []byte
	if name := s.opt.Tenants.Header; name != "" {
		v = h.Peek(name)
	} else if a := h.Peek(fasthttp.HeaderAuthorization); len(a) > 7 && equalFoldASCII(a[:7], "bearer ") {
		v = a[7:]
	}
	if len(v) == 0 {
		return 0
	}
	sum := sha256.Sum256(v)
	return binary.BigEndian.Uint64(sum[:8]) | 1 // never 0
}

// classOfHeader reads the priority header into st.class; false for a
// value that names no class.
func (s *Server) classOfHeader(h *fasthttp.RequestHeader, st *reqState) bool {
	if name := s.opt.Tenants.PriorityHeader; name != "" {
		if v := h.Peek(name); len(v) > 0 {
			c, ok := classOf(v)
			st.class = c
			return ok
		}
	}
	return true
}

// enginePriority is c as vLLM's priority field: lower is earlier; 0, the
// default, is not sent.
func (c class) enginePriority() int { return 1 - c.rank() }

// passPriority writes st's class into the request body as the engine's
// "priority" (EnginePriority).
func (s *Server) passPriority(ctx *fasthttp.RequestCtx, st *reqState) {
	if !s.opt.Tenants.EnginePriority || st.root == nil || st.root.Type() != fastjson.TypeObject {
		return
	}
	switch n := st.class.enginePriority(); {
	case n != 0:
		st.root.Set("priority", st.normArena.NewNumberInt(n))
	case st.root.Exists("priority"):
		st.root.Del("priority")
	default:
		return
	}
	st.scratch = st.root.MarshalTo(st.scratch[:0])
	ctx.Request.SetBody(st.scratch)
}
