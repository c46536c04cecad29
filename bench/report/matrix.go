package report

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"

	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/scenario"
	"github.com/kvroute/kvroute/bench/sim"
)

// The matrix's files, directly under the results directory.
const (
	FileMatrix     = "matrix.md"
	FileMatrixJSON = "matrix.json"
)

// Throughput bases of a matrix row.
const (
	BasisBestStage = "best stage"
	BasisWholeRun  = "whole run"
)

// MatrixRow is one policy on one workload and profile. Ratios are nil
// when the run they compare with is missing or zero.
type MatrixRow struct {
	Profile  string `json:"profile"`
	Workload string `json:"workload"`
	Policy   string `json:"policy"`
	// OutputThroughput is output tokens/s: the best stage's when the load
	// had stages (the policy's throughput at saturation), else the whole
	// run's (Basis says which).
	OutputThroughput float64  `json:"output_tok_s"`
	Basis            string   `json:"throughput_basis"`
	ThroughputVsLR   *float64 `json:"throughput_vs_least_request,omitempty"`
	ThroughputVsRR   *float64 `json:"throughput_vs_round_robin,omitempty"`
	// TTFTP90 is the whole run's p90 TTFT in milliseconds.
	TTFTP90  float64  `json:"ttft_p90_ms"`
	TTFTVsLR *float64 `json:"ttft_p90_vs_least_request,omitempty"`
	TTFTVsRR *float64 `json:"ttft_p90_vs_round_robin,omitempty"`
	// HitRate is the engines' prefix-cache hit rate over the run (nil
	// without engine figures).
	HitRate *float64 `json:"engine_hit_rate,omitempty"`
	Failed  int      `json:"failed"`
}

// MatrixCell describes one profile × workload comparison of the matrix.
type MatrixCell struct {
	Profile      string           `json:"profile"`
	Workload     string           `json:"workload"`
	Sizing       *scenario.Sizing `json:"sizing,omitempty"`
	Load         load.Load        `json:"load"`
	TimeScale    float64          `json:"time_scale"`
	IdealHitRate float64          `json:"ideal_hit_rate"`
	WallSeconds  float64          `json:"wall_s"`
}

// MatrixResult is what matrix.json holds.
type MatrixResult struct {
	Machine scenario.Machine `json:"machine"`
	Cells   []MatrixCell     `json:"cells"`
	Rows    []MatrixRow      `json:"rows"`
}

// NewMatrix gathers the matrix from reps, one per profile × workload, in
// the order given.
func NewMatrix(reps []*scenario.Report) *MatrixResult {
	m := &MatrixResult{}
	for _, rep := range reps {
		sc := &rep.Scenario
		m.Machine = rep.Machine
		m.Cells = append(m.Cells, MatrixCell{Profile: profileOf(sc), Workload: sc.Name, Sizing: sc.Sizing,
			Load: sc.Load, TimeScale: sc.Fleet.TimeScale, IdealHitRate: rep.IdealHitRate, WallSeconds: rep.WallSeconds})
		m.Rows = append(m.Rows, matrixRows(rep)...)
	}
	return m
}

// profileOf is a scenario's profile name, the default for none, after
// "llm-d/" when its pods ran the llm-d simulator.
func profileOf(sc *scenario.Scenario) string {
	name := sc.Profile
	if name == "" {
		name = sim.DefaultProfile
	}
	if sc.Engine != "" && sc.Engine != scenario.EngineKVSim {
		name = sc.Engine + "/" + name
	}
	return name
}

// matrixRows returns one row per run of rep, with ratios to its
// least-request and round-robin runs.
func matrixRows(rep *scenario.Report) []MatrixRow {
	byLabel := make(map[string]*load.Result, len(rep.Runs))
	for _, r := range rep.Runs {
		byLabel[r.Label] = r
	}
	lr, rr := byLabel[scenario.LeastRequest], byLabel[scenario.Baseline]
	rows := make([]MatrixRow, 0, len(rep.Runs))
	for _, r := range rep.Runs {
		tput, basis := saturationThroughput(r)
		row := MatrixRow{Profile: profileOf(&rep.Scenario), Workload: rep.Scenario.Name, Policy: r.Label,
			OutputThroughput: tput, Basis: basis, TTFTP90: r.Summary.TTFT.P90, Failed: r.Summary.Failed}
		if lr != nil {
			lt, _ := saturationThroughput(lr)
			row.ThroughputVsLR, row.TTFTVsLR = ratio(tput, lt), ratio(r.Summary.TTFT.P90, lr.Summary.TTFT.P90)
		}
		if rr != nil {
			rt, _ := saturationThroughput(rr)
			row.ThroughputVsRR, row.TTFTVsRR = ratio(tput, rt), ratio(r.Summary.TTFT.P90, rr.Summary.TTFT.P90)
		}
		if r.Engine != nil {
			h := r.Engine.HitRate
			row.HitRate = &h
		}
		rows = append(rows, row)
	}
	return rows
}

