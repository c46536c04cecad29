package proxy

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/valyala/fasthttp"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvroute/kvroute/discovery"
)

// An attempt is one upstream try of a request. It links the request's
// client connection to the upstream connection carrying it, so that when
// the client leaves, the upstream request is cancelled (its connection
// closed: the engine sees the disconnect and stops generating), and it
// tells the retry loop whether the request provably never reached the
// endpoint.
//
// fasthttp's client hands out pooled connections without saying which one
// a request went on, so the link is made on the wire: every upstream
// request carries a W3C traceparent whose parent id (the span of this
// attempt) is unique, and the connection finds its attempt by that id in
// the first bytes of the request it writes (timedConn.Write).
type attempt struct {
	id     uint64
	client net.Conn // the client's connection; nil when unknown

	ep *discovery.Endpoint // where it was sent

	mu      sync.Mutex
	conn    *timedConn // the upstream connection, once the request is on it, until end
	movable bool       // its answer streams and may be continued elsewhere (migrate.go)
	drained bool       // aborted because its endpoint left discovery or drains
	gone    bool       // the client left; conn was closed for it
	aborted bool       // kvroute gave the attempt up; conn was closed for it
	failed  bool       // a write of the request failed
	ended   bool       // end was called: conn may carry another request now
	until   time.Time  // when set, the attempt's reads end then (the prefill timeout)
	// Preemption (preempt.go): offered is when its stream was offered as
	// a place the queue may take back (zero: it may not), for flow, the
	// request having been seq in the queue's order; cut: it was.
	offered time.Time
	flow    uint64
	seq     uint64
	cut     bool

	span trace.Span // with tracing: the attempt's span, until end
}

// attempts are the attempts in flight, by id, and the watcher that checks
// their clients.
type attempts struct {
	m sync.Map // uint64 → *attempt
	// tick, when set, is called each round while attempts are in flight
	// (the server's check for endpoints that left: drainGone).
	tick func()
	// closedEarly, when set, is told of an endpoint that closed a pooled
	// connection before kvroute's idle timeout (timedConn.Write).
	closedEarly func(*discovery.Endpoint)
	n           atomic.Int64
	stop        chan struct{}
	once        sync.Once
	wg          sync.WaitGroup
}

// clientCheckInterval is how often the watcher checks whether the clients of
// the attempts in flight are still connected: a client that left is noticed
// within about this long, and its upstream request cancelled.
const clientCheckInterval = 500 * time.Millisecond

// start runs the watcher until close. cancelled is called for each attempt
// cancelled because its client left.
func (as *attempts) start(cancelled func()) {
	as.once.Do(func() {
		as.stop = make(chan struct{})
		as.wg.Add(1)
		go func() {
			defer as.wg.Done()
			t := time.NewTicker(clientCheckInterval)
			defer t.Stop()
			for {
				select {
				case <-as.stop:
					return
				case <-t.C:
				}
				if as.n.Load() == 0 {
					continue
				}
				if as.tick != nil {
					as.tick()
				}
				as.m.Range(func(_, v any) bool {
					a := v.(*attempt)
					if a.client != nil && peerClosed(a.client) && a.cancel() {
						cancelled()
					}
					return true
				})
			}
		}()
	})
}

// close stops the watcher.
func (as *attempts) close() {
	as.once.Do(func() {}) // a watcher never started stays so
	if as.stop != nil {
		select {
		case <-as.stop:
		default:
			close(as.stop)
		}
	}
	as.wg.Wait()
}

// begin registers a new attempt to ep for a request whose client is on
// client, under id (0: a random one), with its span (nil without tracing).
func (as *attempts) begin(client net.Conn, id uint64, ep *discovery.Endpoint, span trace.Span) *attempt {
	if id == 0 {
		id = rand.Uint64() | 1
	}
	// Complete before it is published: drainGone reads ep from another
	// goroutine.
	a := &attempt{id: id, client: client, ep: ep, span: span}
	as.m.Store(a.id, a)
	as.n.Add(1)
	return a
}

// end unregisters a and unlinks its connection, which may carry another
// request from now on.
func (as *attempts) end(a *attempt) {
	if a == nil {
		return
	}
	if _, ok := as.m.LoadAndDelete(a.id); ok {
		as.n.Add(-1)
	}
	a.mu.Lock()
	a.conn, a.ended = nil, true
	failed := a.failed || a.aborted || a.gone
	a.mu.Unlock()
	a.endSpan(failed)
}

