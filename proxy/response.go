package proxy

import (
	"bytes"
	"errors"
	"io"
	"net"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

// commit hands the endpoint's response to the client: headers now, the body
// as a stream that fasthttp writes and flushes chunk by chunk. The body
// takes over the request's lease.
func (s *Server) commit(ctx *fasthttp.RequestCtx, st *reqState, d routing.Decision, resp *fasthttp.Response, reqID []byte, start time.Time) {
	// While shutting down, clients reconnect (through the load balancer,
	// elsewhere) rather than keep this connection.
	clientClose := ctx.Request.Header.ConnectionClose() || s.draining.Load()
	resp.Header.CopyTo(&ctx.Response.Header)
	h := &ctx.Response.Header
	removeHopHeaders(h)
	h.ResetConnectionClose()
	if clientClose {
		h.SetConnectionClose()
	}
	h.SetBytesKV(headerRequestID, reqID)

	b := s.bodies.Get().(*upstreamBody)
	b.s, b.resp, b.lease, b.att = s, resp, st.lease.Take(), st.att
	st.att = nil
	b.firstByte, b.readErr, b.last, b.tail, b.lastChunk, b.pre = false, nil, 0, nil, time.Time{}, b.pre[:0]
	// The engine's usage report (prompt and cached tokens) is read from
	// every inference answer, for the endpoint's calibration and, under a
	// learning policy, for the policy.
	b.scan = resp.StatusCode() == fasthttp.StatusOK &&
		(st.req.Kind == routing.KindCompletions || st.req.Kind == routing.KindChat || st.req.Kind == routing.KindResponses)
	// A decode leg's usage counts the pulled KV as cached: it says
	// nothing of what the endpoint held before.
	b.learn = b.scan && s.opt.Learner != nil && !st.pd.split
	b.promptBytes = st.req.PromptBytes
	b.usage = usageScanner{}
	b.rec = record{class: int(st.req.Kind), status: resp.StatusCode(), attempts: len(st.req.Tried), start: start,
		reqID: append(b.rec.reqID[:0], reqID...), method: append(b.rec.method[:0], ctx.Method()...),
		path: append(b.rec.path[:0], ctx.Path()...), model: append(b.rec.model[:0], st.req.Model...), ep: d.Endpoint, decision: d, prefix: b.learn}
	st.stamp(&b.rec)
	b.leg = st.pd.handOver(&b.rec, d)
	b.rec.span, st.span, b.rec.traceID = st.span, nil, st.traceID
	if s.opt.Tokenizer != nil && b.scan && !st.pd.split && st.prompts == 1 && st.tokens == 0 &&
		st.req.Kind != routing.KindResponses && d.Endpoint != nil {
		s.opt.Tokenizer.Offer(d.Endpoint, adapterOf(d.Endpoint, st.req.Model), st.req.Hashes, st.req.PromptBytes, ctx.PostBody())
	}

	// A streamed answer's first byte is its first token: the lease makes
	// it a TTFT observation of the endpoint's costs, unless a prefill leg
	// computed the prompt.
	b.stream = resp.StatusCode() == fasthttp.StatusOK && isEventStream(resp)
	b.observe = b.stream && !st.pd.split
	rd := resp.BodyStream()
	b.ctx, b.flags, b.legFirst = ctx, st.flags, true
	b.track.reset(b.stream && rd != nil && s.continuable(st), st.req.Kind == routing.KindChat)
	if b.track.on {
		b.att.setMovable() // an endpoint that leaves hands it over (drainGone)
		s.offer(st, b.att) // the queue may take its place back (preempt.go)
	}
	if rd == nil { // HEAD, 204, 304: no body
		b.markFirstByte()
		b.rd = eofReader{}
		ctx.Response.SetBodyStream(b, 0)
		return
	}
	b.rd, b.pre, b.uri = rd, append(b.pre[:0], st.pre...), append(b.uri[:0], st.uri...)
	size := resp.Header.ContentLength()
	if size < 0 || isEventStream(resp) {
		if !ctx.Request.Header.IsHTTP11() {
			s.closeDelimited(ctx, b)
			return
		}
		// Unknown length or SSE: chunked to the client, headers flushed at
		// once and every chunk flushed as it arrives.
		size = -1
		ctx.Response.ImmediateHeaderFlush = true
	}
	ctx.Response.SetBodyStream(b, size)
}

// closeDelimited sends b to an HTTP/1.0 client, which cannot read a
// chunked body: the header without a length, then the body as it arrives,
// then the end of the connection (RFC 9112 §6.3). fasthttp always chunks a
// body of unknown length, so the connection is taken over once the handler
// returns.
func (s *Server) closeDelimited(ctx *fasthttp.RequestCtx, b *upstreamBody) {
	h := &ctx.Response.Header
	h.SetContentLength(-2) // no length, no chunking
	h.SetConnectionClose()
	head := append([]byte(nil), h.Header()...)
	b.ctx, b.track.on = nil, false // ctx is gone once the connection is taken over
	ctx.HijackSetNoResponse(true)
	s.hijacked.Add(1)
	ctx.Hijack(func(c net.Conn) {
		defer s.hijacked.Done()
		_, err := c.Write(head)
		if err == nil {
			_, err = b.WriteTo(c)
		}
		if b.readErr != nil {
			err = nil // the endpoint's failure, which CloseWithError reports
		}
		_ = b.CloseWithError(err)
	})
}

func isEventStream(resp *fasthttp.Response) bool {
	ct := resp.Header.ContentType()
	return len(ct) >= 17 && string(ct[:17]) == "text/event-stream"
}

// upstreamBody is the response body handed to fasthttp: it reads the
// endpoint's stream, notes the first byte, and on close releases the
// endpoint's connection and lease, ends a concurrent prefill leg (leg;
// nil: none) and records the request. It never touches the RequestCtx,
// which fasthttp may have reset by then.
type upstreamBody struct {
	s           *Server
	resp        *fasthttp.Response
	rd          io.Reader
	lease       discovery.Lease
	att         *attempt
	rec         record
	scan        bool // scan the body for the engine's usage
	learn       bool // and report it to the Learner
	usage       usageScanner
	promptBytes int
	stream      bool // a 200 SSE response
	observe     bool // whose first byte is an observation of the endpoint's TTFT
	leg         concurrentLeg
	firstByte   bool
	lastChunk   time.Time // a stream's last write to the client (for the gaps between them)
	readErr     error
	// WriteTo's state: the chunk writer, the buffer (nil while waiting
	// for the endpoint) and what it holds not yet written, the first
	// client write error, and the one byte read while waiting.
	w          io.Writer
	buf        *[streamBufSize]byte
	start, end int
	werr       error
	one        [1]byte
	probing    bool       // in the one-byte read
	conn       *timedConn // the upstream connection, while WriteTo runs
	last       uint32     // the last two bytes read (whether an event ended there)
	// Mid-stream failover (migrate.go): the client's request context
	// (valid while fasthttp writes the body; nil for an HTTP/1.0 client),
	// the upstream trace flags, the answer's tracking, and whether the
	// current leg's first byte came.
	ctx      *fasthttp.RequestCtx
	pre      []byte // the answer's first bytes, read before commit (peekBody)
	uri      []byte // the client's request URI (a continuation's)
	flags    [2]byte
	track    streamTrack
	legFirst bool
	tail     []byte // after a cut: the error event still to send (empty, not nil, once sent)
}

// Read implements io.Reader.
func (b *upstreamBody) Read(p []byte) (int, error) {
	if b.tail != nil { // the error event that ends a cut stream, then the end
		n := copy(p, b.tail)
		if b.tail = b.tail[n:]; len(b.tail) == 0 {
			return n, io.EOF
		}
		return n, nil
	}
	var n int
	var err error
	if len(b.pre) > 0 { // what peekBody read
		n = copy(p, b.pre)
		b.pre = b.pre[n:]
	} else {
		n, err = b.rd.Read(p)
	}
	if n > 0 {
		if !b.firstByte {
			b.markFirstByte()
		} else if !b.legFirst {
			b.lease.FirstByte(false) // a continuation's prompt is computed
		}
		b.legFirst = true
		b.rec.bytes += int64(n)
		if b.scan {
			b.usage.feed(p[:n])
		}
		if n > 1 {
			b.last = uint32(p[n-2])<<8 | uint32(p[n-1])
		} else {
			b.last = (b.last&0xff)<<8 | uint32(p[0])
		}
	}
	if err != nil && err != io.EOF {
		b.readErr = err
		if b.stream && !b.att.clientGone() {
			if b.track.on {
				return n, errLegFailed // WriteTo continues the answer elsewhere, or ends it
			}
			b.cut()
			return n, nil
		}
	}
	return n, err
}

// errLegFailed: the endpoint of a stream that may be continued failed.
var errLegFailed = errors.New("proxy: the stream's endpoint failed")

// cut ends a stream its endpoint cut as vLLM ends a stream that failed:
// with an error event and [DONE], so that clients see an error, not a
// stream that may look complete.
func (b *upstreamBody) cut() {
	b.tail = streamCutEvent(b.last&0xffff != '\n'<<8|'\n')
}

// streamBufSize is the most of an answer upstreamBody.WriteTo writes at
// once.
const streamBufSize = 16 << 10

var streamBufs = sync.Pool{New: func() any { return new([streamBufSize]byte) }}

// SupportsBodyWriteTo tells fasthttp to write the body with WriteTo
// (fasthttp.BodyWriterTo): it does what Read does, and frames each of its
// writes as one chunk.
func (b *upstreamBody) SupportsBodyWriteTo() bool { return true }

// WriteTo writes the body to w, fasthttp's chunk writer (each write one
// chunk, flushed) or the connection of an HTTP/1.0 client. It writes what
// has arrived from the endpoint in one write: the endpoint's chunks are
// gathered until its connection's reader has used up what it buffered
// and is about to read the socket (timedConn.beforeRead), and written
// then, so that no event waits for the next. Reads alternate between one
// byte (the next chunk's first) and the rest of that chunk; when the
// reader must wait for the endpoint during a one-byte read, what waits is
// written and the buffer goes back to the pool, so that a stream waiting
// for its next token holds no buffer here. Without the upstream
// connection (not linked), every read is written at once. A stream that
// may be continued elsewhere (migrate.go) is written event by event, and
// when its endpoint fails, WriteTo continues it on another.
func (b *upstreamBody) WriteTo(w io.Writer) (int64, error) {
	b.w, b.werr = w, nil
	b.hook()
	defer b.unhook()
	var written int64
	for probe := true; ; probe = !probe {
		var n int
		var err error
		if probe {
			b.probing = true
			n, err = b.Read(b.one[:])
			b.probing = false
			if n > 0 {
				b.room()
				b.buf[b.end] = b.one[0]
				b.end++
			}
		} else {
			b.room()
			n, err = b.Read(b.buf[b.end:])
			b.end += n
		}
		written += int64(n)
		if b.conn == nil || err != nil {
			b.flush()
		}
		if (err == errLegFailed || b.track.failed) && b.werr == nil {
			cause := migrateError
			if err == errLegFailed {
				cause = causeOf(b.att, b.readErr)
			}
			if b.migrate(cause) {
				b.end = b.start // what is left of the failed leg
				b.track.failed = false
				probe = false // the next read is a probe
				continue
			}
			// Not continued: what is left (the engine's error event and
			// [DONE], or kvroute's cut event) goes as it is.
			b.track.on, b.track.rewrite, b.track.failed = false, false, false
			switch {
			case b.resp == nil:
				// The continuation failed after the leg ended: the client
				// gets the engine's error event where it sent one (its
				// reason: llama.cpp's "Context size has been exceeded"),
				// else what a cut stream gets; the rest of the leg is
				// dropped.
				b.tail = nil
				if cause == migrateError && b.buf != nil {
					b.tail = engineErrorEvent(b.buf[b.start:b.end])
				}
				if b.tail == nil {
					b.tail = streamCutEvent(false) // the client's last event was complete
				}
				b.end = b.start
				err = nil
			default: // a cut ends as today
				b.flush()
				if err == errLegFailed {
					b.cut()
					err = nil
				}
			}
		}
		if err != nil || b.werr != nil {
			b.release()
			if b.werr != nil {
				err = b.werr
			}
			if err == io.EOF {
				err = nil
			}
			return written, err
		}
		if b.buf != nil && b.start == b.end {
			b.start, b.end = 0, 0
		}
	}
}

// hook makes the current upstream connection flush what waits before it
// reads its socket; unhook undoes it.
func (b *upstreamBody) hook() {
	b.conn = b.att.upstream()
	if b.conn != nil {
		b.conn.beforeRead = b.flushBeforeRead
	}
}

func (b *upstreamBody) unhook() {
	if b.conn != nil {
		b.conn.beforeRead = nil
		b.conn = nil
	}
}

// room makes room in the buffer for at least one byte.
func (b *upstreamBody) room() {
	switch {
	case b.buf == nil:
		b.buf = streamBufs.Get().(*[streamBufSize]byte)
		b.start, b.end = 0, 0
	case b.end < len(b.buf):
	case b.start > 0: // a partial event waits: move it to the front
		b.end = copy(b.buf[:], b.buf[b.start:b.end])
		b.start = 0
	default: // an event larger than the buffer: written as it comes
		b.track.on, b.track.rewrite = false, false
		b.flush()
		b.start, b.end = 0, 0
	}
}

// flushBeforeRead writes what waits before the endpoint's connection reads
// its socket. During a one-byte read the buffer is no read's target, so it
// goes back to the pool, unless part of an event waits in it.
func (b *upstreamBody) flushBeforeRead() {
	b.flush()
	if b.probing && b.start == b.end {
		b.release()
	}
}

// flush writes what waits in the buffer (nothing after a write failed):
// all of it, or, for a stream that may be continued, its complete events.
func (b *upstreamBody) flush() {
	if b.buf == nil || b.start == b.end || b.werr != nil {
		return
	}
	p, out := b.buf[b.start:b.end], b.buf[b.start:b.end]
	if t := &b.track; t.on || t.rewrite {
		done := 0
		t.out = t.out[:0]
		for !t.failed {
			n := eventEnd(p[done:])
			if n < 0 {
				break
			}
			if ev := p[done : done+n]; t.rewrite && !t.rewriteEvent(ev) || !t.rewrite && !t.follow(ev) {
				break // an error event: the leg failed (WriteTo)
			}
			done += n
		}
		out = p[:done]
		if t.rewrite {
			out = t.out
		}
		b.start += done
	} else {
		b.start = b.end
	}
	if len(out) == 0 {
		return
	}
	now := time.Now()
	if b.stream {
		if !b.lastChunk.IsZero() {
			b.s.opt.Metrics.ChunkGap(now.Sub(b.lastChunk).Seconds())
		}
		b.lastChunk = now
	}
	if t := &b.track; !t.migratedAt.IsZero() {
		b.s.opt.Metrics.MigrationGap(now.Sub(t.migratedAt).Seconds())
		t.migratedAt = time.Time{}
	}
	_, b.werr = b.w.Write(out)
}

// release gives the buffer back.
func (b *upstreamBody) release() {
	if b.buf != nil {
		streamBufs.Put(b.buf)
		b.buf, b.start, b.end = nil, 0, 0
	}
}

// engineErrorEvent returns the end of a stream whose engine sent an error
// event: that event, the first complete one of rest (what the client had
// not received of the failed leg), and [DONE]; nil when rest holds no
// complete event.
func engineErrorEvent(rest []byte) []byte {
	n := eventEnd(rest)
	if n < 0 {
		return nil
	}
	return append(bytes.Clone(rest[:n]), "data: [DONE]\n\n"...)
}

// streamCutEvent is the end of an event stream the endpoint cut; sep
// first ends the event the cut left incomplete.
func streamCutEvent(sep bool) []byte {
	var e []byte
	if sep {
		e = append(e, "\n\n"...)
	}
	return append(e, `data: {"error":{"message":"the model server's stream ended early","type":"BadGatewayError","param":null,"code":"upstream_stream_cut"}}`+"\n\ndata: [DONE]\n\n"...)
}

// markFirstByte records the first response byte: the endpoint has computed
// the prompt, so the lease's pending prefill ends.
func (b *upstreamBody) markFirstByte() {
	b.firstByte = true
	b.lease.FirstByte(b.observe)
	now := time.Now()
	b.rec.ttfb = now.Sub(b.rec.start)
	b.s.opt.Metrics.FirstByte(b.rec.class, b.rec.ttfb.Seconds())
	if !b.rec.sent.IsZero() {
		prefilled := b.rec.prefilled
		if b.leg != nil {
			prefilled = b.rec.sent // the legs run together
		}
		b.s.opt.Metrics.DecodeFirstByte(now.Sub(b.rec.sent).Seconds(), now.Sub(prefilled).Seconds())
	}
}

// CloseWithError is called by fasthttp exactly once when the body is done:
// err is nil after a complete write, or the write error when the client went
// away. An unfinished upstream stream is closed, so the engine sees the
// disconnect and stops generating.
func (b *upstreamBody) CloseWithError(err error) error {
	s, ep := b.s, b.rec.ep
	s.attempts.end(b.att) // before the connection goes back to the pool
	if b.resp != nil {    // nil after a failed migration (migrate.go)
		if _, early := s.closesEarly.Load(ep); early {
			// The endpoint closes connections kvroute would pool
			// (llama.cpp's server, after every streamed answer, without
			// saying so): close this one rather than race its FIN with the
			// next request.
			b.resp.SetConnectionClose()
		}
		_ = b.resp.CloseBodyStream()
		fasthttp.ReleaseResponse(b.resp)
	}
	if b.leg != nil {
		b.leg.decodeEnd(err == nil && b.readErr == nil && b.rec.status == fasthttp.StatusOK)
	}
	if b.att.clientGone() {
		// The watcher closed the upstream connection for a client that left.
		b.readErr, err = nil, ErrClientGone
	}
	if err == nil && b.readErr == nil {
		computed, observe := discovery.Uncomputed, true
		switch {
		case b.scan && b.usage.CachedFound && b.usage.PromptFound:
			computed = max(0, b.usage.Prompt-b.usage.Cached)
		case b.learn && s.silentCache(ep, b.usage.PromptFound):
			// An engine that does not report cached tokens (Ollama): the
			// policy reads them from the TTFT; the calibration keeps the
			// policy's estimate, so that it does not fit its own inference,
			// unless the TTFT contradicts it (a prompt taken for evicted
			// was kept, or the reverse): fitted, such answers taught a
			// prefill rate at the bound, and cold prompts looked free.
			observe = !s.opt.Learner.LearnTTFT(b.rec.decision, b.promptBytes, b.lease.TTFT(), b.lease.PredictTTFT)
		}
		if observe {
			b.lease.Complete(computed)
		} else {
			b.lease.Release()
		}
	} else {
		b.lease.Release()
	}
	switch {
	case b.readErr != nil:
		b.legFailed(ep, b.att, b.readErr)
	case err != nil:
		b.rec.status = StatusClientClosedRequest
		s.opt.Logger.Info("client closed the connection", zap.ByteString("request_id", b.rec.reqID),
			zap.String("endpoint", ep.URL), zap.Int64("bytes", b.rec.bytes), zap.NamedError("cause", err))
	}
	if b.scan && b.usage.PromptFound {
		s.opt.Metrics.TenantTokens(b.rec.label, b.usage.Prompt, b.usage.Cached, b.usage.Output)
		b.rec.spent = b.usage.Prompt + b.usage.Output
	}
	if b.learn && err == nil && b.readErr == nil && b.usage.CachedFound {
		est := s.opt.Learner.Learn(b.rec.decision, b.promptBytes, b.usage.Prompt, b.usage.Cached)
		s.opt.Metrics.CacheReport(est, b.usage.Cached)
		b.rec.usage, b.rec.promptTokens, b.rec.cachedTokens = true, b.usage.Prompt, b.usage.Cached
	}
	s.end(&b.rec, err)
	b.resp, b.rd, b.readErr, b.att, b.leg, b.ctx = nil, nil, nil, nil, nil, nil
	b.rec.ep, b.rec.decision = nil, routing.Decision{}
	s.bodies.Put(b)
	return nil
}

type eofReader struct{}

func (eofReader) Read([]byte) (int, error) { return 0, io.EOF }

// silentCache reports whether ep's engine does not say what it served from
// cache, for an answer without cached tokens: an answer that carried a
// usage report (usage) without them shows it, and is remembered; an answer
// without any usage report (a stream whose client did not ask for one)
// says nothing of the engine, and the earlier answers decide.
func (s *Server) silentCache(ep *discovery.Endpoint, usage bool) bool {
	if usage {
		s.uncached.Store(ep, true)
		return true
	}
	_, ok := s.uncached.Load(ep)
	return ok
}
