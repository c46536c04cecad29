package scenario

import (
	"github.com/kvroute/kvroute/routing"
)

// Matrix is the scenario name of the policy matrix: MatrixScenarios on
// every profile of MatrixProfiles with MatrixPolicies, summed up in one
// table (bench/report's WriteMatrix). kvbench runs it; it is not in Names.
const Matrix = "matrix"

// LeastRequest is the load-only policy the matrix compares against beside
// the baseline.
const LeastRequest = "least-request"

// MatrixScenarios lists the matrix's workloads: the headline case, the
// saturation case, the no-sharing case and the pressure scenarios.
func MatrixScenarios() []string {
	return append([]string{SharedPrefix, HotPrefix, Random}, PressureNames()...)
}

// MatrixPolicies returns the matrix's policies in table order: the
// baseline, least-request, kvroute's prefix policy, and every peer (an
// entry of Policies() whose router is not one of kvroute's own,
// routing.Policies()).
func MatrixPolicies() []Policy {
	own := routing.Policies()
	var out []Policy
	for _, p := range Policies() {
		_, ours := own[p.router()]
		if p.Name == Baseline || p.Name == LeastRequest || p.Name == "prefix" || !ours && p.Replicas <= 1 {
			out = append(out, p)
		}
	}
	return out
}

// Only returns rep with only the runs labelled with names' policies, in
// rep's order, and whether every one of them was there. rep is not
// modified.
func (rep *Report) Only(names []string) (*Report, bool) {
	want := make(map[string]bool, len(names))
	for _, n := range names {
		want[n] = true
	}
	out := *rep
	out.Runs = nil
	for _, r := range rep.Runs {
		if want[r.Label] {
			out.Runs = append(out.Runs, r)
			delete(want, r.Label)
		}
	}
	return &out, len(want) == 0
}
