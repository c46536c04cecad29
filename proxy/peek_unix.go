//go:build linux || darwin || freebsd || netbsd || openbsd

package proxy

import (
	"net"
	"syscall"
)

// peerClosed reports whether the peer of c closed or reset the connection:
// a non-blocking peek (MSG_PEEK, so nothing is consumed) finds the end of
// the stream or an error. A client that sent more bytes (a pipelined
// request) is still there. It does not take c's read lock, so it never
// waits for a reader.
func peerClosed(c net.Conn) bool {
	if u, ok := c.(interface{ NetConn() net.Conn }); ok {
		c = u.NetConn()
	}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	closed := false
	_ = rc.Control(func(fd uintptr) {
		var b [1]byte
		n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		switch {
		case err == nil:
			closed = n == 0
		case err == syscall.EAGAIN || err == syscall.EWOULDBLOCK || err == syscall.EINTR:
		default:
			closed = true // ECONNRESET and the like
		}
	})
	return closed
}
