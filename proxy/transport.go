package proxy

import (
	"errors"
	"net"

	"github.com/valyala/fasthttp"

	"github.com/kvroute/kvroute/discovery"
)

// upstreamHeaderBytes is the upstream connections' read buffer, hence
// the largest response header block an endpoint may send (nginx's
// proxy_buffer_size is 4 or 8 KiB).
const upstreamHeaderBytes = 8 << 10

// client returns the endpoint's HostClient, creating it on first use.
func (s *Server) client(ep *discovery.Endpoint) *fasthttp.HostClient {
	if c, ok := s.clients.Load(ep); ok {
		return c.(*fasthttp.HostClient)
	}
	hc := &fasthttp.HostClient{
		Addr:                          ep.Addr,
		IsTLS:                         ep.TLS,
		NoDefaultUserAgentHeader:      true,
		DisablePathNormalizing:        true,
		DisableHeaderNamesNormalizing: false,
		MaxConns:                      s.opt.MaxConnsPerEndpoint,
		MaxIdleConnDuration:           s.opt.UpstreamIdleTimeout,
		StreamResponseBody:            true,
		ReadBufferSize:                upstreamHeaderBytes,
		SecureErrorLogMessage:         true, // errors never quote what the endpoint sent
		Dial:                          s.dial,
		// A pooled keep-alive connection the endpoint had closed, found so
		// before writing (timedConn.Write): nothing was sent, so the request
		// goes again on the next connection, as often as the pool holds
		// dead ones (an engine whose keep-alive is shorter than
		// UpstreamIdleTimeout closes them all) and at last on a new one:
		// each dead connection is dropped when found, so MaxConns + 1
		// attempts always reach a live or new one. A connection closed
		// after the request went out is not resent here: the request goes
		// to another endpoint instead, within --retries (unanswered).
		MaxIdemponentCallAttempts: s.opt.MaxConnsPerEndpoint + 1,
		RetryIfErr: func(_ *fasthttp.Request, _ int, err error) (bool, bool) {
			return false, errors.Is(err, errStaleConn)
		},
	}
	c, _ := s.clients.LoadOrStore(ep, hc)
	return c.(*fasthttp.HostClient)
}

// setUpstream points the upstream request at ep: its base path, then the
// client's request URI; its own Host (whatever the client sent, or
// failed to send); and a traceparent whose parent id is the attempt's
// span.
func (s *Server) setUpstream(req *fasthttp.Request, st *reqState, ep *discovery.Endpoint, span uint64) {
	u := append(st.scratch[:0], ep.BasePath...)
	u = append(u, st.uri...)
	req.SetRequestURIBytes(u)
	st.scratch = u
	req.UseHostHeader = true
	req.Header.SetHost(ep.Addr)
	tp := append(st.tp[:0], "00-"...)
	tp = append(tp, st.traceID[:]...)
	tp = append(tp, '-')
	tp = appendHex16(tp, span)
	tp = append(tp, '-')
	tp = append(tp, st.flags[:]...)
	req.Header.SetBytesKV(headerTraceparent, tp)
	st.tp = tp
}

// prune drops clients of endpoints that left the Set; their open streams
// keep the HostClient they started with.
func (s *Server) prune(set *discovery.Set) {
	old := s.pruned.Load()
	if !s.pruned.CompareAndSwap(old, set.Version) {
		return
	}
	present := make(map[*discovery.Endpoint]bool, len(set.Endpoints))
	for _, e := range set.Endpoints {
		present[e] = true
	}
	s.clients.Range(func(k, v any) bool {
		if !present[k.(*discovery.Endpoint)] {
			s.clients.Delete(k)
			s.closesEarly.Delete(k)
			s.uncached.Delete(k)
			v.(*fasthttp.HostClient).CloseIdleConnections()
		}
		return true
	})
	s.drainGone(present)
}

// drainGone moves the streams that may be continued (migrate.go) off the
// endpoints that left the Set or drain: their attempts are aborted, and
// each answer continues on another endpoint.
func (s *Server) drainGone(present map[*discovery.Endpoint]bool) {
	if s.opt.MaxMigrations <= 0 {
		return
	}
	s.attempts.m.Range(func(_, v any) bool {
		if a := v.(*attempt); a.ep != nil && (!present[a.ep] || a.ep.State() == discovery.StateDraining) {
			a.drain()
		}
		return true
	})
}

// checkSet prunes when the Set changed (the watcher's tick, so that
// streams leave an endpoint that left even when no request comes).
func (s *Server) checkSet() {
	if set := s.opt.Pool.Load(); set != nil && set.Version != s.pruned.Load() {
		s.prune(set)
	}
}

// dial connects to an endpoint within ConnectTimeout and wraps the
// connection in a timedConn: response-header and stream-idle timeouts per
// request rather than one deadline over a whole stream, and the link to
// the request's attempt.
func (s *Server) dial(addr string) (net.Conn, error) {
	var c net.Conn
	var err error
	if s.opt.ConnectTimeout > 0 {
		c, err = fasthttp.DialTimeout(addr, s.opt.ConnectTimeout)
	} else {
		c, err = fasthttp.Dial(addr)
	}
	if err != nil {
		return nil, err
	}
	return &timedConn{Conn: c, as: &s.attempts, header: s.opt.ResponseHeaderTimeout, idle: s.opt.StreamIdleTimeout}, nil
}