// find returns the attempt whose traceparent is in the request bytes p, or
// nil.
func (as *attempts) find(p []byte) *attempt {
	i := bytes.Index(p, traceparentLine)
	if i < 0 {
		return nil
	}
	// "00-" trace-id (32 hex) "-" parent-id (16 hex)
	j := i + len(traceparentLine) + 3 + 32 + 1
	if j+16 > len(p) {
		return nil
	}
	id, err := strconv.ParseUint(string(p[j:j+16]), 16, 64)
	if err != nil {
		return nil
	}
	if v, ok := as.m.Load(id); ok {
		return v.(*attempt)
	}
	return nil
}

var traceparentLine = []byte("\r\nTraceparent: ")

// cancel marks the client gone and closes the upstream connection, once;
// it reports whether this call did it.
func (a *attempt) cancel() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.gone || a.ended {
		return false
	}
	a.gone = true
	if a.conn != nil {
		_ = a.conn.Conn.Close()
	}
	return true
}

// abort closes the attempt's upstream connection (now, or when it links)
// while the attempt has not ended: the endpoint stops, and the reader of
// its answer gets an error.
func (a *attempt) abort() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.ended {
		return
	}
	a.aborted = true
	if a.conn != nil {
		_ = a.conn.Conn.Close()
	}
}

// setMovable marks the attempt's answer as a stream that may be continued
// elsewhere.
func (a *attempt) setMovable() {
	a.mu.Lock()
	a.movable = true
	a.mu.Unlock()
}

// drain aborts a movable attempt because its endpoint left or drains, and
// reports whether it did.
func (a *attempt) drain() bool {
	a.mu.Lock()
	movable := a.movable && !a.ended && !a.aborted
	a.drained = a.drained || movable
	a.mu.Unlock()
	if movable {
		a.abort()
	}
	return movable
}

// offer makes a movable attempt's place one the queue may take back for
// another flow's request (preempt.go): its stream runs for flow, its
// request was seq in the queue's order, and it started at (zero: now; a
// cut stream's continuation keeps its first leg's).
func (a *attempt) offer(flow, seq uint64, at time.Time) {
	if at.IsZero() {
		at = time.Now()
	}
	a.mu.Lock()
	a.offered, a.flow, a.seq = at, flow, seq
	a.mu.Unlock()
}

// preempt aborts an offered attempt to free its place, and reports
// whether it did.
func (a *attempt) preempt() bool {
	a.mu.Lock()
	ok := a.movable && !a.offered.IsZero() && !a.ended && !a.aborted && !a.gone
	a.cut = a.cut || ok
	if ok && a.conn != nil {
		// Reset rather than close: an engine finds a closed connection at
		// its second write after the close, a reset one at its first, a
		// token sooner (kvsim: the request given the place started with a
		// median TTFT of 41 ms after a close, 34–35 ms after a reset).
		if tc, isTCP := a.conn.Conn.(*net.TCPConn); isTCP {
			_ = tc.SetLinger(0)
		}
	}
	a.mu.Unlock()
	if ok {
		a.abort()
	}
	return ok
}

// wasCut reports whether preempt aborted the attempt.
func (a *attempt) wasCut() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.cut
}

// wasDrained reports whether drain aborted the attempt.
func (a *attempt) wasDrained() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.drained
}

// wasAborted reports whether abort was called.
func (a *attempt) wasAborted() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.aborted
}

// deadline makes every read of the attempt's answer end by t.
func (a *attempt) deadline(t time.Time) {
	a.mu.Lock()
	a.until = t
	a.mu.Unlock()
}

