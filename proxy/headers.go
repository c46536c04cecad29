package proxy

import (
	"iter"
	"net/netip"

	"github.com/valyala/fasthttp"
)

var (
	headerTraceparent    = []byte("traceparent")
	headerTracestate     = []byte("tracestate")
	headerRequestID      = []byte("X-Request-Id")
	headerForwardedFor   = []byte("X-Forwarded-For")
	headerForwardedProto = []byte("X-Forwarded-Proto")
)

// hopHeaders are RFC 9110 §7.6.1's connection-specific fields (plus the
// legacy Keep-Alive and Proxy-Connection), in lower case. fasthttp
// manages Connection, Transfer-Encoding and Content-Length itself.
var hopHeaders = [...]string{
	"keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
	"te", "trailer", "upgrade",
}

type headerDeleter interface {
	Peek(key string) []byte
	Del(key string)
	All() iter.Seq2[[]byte, []byte]
}

// removeHopHeaders deletes hop-by-hop fields, including those named by the
// Connection field.
func removeHopHeaders(h headerDeleter) {
	if c := h.Peek("Connection"); len(c) > 0 {
		for _, tok := range splitTokens(c) {
			if !equalFoldASCII(tok, "close") && !equalFoldASCII(tok, "keep-alive") && !framing(tok) {
				h.Del(string(tok))
			}
		}
	}
	// One pass finds those present; Del, which normalises its key and
	// scans every field, runs only for them (usually none).
	var found [len(hopHeaders)]bool
	for k := range h.All() {
		for i, hk := range hopHeaders {
			if !found[i] && equalFoldASCII(k, hk) {
				found[i] = true
			}
		}
	}
	for i, f := range found {
		if f {
			h.Del(hopHeaders[i])
		}
	}
}

// framing reports whether a Connection token names a field that frames or
// addresses the message, which a client may not have removed: kvroute sets
// Host itself, and fasthttp owns the rest.
func framing(tok []byte) bool {
	for _, f := range [...]string{"host", "content-length", "transfer-encoding", "content-type", "connection"} {
		if equalFoldASCII(tok, f) {
			return true
		}
	}
	return false
}

// prepareRequest applies header hygiene to the request sent upstream and
// returns its request id (generated when the client sent none).
func (s *Server) prepareRequest(ctx *fasthttp.RequestCtx) []byte {
	h := &ctx.Request.Header
	removeHopHeaders(h)
	h.ResetConnectionClose() // the client's connection choice is not the endpoint's

	var buf [64]byte
	xff := append(buf[:0], h.PeekBytes(headerForwardedFor)...)
	if len(xff) > 0 {
		xff = append(xff, ", "...)
	}
	if ap, ok := netip.AddrFromSlice(ctx.RemoteIP()); ok {
		xff = ap.Unmap().AppendTo(xff)
	}
	h.SetBytesKV(headerForwardedFor, xff)
	if ctx.IsTLS() {
		h.SetBytesKV(headerForwardedProto, []byte("https"))
	} else {
		h.SetBytesKV(headerForwardedProto, []byte("http"))
	}
	if id := h.PeekBytes(headerRequestID); len(id) > 0 {
		return id
	}
	id := s.newRequestID(buf[:0])
	h.SetBytesKV(headerRequestID, id)
	return h.PeekBytes(headerRequestID)
}

// newRequestID appends a process-unique id: 8 random hex digits fixed at
// start-up, then a 16-hex-digit sequence number.
func (s *Server) newRequestID(dst []byte) []byte {
	dst = append(dst, s.idPrefix[:]...)
	dst = append(dst, '-')
	return appendHex16(dst, s.idSeq.Add(1))
}

// splitTokens splits a comma-separated header value into trimmed tokens.
func splitTokens(v []byte) [][]byte {
	var out [][]byte
	for len(v) > 0 {
		i := 0
		for i < len(v) && v[i] != ',' {
			i++
		}
		tok := trimSpace(v[:i])
		if len(tok) > 0 {
			out = append(out, tok)
		}
		if i == len(v) {
			break
		}
		v = v[i+1:]
	}
	return out
}

func trimSpace(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t') {
		b = b[1:]
	}
	for len(b) > 0 && (b[len(b)-1] == ' ' || b[len(b)-1] == '\t') {
		b = b[:len(b)-1]
	}
	return b
}

// equalFoldASCII reports whether b equals the lower-case ASCII string s,
// ignoring case.
func equalFoldASCII(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := range b {
		c := b[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != s[i] {
			return false
		}
	}
	return true
}
