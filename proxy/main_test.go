package proxy

import (
	"fmt"
	"net/http"
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the test binary if goroutines outlive the tests: a
// server, a Fleet, a stream or a watcher some test (or kvroute) failed to
// stop. Only fasthttp's own background goroutines are ignored, each of
// which exits by itself or lives for the process by design.
func TestMain(m *testing.M) {
	code := m.Run()
	// Keep-alive connections of the tests' own HTTP clients are not
	// kvroute's: close them before looking.
	testClient.CloseIdleConnections()
	http.DefaultClient.CloseIdleConnections()
	if code == 0 {
		if err := goleak.Find(leakOptions...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: Errors on successful test run: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

var leakOptions = []goleak.Option{
	// fasthttp refreshes the Date header of every Server from one
	// process-wide goroutine, started with the first Server.
	goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
	// fasthttp's default dialer expires its DNS cache from one
	// process-wide goroutine, started with the first dial.
	goleak.IgnoreTopFunction("github.com/valyala/fasthttp.(*TCPDialer).tcpAddrsClean"),
	// A Server's worker-pool cleaner sleeps MaxIdleWorkerDuration
	// (10 s) between rounds and sees that its server stopped only
	// at its next round.
	goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*workerPool).Start.func2"),
	// A HostClient's idle-connection cleaner sleeps up to
	// MaxIdleConnDuration (kvroute's upstream-idle timeout) between
	// rounds, and exits at the first round that finds no connection.
	goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*HostClient).connsCleaner"),
	// net/http keep-alive loops of the tests' own clients (several tests
	// build their own), which exit once the peer's close is read;
	// kvroute's data path is fasthttp.
	goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
	goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
}
