package report

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/scenario"
)

// fakeRun is a run of policy with whole-run output throughput tput, p90
// TTFT p90 ms, hit rate hit and, when stages are given, those stages'
// output throughputs.
func fakeRun(policy string, tput, p90, hit float64, stages ...float64) *load.Result {
	r := &load.Result{Label: policy, Summary: load.Summary{OutputThroughput: tput, TTFT: load.Dist{P90: p90}},
		Engine: &load.EngineStats{HitRate: hit}}
	for _, s := range stages {
		r.Stages = append(r.Stages, load.StageResult{Summary: load.Summary{OutputThroughput: s}})
	}
	return r
}

// fakeMatrix is two cells: shared-prefix on slow-large (stages; all three
// reference policies) and random on h100-8b (one rate; no least-request).
func fakeMatrix() []*scenario.Report {
	staged := &scenario.Report{Scenario: scenario.Scenario{Name: scenario.SharedPrefix, Profile: "slow-large",
		Sizing: &scenario.Sizing{Factor: 0.18}}, IdealHitRate: 0.9}
	staged.Runs = []*load.Result{
		fakeRun("round-robin", 900, 4000, 0.2, 500, 1000, 800),
		fakeRun("least-request", 950, 2000, 0.25, 500, 1250, 1200),
		fakeRun("prefix", 1400, 500, 0.85, 500, 1500, 2500),
	}
	single := &scenario.Report{Scenario: scenario.Scenario{Name: scenario.Random}}
	single.Runs = []*load.Result{fakeRun("round-robin", 4000, 100, 0), fakeRun("prefix", 3000, 150, 0.01)}
	return []*scenario.Report{staged, single}
}

func TestMatrixRatios(t *testing.T) {
	m := NewMatrix(fakeMatrix())
	if len(m.Rows) != 5 || len(m.Cells) != 2 || m.Cells[1].Profile != "h100-8b" {
		t.Fatalf("%d rows, cells %+v", len(m.Rows), m.Cells)
	}
	val := func(p *float64) float64 {
		if p == nil {
			return -1
		}
		return *p
	}
	for _, tc := range []struct {
		row                          int
		policy, basis                string
		tput, tLR, tRR, pLR, pRR, hr float64
	}{
		// Best stages 1,000 / 1,250 / 2,500 tok/s; p90 4 s / 2 s / 0.5 s.
		{row: 0, policy: "round-robin", basis: BasisBestStage, tput: 1000, tLR: 0.8, tRR: 1, pLR: 2, pRR: 1, hr: 0.2},
		{row: 1, policy: "least-request", basis: BasisBestStage, tput: 1250, tLR: 1, tRR: 1.25, pLR: 1, pRR: 0.5, hr: 0.25},
		{row: 2, policy: "prefix", basis: BasisBestStage, tput: 2500, tLR: 2, tRR: 2.5, pLR: 0.25, pRR: 0.125, hr: 0.85},
		// Whole run; no least-request run to compare with.
		{row: 4, policy: "prefix", basis: BasisWholeRun, tput: 3000, tLR: -1, tRR: 0.75, pLR: -1, pRR: 1.5, hr: 0.01},
	} {
		r := m.Rows[tc.row]
		got := []float64{r.OutputThroughput, val(r.ThroughputVsLR), val(r.ThroughputVsRR), val(r.TTFTVsLR), val(r.TTFTVsRR), val(r.HitRate)}
		want := []float64{tc.tput, tc.tLR, tc.tRR, tc.pLR, tc.pRR, tc.hr}
		for i := range got {
			if d := got[i] - want[i]; d > 1e-9 || d < -1e-9 || r.Policy != tc.policy || r.Basis != tc.basis {
				t.Errorf("row %d (%s, %s): %v, want %v (%s, %s)", tc.row, r.Policy, r.Basis, got, want, tc.policy, tc.basis)
				break
			}
		}
	}
}

func TestWriteMatrix(t *testing.T) {
	dir := t.TempDir()
	_, files, err := WriteMatrix(dir, fakeMatrix())
	if err != nil || len(files) != 2 {
		t.Fatal(files, err)
	}
	md, _ := os.ReadFile(filepath.Join(dir, FileMatrix))
	for _, want := range []string{
		"| slow-large | shared-prefix | prefix | 2,500 | 2.00× | 2.50× | 500 ms | 0.25× | 0.12× | 85.0% | 0 |",
		"| h100-8b | random | prefix | 3,000 | – | 0.75× | 150 ms | – | 1.50× | 1.0% | 0 |",
		"| slow-large | shared-prefix | 0.18× |",
	} {
		if !strings.Contains(string(md), want) {
			t.Errorf("matrix.md lacks %q:\n%s", want, md)
		}
	}
	var back MatrixResult
	b, _ := os.ReadFile(filepath.Join(dir, FileMatrixJSON))
	if err := json.Unmarshal(b, &back); err != nil || len(back.Rows) != 5 || back.Rows[2].ThroughputVsRR == nil || *back.Rows[2].ThroughputVsRR != 2.5 {
		t.Fatalf("matrix.json does not round-trip: %v %s", err, b)
	}
}

// The pressure scenarios' hit rates against working-set size: one chart
// per engine, profile and workload with two sizes or more, none for one.
func TestPressureCharts(t *testing.T) {
	dir := t.TempDir()
	var reps []*scenario.Report
	for i, name := range []string{scenario.SharedPrefixPressure1, scenario.SharedPrefixPressure2, scenario.SharedPrefixPressure4} {
		for _, engine := range []string{"", scenario.EngineLLMD} {
			rep := &scenario.Report{Scenario: scenario.Scenario{Name: name, Engine: engine}, IdealHitRate: 0.78}
			rep.Scenario.Fleet.WorkingSetShare = float64(int(1) << i)
			rep.Runs = []*load.Result{fakeRun("least-request", 1000, 50, 0.15/float64(i+1)), fakeRun("prefix", 1000, 40, 0.55/float64(i+1)),
				fakeRun(scenario.FixedAffinity, 1000, 45, 0.55/float64(i+1))}
			reps = append(reps, rep)
		}
	}
	lone := &scenario.Report{Scenario: scenario.Scenario{Name: scenario.MultiTurnPressure1}, Runs: []*load.Result{fakeRun("prefix", 1, 1, 0.5)}}
	_, files, err := WriteMatrix(dir, append(reps, lone))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{filepath.Join(dir, "pressure-shared-prefix.png"), filepath.Join(dir, "pressure-shared-prefix-llm-d-h100-8b.png")}
	for _, w := range want {
		if st, err := os.Stat(w); err != nil || st.Size() == 0 {
			t.Errorf("%s not written: %v (files %v)", w, err, files)
		}
	}
	if len(files) != 2+len(want) {
		t.Errorf("files %v", files)
	}
}
