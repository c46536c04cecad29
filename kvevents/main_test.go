package kvevents

import (
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/leakcheck"
)

// TestMain fails the test binary if goroutines outlive the tests: a
// subscriber, publisher, replay socket or tokenizer some test (or
// kvevents) failed to stop.
func TestMain(m *testing.M) { leakcheck.Run(m) }

// waitTimeout bounds every wait of these tests; it is a deadlock guard, not
// a speed assertion.
const waitTimeout = 10 * time.Second

// recv returns the next value from ch (the zero value once ch is
// closed), failing the test if none comes within waitTimeout.
func recv[T any](t testing.TB, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(waitTimeout):
		t.Fatalf("timed out waiting for %s", what)
		var zero T
		return zero
	}
}
