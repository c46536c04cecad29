package proxy

import (
	"bytes"
	"net"
	"time"
)

// clientListener wraps the API listener so that every client connection
// times its requests: the header block must arrive whole within the
// header timeout of its first byte (fasthttp's ReadTimeout, which this
// wrapper leaves to fasthttp), and the body must keep coming: every read
// of it must return within the body timeout (a client sending its body
// slowly but steadily is served; one that stops is closed). Idle keep-alive
// waits are fasthttp's IdleTimeout.
type clientListener struct {
	net.Listener
	body time.Duration
}

func (l clientListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil || l.body <= 0 {
		return c, err
	}
	return &clientConn{Conn: c, body: l.body}, nil
}

// clientConn is one client connection under clientListener. fasthttp reads
// and writes it from one goroutine.
type clientConn struct {
	net.Conn
	body     time.Duration
	inBody   bool // the current request's header has been read
	progress bool // the body deadline replaced fasthttp's
	tail     [3]byte
	tailN    int
}

// NetConn returns the connection underneath (for the liveness peek).
func (c *clientConn) NetConn() net.Conn { return c.Conn }

func (c *clientConn) Read(p []byte) (int, error) {
	if c.inBody {
		_ = c.Conn.SetReadDeadline(time.Now().Add(c.body))
		c.progress = true
	}
	n, err := c.Conn.Read(p)
	if n > 0 && !c.inBody {
		c.inBody = headerEnds(&c.tail, &c.tailN, p[:n])
	}
	return n, err
}

// Write is the response: the request was read whole, and the next read
// waits for the next request under fasthttp's deadlines.
func (c *clientConn) Write(p []byte) (int, error) {
	if c.inBody {
		c.inBody, c.tailN = false, 0
	}
	if c.progress {
		// fasthttp sets the idle deadline before the next request; until
		// then no deadline of the body's may cut a long response's wait.
		_ = c.Conn.SetReadDeadline(time.Time{})
		c.progress = false
	}
	return c.Conn.Write(p)
}

// headerEnds reports whether b, the next bytes of a header block, contains
// the blank line that ends it, keeping the last bytes in tail in case the
// blank line straddles reads.
func headerEnds(tail *[3]byte, tailN *int, b []byte) bool {
	var j [6]byte
	k := copy(j[:], tail[:*tailN])
	k += copy(j[k:], b[:min(3, len(b))])
	if bytes.Contains(j[:k], crlfcrlf) || bytes.Contains(b, crlfcrlf) {
		*tailN = 0
		return true
	}
	if len(b) >= 3 {
		*tailN = copy(tail[:], b[len(b)-3:])
		return false
	}
	*tailN = copy(tail[:], j[max(0, k-3):k])
	return false
}

// peek (peek_unix.go) finds the client's socket under a clientConn through
// NetConn.
var _ interface{ NetConn() net.Conn } = (*clientConn)(nil)
