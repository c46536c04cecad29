package bench

import (
	"testing"

	"go.uber.org/goleak"
)

// verifyNoLeaks runs the tests and fails if goroutines outlive them.
func verifyNoLeaks(m *testing.M) {
	goleak.VerifyTestMain(m,
		// fasthttp refreshes its Date header and expires its default
		// dialer's DNS cache from process-wide goroutines; a HostClient's
		// idle-connection cleaner sleeps until its next round before
		// noticing it has nothing left to clean.
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
		goleak.IgnoreTopFunction("github.com/valyala/fasthttp.(*TCPDialer).tcpAddrsClean"),
		goleak.IgnoreTopFunction("time.Sleep"),
	)
}
