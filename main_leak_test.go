package main

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the test binary if goroutines outlive the tests: a
// router, a Fleet, a DNS server or a simulated pod some test (or kvroute)
// failed to stop. Only fasthttp's own background goroutines are ignored,
// each of which exits by itself or lives for the process by design.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
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
	)
}
