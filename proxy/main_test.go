package proxy

import (
	"testing"

	"github.com/kvroute/kvroute/bench/leakcheck"
)

// TestMain fails the test binary if goroutines outlive the tests: a
// server, a Fleet, a stream or a watcher some test (or kvroute) failed to
// stop.
func TestMain(m *testing.M) { leakcheck.Run(m, testClient) }
