package soak

import (
	"bytes"
	"fmt"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvroute/kvroute/bench/sim"
)

// The simulated pods run in this process, each behind a listener of ours:
// its connections are watched, so that a stream the pod itself cut (killed,
// or a dropped connection) is known by request id, and they can stall a
// stream in the middle (a fault the simulator has no knob for).

// Cut reasons.
const (
	CutKill = "kill" // the pod was closed while the stream ran
	CutDrop = "drop" // the pod closed the connection itself (drop fault)
)

// cut is one response a pod ended before its end.
type cut struct {
	id     string // X-Request-Id of the request ("" when not seen)
	reason string
}

// podSet is the fleet: one slot per pod, each keeping its address across
// restarts. Safe for concurrent use.
type podSet struct {
	slots []*slot

	stalledWrites atomic.Int64 // writes held by a mid-stream stall

	mu   sync.Mutex
	cuts map[string]string // request id → reason
	anon map[string]int    // cuts without a request id, by reason
	seen map[string]int    // request id → times a pod read it
}

// slot is one pod position: its address, the running pod and the state of
// the faults we inject around it.
type slot struct {
	set  *podSet
	i    int
	cfg  sim.Config
	addr string

	mu      sync.Mutex
	pod     *sim.Pod
	ln      net.Listener
	serving chan struct{} // closed when Serve returned
	down    bool          // closed by a kill, not yet restarted
	closing atomic.Bool   // a kill is in progress: cuts are CutKill

	// stall, when non-nil, holds the writes of responses in mid-stream
	// until it is closed.
	stall atomic.Pointer[chan struct{}]
	// gone is closed when the pod is killed, releasing stalled writes.
	gone atomic.Pointer[chan struct{}]
}

// startPods starts one pod per config on 127.0.0.1 ports of the system's
// choosing.
func startPods(cfgs []sim.Config) (*podSet, error) {
	s := &podSet{cuts: make(map[string]string), anon: make(map[string]int), seen: make(map[string]int)}
	for i, cfg := range cfgs {
		sl := &slot{set: s, i: i, cfg: cfg, addr: "127.0.0.1:0"}
		if err := sl.start(); err != nil {
			s.close()
			return nil, fmt.Errorf("pod %d: %w", i, err)
		}
		s.slots = append(s.slots, sl)
	}
	return s, nil
}

// urls returns the pods' base URLs.
func (s *podSet) urls() []string {
	out := make([]string, len(s.slots))
	for i, sl := range s.slots {
		sl.mu.Lock()
		out[i] = "http://" + sl.addr
		sl.mu.Unlock()
	}
	return out
}

// close closes every pod.
func (s *podSet) close() {
	var wg sync.WaitGroup
	for _, sl := range s.slots {
		wg.Go(sl.kill)
	}
	wg.Wait()
}

// cutReason returns why the pod cut request id's response, or "".
func (s *podSet) cutReason(id string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cuts[id]
}

// cutCounts returns the cuts seen by reason, with and without request id.
func (s *podSet) cutCounts() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int)
	for _, r := range s.cuts {
		out[r]++
	}
	for r, n := range s.anon {
		out[r] += n
	}
	return out
}

// reached returns how many times pods read request id.
func (s *podSet) reached(id string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.seen[id]
}

func (s *podSet) recordSeen(id string) {
	s.mu.Lock()
	s.seen[id]++
	s.mu.Unlock()
}

func (s *podSet) recordCut(c cut) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if c.id == "" {
		s.anon[c.reason]++
		return
	}
	s.cuts[c.id] = c.reason
}

