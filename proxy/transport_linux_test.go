package proxy

import (
	"net"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// fullListener returns the loopback address of a listening socket whose
// accept queue is full: listen(2) with a backlog of 0, never accepted
// from, and filled with connections until the next SYN goes unanswered
// (Linux drops SYNs to a listener whose accept queue is full, so a dial
// neither succeeds nor is refused: it times out). It skips the test when
// the kernel keeps accepting.
func fullListener(t *testing.T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(sa.(*syscall.SockaddrInet4).Port))
	for range 16 {
		c, err := net.DialTimeout("tcp", addr, 250*time.Millisecond)
		if err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				return addr // full: the next dial times out too
			}
			t.Fatalf("filling the accept queue: %v", err)
		}
		t.Cleanup(func() { _ = c.Close() })
	}
	t.Skip("the kernel kept accepting connections beyond the backlog: no loopback address to time a dial out on")
	return ""
}

// TestConnectTimeout: a dial that neither connects nor is refused ends at
// the connect timeout with kvroute's 504, and releases the request.
func TestConnectTimeout(t *testing.T) {
	addr := fullListener(t)
	h := startProxy(t, nil, Options{Limits: Limits{ConnectTimeout: 300 * time.Millisecond, Retries: 0}}, "http://"+addr)
	resp := post(t, h.url+"/v1/completions", `{"model":"m","prompt":"hi"}`)
	assertOpenAIError(t, resp, 504)
	h.waitIdle(t)
	if n := counterValue(t, h.reg, "kvroute_upstream_errors_total", map[string]string{"kind": "timeout"}); n != 1 {
		t.Errorf("upstream timeouts counted %v, want 1", n)
	}
}
