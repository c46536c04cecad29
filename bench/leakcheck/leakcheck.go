// Package leakcheck is the goroutine-leak check of kvroute's test binaries:
// goleak with the process-wide goroutines fasthttp starts and never stops
// ignored. A package's tests run it from TestMain.
package leakcheck

import (
	"testing"

	"go.uber.org/goleak"
)

// VerifyTestMain runs the tests and fails the binary if goroutines outlive
// them.
func VerifyTestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// fasthttp refreshes its Date header from one process-wide
		// goroutine and expires its default dialer's DNS cache from
		// another; a stopped server's worker-pool cleaner and a
		// HostClient's idle-connection cleaner exit only after their
		// current sleep.
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*workerPool).Start.func2"),
		goleak.IgnoreTopFunction("github.com/valyala/fasthttp.(*TCPDialer).tcpAddrsClean"),
		goleak.IgnoreTopFunction("time.Sleep"),
	)
}