// start builds the pod and serves it on the slot's address (a new port the
// first time, the same one after a kill).
func (sl *slot) start() error {
	p, err := sim.New(sl.cfg)
	if err != nil {
		return err
	}
	var ln net.Listener
	for try := 0; ; try++ {
		ln, err = net.Listen("tcp", sl.addr)
		if err == nil || try == 20 {
			break
		}
		time.Sleep(100 * time.Millisecond) // the old listener's port is still being released
	}
	if err != nil {
		p.Close()
		return err
	}
	gone := make(chan struct{})
	sl.gone.Store(&gone)
	serving := make(chan struct{})
	sl.mu.Lock()
	sl.pod, sl.ln, sl.serving, sl.down = p, &watchListener{Listener: ln, sl: sl}, serving, false
	sl.addr = ln.Addr().String()
	wl := sl.ln
	sl.mu.Unlock()
	go func() {
		defer close(serving)
		_ = p.Serve(wl)
	}()
	return nil
}

// kill closes the pod like a crash: streams cut, port closed. Idempotent
// until the next restart.
func (sl *slot) kill() {
	sl.mu.Lock()
	p, serving, down := sl.pod, sl.serving, sl.down
	sl.down = true
	sl.mu.Unlock()
	if down || p == nil {
		return
	}
	sl.closing.Store(true)
	if g := sl.gone.Load(); g != nil {
		close(*g)
	}
	_ = p.Close()
	<-serving
	sl.closing.Store(false)
}

// restart starts a fresh pod on the same address if it is down.
func (sl *slot) restart() error {
	sl.mu.Lock()
	down := sl.down
	sl.mu.Unlock()
	if !down {
		return nil
	}
	return sl.start()
}

// setFaults replaces the simulator's own faults of a running pod.
func (sl *slot) setFaults(f sim.Faults) {
	sl.mu.Lock()
	p, down := sl.pod, sl.down
	sl.mu.Unlock()
	if p != nil && !down {
		_ = p.SetFaults(f)
	}
}

// stallMidStream holds every response already streaming (past its first
// write) until release is called.
func (sl *slot) stallMidStream() (release func()) {
	ch := make(chan struct{})
	sl.stall.Store(&ch)
	var once sync.Once
	return func() {
		once.Do(func() {
			sl.stall.CompareAndSwap(&ch, nil)
			close(ch)
		})
	}
}

// watchListener wraps every accepted connection in a watchConn.
type watchListener struct {
	net.Listener
	sl *slot
}

func (l *watchListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &watchConn{Conn: c, sl: l.sl}, nil
}

// watchConn follows HTTP/1.1 exchanges on a pod's connection: the request
// id of the request read, whether the response written is complete. A
// connection the pod closes in the middle of a response, with no error
// from the peer before, is a cut. fasthttp serves a connection from one
// goroutine, so reads and writes never race; Close may come from another.
type watchConn struct {
	net.Conn
	sl *slot

	mu      sync.Mutex
	id      string // request id of the current exchange
	scanned bool   // the current request's headers were scanned
	resp    respTracker
	peerErr bool // a read or write failed: the peer went first
	closed  bool
}

var (
	hdrRequestID      = []byte("\r\nX-Request-Id:")
	hdrRequestIDLower = []byte("\r\nx-request-id:")
)

func (c *watchConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.mu.Lock()
	if n > 0 {
		if c.resp.active && c.resp.done {
			c.resp = respTracker{}
			c.id, c.scanned = "", false
		}
		if !c.scanned {
			c.id, c.scanned = scanRequestID(p[:n])
			if c.id != "" {
				c.sl.set.recordSeen(c.id)
			}
		}
	}
	if err != nil {
		c.peerErr = true
	}
	c.mu.Unlock()
	return n, err
}

// scanRequestID finds the X-Request-Id header in the start of a request;
// scanned reports whether the header block was seen (found or not).
func scanRequestID(b []byte) (id string, scanned bool) {
	end := bytes.Index(b, []byte("\r\n\r\n"))
	head := b
	if end >= 0 {
		head = b[:end+2]
	}
	i := bytes.Index(head, hdrRequestID)
	if i < 0 {
		i = bytes.Index(head, hdrRequestIDLower)
	}
	if i >= 0 {
		v := head[i+len(hdrRequestID):]
		if j := bytes.Index(v, []byte("\r\n")); j >= 0 {
			return string(bytes.TrimSpace(v[:j])), true
		}
	}
	return "", end >= 0
}

