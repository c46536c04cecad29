package routing

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the test binary if goroutines outlive the tests (a Fleet
// or a loopback server some test forgot to stop).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