// clientGone reports whether the attempt was cancelled for its client.
func (a *attempt) clientGone() bool {
	if a == nil {
		return false
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.gone
}

// neverStarted reports whether the endpoint provably never received the
// whole request, so it cannot have started it: a write of it failed.
func (a *attempt) neverStarted() bool {
	if a == nil {
		return false
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.failed
}

// link attaches the upstream connection c, which carries the request.
func (a *attempt) link(c *timedConn) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.conn, a.failed = c, false // a resend on a new connection starts over
	if !a.until.IsZero() {
		c.until = a.until
	}
	if a.gone || a.aborted {
		_ = c.Conn.Close()
	}
}

// upstream returns the attempt's upstream connection (nil before the
// request is on one, or when it is not known).
func (a *attempt) upstream() *timedConn {
	if a == nil {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.conn
}

// drainBy makes the attempt's connection give up reading at t.
func (a *attempt) drainBy(t time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.conn != nil {
		a.conn.until = t
	}
}

// wrote records the outcome of one write of the request.
func (a *attempt) wrote(err error) {
	if a == nil || err == nil {
		return
	}
	a.mu.Lock()
	a.failed = true
	a.mu.Unlock()
}

// neverSent reports whether err, returned by the client for a request,
// shows that the endpoint cannot have started it: the connection could not
// be made, no connection was free, or the request could not be written
// whole. After a timeout, or a connection closed or reset once the request
// was sent, the engine may be generating, and the request is not re-sent.
func neverSent(err error, a *attempt) bool {
	var op *net.OpError
	switch {
	case errors.Is(err, fasthttp.ErrNoFreeConns), errors.Is(err, fasthttp.ErrDialTimeout),
		errors.Is(err, syscall.ECONNREFUSED):
		return true
	case errors.As(err, &op) && op.Op == "dial":
		return true
	}
	return a.neverStarted()
}

// timedConn is an upstream connection. It applies the response-header
// timeout from a request's write to the end of the response's header block
// (a pod that sends part of a header and stalls is timed out like one that
// sends nothing), then the stream-idle timeout (if any) to every later read.
// Deadlines are set just before reading, because fasthttp clears the read
// deadline of a new connection after writing the request. It links each
// request it carries to its attempt (attempts.find). A connection serves
// one request at a time.
type timedConn struct {
	net.Conn
	as           *attempts
	header, idle time.Duration
	att          *attempt // the attempt of the current request
	writing      bool     // a request is being written
	linking      bool     // its attempt is not found yet
	inHeader     bool     // the response header has not ended yet
	armed        bool     // the header deadline of the current request is set
	deadline     bool     // some read deadline is set
	tail         [3]byte  // the last bytes of the header read so far
	tailN        int
	until        time.Time // when set, the one read deadline (draining an answer)
	idleUntil    time.Time // the stream-idle deadline set (zero: none is)
	used         bool      // a request was written before: the connection is reused
	// beforeRead, while a response body streams from the connection, is
	// called before every read from the socket: what its reader buffered
	// is used up (upstreamBody.WriteTo).
	beforeRead func()
}

func (c *timedConn) Write(p []byte) (int, error) {
	first := !c.writing
	if first { // the first write of a new request
		c.writing, c.linking, c.inHeader, c.armed, c.tailN, c.att, c.until = true, true, true, false, 0, nil, time.Time{}
		c.idleUntil = time.Time{}
	}
	if c.linking {
		if a := c.as.find(p); a != nil {
			c.att, c.linking = a, false
			a.link(c)
		} else if bytes.Contains(p, crlfcrlf) {
			c.linking = false // the header went by without a known attempt
		}
	}
	if first && c.used && peerClosed(c.Conn) {
		// A pooled connection the endpoint closed while it sat idle (its
		// keep-alive timeout, a graceful shutdown, a pod that died): the
		// request is not sent, so it provably never started.
		if c.att != nil && c.as.closedEarly != nil {
			c.as.closedEarly(c.att.ep)
		}
		c.att.wrote(errStaleConn)
		return 0, errStaleConn
	}
	c.used = true
	n, err := c.Conn.Write(p)
	c.att.wrote(err)
	return n, err
}

// SetReadDeadline and SetDeadline forget the stream-idle deadline set,
// which t replaces.
func (c *timedConn) SetReadDeadline(t time.Time) error {
	c.idleUntil = time.Time{}
	return c.Conn.SetReadDeadline(t)
}

func (c *timedConn) SetDeadline(t time.Time) error {
	c.idleUntil = time.Time{}
	return c.Conn.SetDeadline(t)
}

// errStaleConn: a pooled connection its endpoint had closed.
var errStaleConn = errors.New("proxy: pooled upstream connection closed by the endpoint")

var crlfcrlf = []byte("\r\n\r\n")

func (c *timedConn) Read(p []byte) (int, error) {
	c.writing = false
	if c.beforeRead != nil {
		c.beforeRead() // before the deadline: writing to the client may wait
	}
	switch {
	case !c.until.IsZero():
		_ = c.Conn.SetReadDeadline(c.until)
		c.deadline, c.idleUntil = true, time.Time{}
	case c.inHeader && c.header > 0:
		if !c.armed {
			_ = c.Conn.SetReadDeadline(time.Now().Add(c.header))
			c.armed, c.deadline, c.idleUntil = true, true, time.Time{}
		}
	case c.idle > 0:
		// Moving the deadline costs a timer update per read: it moves once
		// more than idle/16 has passed since it last did, to idle·17/16
		// ahead, so silence times out after between idle and idle·17/16.
		if now := time.Now(); c.idleUntil.Sub(now) < c.idle {
			c.idleUntil = now.Add(c.idle + c.idle/16)
			_ = c.Conn.SetReadDeadline(c.idleUntil)
			c.deadline = true
		}
	case c.deadline:
		_ = c.Conn.SetReadDeadline(time.Time{})
		c.deadline, c.idleUntil = false, time.Time{}
	}
	n, err := c.Conn.Read(p)
	if n > 0 && c.inHeader && headerEnds(&c.tail, &c.tailN, p[:n]) {
		c.inHeader = false
	}
	return n, err
}
