package scenario

import (
	"context"
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/sim"
)

// The apart phase sends the flood to a fleet and router of its own: under
// kvroute's FIFO queue, which on a shared fleet shuts the quiet tenant out
// (tenants-38*: most of its requests 429), every quiet request is answered
// while the flood is shed on its own fleet.
func TestTenantPhaseApart(t *testing.T) {
	sc := Scenario{Name: NoisyNeighbour, Pods: tenantPods, Seed: 1,
		Sim: sim.Config{Seed: 1, TimeScale: 1, MaxNumSeqs: tenantSeqs}, Workload: tenantWorkload(1)}
	sc.describeFleet()
	quiet := tenantLoad{Name: "quiet", Key: "key-quiet", Share: 0.15, Seed: 11}
	flood := tenantLoad{Name: "noisy", Key: "key-noisy", Share: 4, Seed: 13}
	// About 30 req/s is kvsim's 4 × 4 fleet's capacity on this workload.
	ps := phaseSpec{policy: TenantFIFO, ts: []tenantLoad{quiet, flood}, capacity: 30, apart: true}
	runs, tput, err := runTenantPhase(context.Background(), &sc, ps, TenantOptions{Phase: 2 * time.Second, Reserve: -1}, RunOptions{})
	if err != nil {
		t.Fatal(err)
	}
	q, f := runs[0], runs[1]
	if q.Sum.Requests == 0 || q.Sum.Completed != q.Sum.Requests || q.Rejected+q.Other != 0 {
		t.Errorf("quiet: sent %d, answered %d, 429 %d, other %d: want every request answered", q.Sum.Requests, q.Sum.Completed, q.Rejected, q.Other)
	}
	if f.Rejected == 0 || f.RetryAfter != f.Rejected || f.Sum.Completed == 0 || f.Other != 0 {
		t.Errorf("flood: sent %d, answered %d, 429 %d (Retry-After %d), other %d: want its excess shed on its own fleet",
			f.Sum.Requests, f.Sum.Completed, f.Rejected, f.RetryAfter, f.Other)
	}
	if !(tput > 0) {
		t.Errorf("output %v tokens/s", tput)
	}
}
