// Package leakcheck is the goroutine-leak check of kvroute's test binaries:
// goleak with the process-wide goroutines fasthttp starts and never stops
// ignored. A package's tests run it from TestMain.
package leakcheck

import (
	"fmt"
	"net/http"
	"os"
	"testing"

	"go.uber.org/goleak"
)

// Options are the goroutines a leak check ignores: fasthttp's own
// background goroutines, each of which exits by itself or lives for the
// process by design, and the keep-alive loops of the tests' own net/http
// clients.
var Options = []goleak.Option{
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
	// memberlist's probe of a peer (the replicas' gossip) waits out its
	// probe timeout, a second at most, after Shutdown, then exits.
	goleak.IgnoreAnyFunction("github.com/hashicorp/memberlist.(*Memberlist).probeNode"),
	goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
}

// VerifyTestMain runs the tests and fails the binary if goroutines outlive
// them.
func VerifyTestMain(m *testing.M) {
	goleak.VerifyTestMain(m, append(Options, goleak.IgnoreTopFunction("time.Sleep"))...)
}

// Run runs the tests, closes the idle connections of clients (the tests'
// own, and http.DefaultClient's: not kvroute's), and then fails the binary
// if goroutines outlive the tests.
func Run(m *testing.M, clients ...*http.Client) {
	code := m.Run()
	for _, c := range append(clients, http.DefaultClient) {
		c.CloseIdleConnections()
	}
	if code == 0 {
		if err := goleak.Find(Options...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: Errors on successful test run: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}