func (c *watchConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	if c.resp.active && c.resp.done {
		c.resp = respTracker{} // a second response without a read between (not expected)
	}
	midStream := c.resp.active && c.resp.chunked && !c.resp.done
	c.mu.Unlock()
	if midStream {
		if ch := c.sl.stall.Load(); ch != nil {
			c.sl.set.stalledWrites.Add(1)
			var gone <-chan struct{}
			if g := c.sl.gone.Load(); g != nil {
				gone = *g
			}
			select {
			case <-*ch:
			case <-gone:
			}
		}
	}
	n, err := c.Conn.Write(p)
	c.mu.Lock()
	c.resp.write(p[:n])
	if err != nil {
		c.peerErr = true
	}
	c.mu.Unlock()
	return n, err
}

func (c *watchConn) Close() error {
	c.mu.Lock()
	first := !c.closed
	c.closed = true
	cutNow := first && c.resp.active && !c.resp.done && !c.peerErr
	id := c.id
	c.mu.Unlock()
	if cutNow {
		reason := CutDrop
		if c.sl.closing.Load() {
			reason = CutKill
		}
		c.sl.set.recordCut(cut{id: id, reason: reason})
	}
	return c.Conn.Close()
}

// respTracker follows one HTTP/1.1 response as it is written: its header
// block, then a chunked body up to its last chunk or a body of
// Content-Length bytes.
type respTracker struct {
	active    bool // some byte of the response was written
	done      bool // the whole response was written
	header    []byte
	inBody    bool
	chunked   bool
	remaining int64  // Content-Length bytes still to write
	tail      []byte // the last bytes of a chunked body
}

var chunkedEnd = []byte("0\r\n\r\n")

// write accounts for b, the next bytes of the response.
func (t *respTracker) write(b []byte) {
	if len(b) == 0 || t.done {
		return
	}
	t.active = true
	if !t.inBody {
		t.header = append(t.header, b...)
		end := bytes.Index(t.header, []byte("\r\n\r\n"))
		if end < 0 {
			if len(t.header) > 64<<10 {
				t.header = t.header[len(t.header)-4:]
			}
			return
		}
		head, body := t.header[:end+2], t.header[end+4:]
		t.inBody = true
		t.chunked, t.remaining = parseFraming(head)
		t.header = nil
		if !t.chunked && t.remaining <= 0 {
			t.done = true
			return
		}
		b = body
	}
	if t.chunked {
		t.tail = append(t.tail, b...)
		if len(t.tail) > 64 {
			t.tail = append(t.tail[:0], t.tail[len(t.tail)-16:]...)
		}
		t.done = bytes.HasSuffix(t.tail, chunkedEnd) && chunkedTailIsEnd(t.tail)
		return
	}
	t.remaining -= int64(len(b))
	t.done = t.remaining <= 0
}

// chunkedTailIsEnd tells the last-chunk "0\r\n\r\n" from a data chunk
// that happens to end in "0\r\n" followed by the chunk's CRLF: the last
// chunk starts a line.
func chunkedTailIsEnd(tail []byte) bool {
	i := len(tail) - len(chunkedEnd)
	return i == 0 || (i >= 2 && tail[i-2] == '\r' && tail[i-1] == '\n')
}

// parseFraming reads the body framing of a response header block: chunked,
// or the Content-Length (0 when absent: no body, as fasthttp writes a
// length or chunks for every body it sends).
func parseFraming(head []byte) (chunked bool, length int64) {
	for line := range bytes.SplitSeq(head, []byte("\r\n")) {
		k, v, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			continue
		}
		v = bytes.TrimSpace(v)
		switch {
		case bytes.EqualFold(bytes.TrimSpace(k), []byte("Transfer-Encoding")):
			chunked = chunked || bytes.Contains(bytes.ToLower(v), []byte("chunked"))
		case bytes.EqualFold(bytes.TrimSpace(k), []byte("Content-Length")):
			if n, err := strconv.ParseInt(string(v), 10, 64); err == nil {
				length = n
			}
		}
	}
	return chunked, length
}
