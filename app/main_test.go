package app

import (
	"net/http"
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/leakcheck"
	"github.com/kvroute/kvroute/bench/sim"
)

// TestMain fails the test binary if goroutines outlive the tests: a
// router, a Fleet or a subscriber some test (or kvroute) failed to stop.
func TestMain(m *testing.M) { leakcheck.Run(m, testClient) }

var testClient = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}, Timeout: 30 * time.Second}

// startSimFleet starts n simulated pods of cfg until the test ends.
func startSimFleet(t testing.TB, n int, cfg sim.Config) *sim.Fleet {
	t.Helper()
	fleet, err := sim.StartFleet(n, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fleet.Close() })
	return fleet
}