// saturationThroughput returns r's output tokens/s at saturation: the best
// stage's when r had stages, else the whole run's.
func saturationThroughput(r *load.Result) (float64, string) {
	if len(r.Stages) == 0 {
		return r.Summary.OutputThroughput, BasisWholeRun
	}
	best := 0.0
	for _, st := range r.Stages {
		best = max(best, st.Summary.OutputThroughput)
	}
	return best, BasisBestStage
}

// ratio returns a/b, nil when it is undefined.
func ratio(a, b float64) *float64 {
	if !(b > 0) || math.IsNaN(a) {
		return nil
	}
	v := a / b
	return &v
}

// MatrixMarkdown renders m: what the columns mean, how each cell's load
// was sized, and one table of every policy grouped by profile × workload.
func MatrixMarkdown(m *MatrixResult) string {
	var b strings.Builder
	b.WriteString("### Policy matrix: engine profiles × workloads\n\n")
	b.WriteString("Every workload on every engine profile (bench/sim's profiles; loads fitted to each profile's " +
		"capacity, see BENCHMARKS.md). Output tok/s is the best stage's (throughput at saturation) for " +
		"shared-prefix's rising stages and the whole run's for single-rate loads; p90 TTFT is the whole run's. " +
		"Ratios are to the same profile and workload's least-request (LR) and round-robin (RR) runs: " +
		"throughput above 1 and TTFT below 1 are better.\n\n")
	b.WriteString(matrixSizingTable(m.Cells))
	b.WriteString("\n| profile | workload | policy | output tok/s | vs LR | vs RR | TTFT p90 | vs LR | vs RR | engine hit rate | errors |\n")
	b.WriteString("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range m.Rows {
		hit := "–"
		if r.HitRate != nil {
			hit = pct(*r.HitRate)
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %d |\n",
			r.Profile, r.Workload, r.Policy, thousands(int(math.Round(r.OutputThroughput))),
			times(r.ThroughputVsLR), times(r.ThroughputVsRR), ms(r.TTFTP90), times(r.TTFTVsLR), times(r.TTFTVsRR),
			hit, r.Failed)
	}
	return b.String()
}

// matrixSizingTable renders how each cell's load was fitted.
func matrixSizingTable(cells []MatrixCell) string {
	var b strings.Builder
	b.WriteString("| profile | workload | capacity factor | load | time scale | ideal hit rate |\n")
	b.WriteString("|---|---|---:|---|---:|---:|\n")
	for _, c := range cells {
		f := "–"
		if c.Sizing != nil {
			f = fmt.Sprintf("%.2g×", c.Sizing.Factor)
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %g | %s |\n", c.Profile, c.Workload, f, describeLoad(c.Load), c.TimeScale, pct(c.IdealHitRate))
	}
	return b.String()
}

// times formats a ratio as "1.23×"; "–" for none.
func times(v *float64) string {
	if v == nil {
		return "–"
	}
	return fmt.Sprintf("%.2f×", *v)
}

// WriteMatrix writes the matrix of reps to dir/matrix.md and
// dir/matrix.json (dir created if needed), and the pressure scenarios' hit
// rate against working-set size as charts (writePressureCharts), and
// returns the matrix and the paths written.
func WriteMatrix(dir string, reps []*scenario.Report) (*MatrixResult, []string, error) {
	m := NewMatrix(reps)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return m, nil, err
	}
	md, js := filepath.Join(dir, FileMatrix), filepath.Join(dir, FileMatrixJSON)
	if err := os.WriteFile(md, []byte(MatrixMarkdown(m)), 0o644); err != nil {
		return m, nil, err
	}
	files := []string{md, js}
	if err := WriteJSON(js, m, true); err != nil {
		return m, files, err
	}
	charts, err := writePressureCharts(dir, reps)
	return m, append(files, charts...), err
}
