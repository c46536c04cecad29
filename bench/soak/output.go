package soak

import (
	"encoding/csv"
	"fmt"
	"image/color"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// Output files under Config.Out.
const (
	FileCSV      = "soak.csv"
	FileChart    = "soak.png"
	FileReport   = "soak.md"
	FileFaults   = "faults.csv"
	FileRequests = "requests.csv"
	FileLog      = "kvroute.log"
	// kvroute's goroutine profiles before the load and after the drain.
	FileGoroutinesIdle  = "goroutines-idle.txt"
	FileGoroutinesFinal = "goroutines-final.txt"
)

// sampleColumns are the CSV columns of a Sample, in order.
var sampleColumns = []string{"t_s", "phase", "fault", "rss_mib", "heap_inuse_mib", "fds", "goroutines", "in_flight",
	"queued", "index_entries", "index_mib", "cpu_pct", "sent", "ok", "failed", "abandoned", "cut", "lost", "skipped", "client_in_flight"}

// fmtFloat formats a CSV number; NaN is empty.
func fmtFloat(v float64, prec int) string {
	if math.IsNaN(v) {
		return ""
	}
	return strconv.FormatFloat(v, 'f', prec, 64)
}

// WriteCSV writes samples as CSV, one row per sample.
func WriteCSV(w io.Writer, samples []Sample) error {
	cw := csv.NewWriter(w)
	if err := cw.Write(sampleColumns); err != nil {
		return err
	}
	i64 := func(v int64) string { return strconv.FormatInt(v, 10) }
	for _, s := range samples {
		row := []string{fmtFloat(s.T, 2), s.Phase, s.Fault, fmtFloat(s.RSSMiB, 2), fmtFloat(s.HeapMiB, 2),
			fmtFloat(s.FDs, 0), fmtFloat(s.Goroutines, 0), fmtFloat(s.InFlight, 0), fmtFloat(s.Queued, 0),
			fmtFloat(s.IndexEntries, 0), fmtFloat(s.IndexMiB, 3), fmtFloat(s.CPUPercent, 1), i64(s.Sent), i64(s.OK),
			i64(s.Failed), i64(s.Abandoned), i64(s.Cut), i64(s.Lost), i64(s.Skipped), i64(s.ClientInFlight)}
		if err := cw.Write(row); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

// ReadCSV reads what WriteCSV wrote (empty cells as NaN).
func ReadCSV(r io.Reader) ([]Sample, error) {
	rows, err := csv.NewReader(r).ReadAll()
	if err != nil {
		return nil, err
	}
	if len(rows) == 0 || !slices.Equal(rows[0], sampleColumns) {
		return nil, fmt.Errorf("soak: not a soak CSV (header %v)", rows[:min(1, len(rows))])
	}
	var out []Sample
	for n, row := range rows[1:] {
		var perr error
		f := func(i int) float64 {
			if row[i] == "" {
				return math.NaN()
			}
			v, err := strconv.ParseFloat(row[i], 64)
			if err != nil && perr == nil {
				perr = fmt.Errorf("soak: CSV row %d column %s: %w", n+2, sampleColumns[i], err)
			}
			return v
		}
		i := func(k int) int64 { return int64(f(k)) }
		s := Sample{T: f(0), Phase: row[1], Fault: row[2], RSSMiB: f(3), HeapMiB: f(4), FDs: f(5), Goroutines: f(6),
			InFlight: f(7), Queued: f(8), IndexEntries: f(9), IndexMiB: f(10), CPUPercent: f(11), Sent: i(12), OK: i(13),
			Failed: i(14), Abandoned: i(15), Cut: i(16), Lost: i(17), Skipped: i(18), ClientInFlight: i(19)}
		if perr != nil {
			return nil, perr
		}
		out = append(out, s)
	}
	return out, nil
}

// writeFaults writes the fault log as CSV.
func writeFaults(w io.Writer, evs []FaultEvent, urls []string) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"t_s", "pod", "pod_url", "fault", "state"})
	for _, e := range evs {
		state := "off"
		if e.On {
			state = "on"
		}
		u := ""
		if e.Pod < len(urls) {
			u = urls[e.Pod]
		}
		_ = cw.Write([]string{fmtFloat(e.At, 2), strconv.Itoa(e.Pod), u, e.Fault, state})
	}
	cw.Flush()
	return cw.Error()
}

// writeRequests writes one CSV row per request.
func writeRequests(w io.Writer, recs []Record) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"id", "kind", "api", "stream", "abandon_after_s", "start_s", "end_s", "status", "outcome", "cut", "reached_pods", "detail"})
	for _, r := range recs {
		api := "completions"
		if r.Chat {
			api = "chat"
		}
		_ = cw.Write([]string{r.ID, r.Kind, api, strconv.FormatBool(r.Stream), fmtFloat(r.Abandon, 3), fmtFloat(r.Start, 3),
			fmtFloat(r.End, 3), strconv.Itoa(r.Status), r.Outcome, r.Cut, strconv.Itoa(r.Reached), r.Detail})
	}
	cw.Flush()
	return cw.Error()
}

// verdictWord is the table's verdict cell.
func verdictWord(c Check) string {
	switch {
	case c.Rule == RuleInfoOnly:
		return "info"
	case c.Flat:
		return "flat"
	}
	return "NOT FLAT"
}

func cell(v float64, prec int) string {
	if math.IsNaN(v) {
		return "–"
	}
	return strconv.FormatFloat(v, 'f', prec, 64)
}

func growthCell(c Check) string {
	switch {
	case math.IsNaN(c.GrowthPct):
		return "–"
	case math.IsInf(c.GrowthPct, 1):
		return "+∞"
	}
	return fmt.Sprintf("%+.1f%%", c.GrowthPct)
}

// WriteTable prints the checks as an aligned text table.
func WriteTable(w io.Writer, checks []Check) {
	fmt.Fprintf(w, "%-22s %9s %9s %9s %9s %9s %9s %8s  %s\n", "series", "idle", "warm max", "fit start", "fit end", "max", "drained", "growth", "verdict")
	for _, c := range checks {
		prec := 0
		if strings.HasSuffix(c.Key, "_mib") {
			prec = 1
		}
		v := verdictWord(c)
		if c.Why != "" {
			v += " (" + c.Why + ")"
		}
		fmt.Fprintf(w, "%-22s %9s %9s %9s %9s %9s %9s %8s  %s\n", c.Label, cell(c.Baseline, prec), cell(c.WarmupMax, prec),
			cell(c.Start, prec), cell(c.End, prec), cell(c.Max, prec), cell(c.Final, prec), growthCell(c), v)
	}
}

// markdownTable writes the checks as a Markdown table.
func markdownTable(w io.Writer, checks []Check) {
	fmt.Fprintln(w, "| series | idle | warm-up max | fit start | fit end | max | after drain | growth | rule | verdict |")
	fmt.Fprintln(w, "|---|--:|--:|--:|--:|--:|--:|--:|---|---|")
	for _, c := range checks {
		prec := 0
		if strings.HasSuffix(c.Key, "_mib") {
			prec = 1
		}
		v := verdictWord(c)
		if v == "NOT FLAT" {
			v = "**NOT FLAT**"
		}
		if c.Why != "" {
			v += ": " + c.Why
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", c.Label, cell(c.Baseline, prec),
			cell(c.WarmupMax, prec), cell(c.Start, prec), cell(c.End, prec), cell(c.Max, prec), cell(c.Final, prec),
			growthCell(c), c.Limit, v)
	}
}

// Chart colours.
var (
	colSeries = color.RGBA{R: 40, G: 90, B: 160, A: 255}
	colFit    = color.RGBA{R: 200, G: 16, B: 46, A: 255}
	colWarm   = color.Gray{Y: 120}
	colKill   = color.RGBA{R: 230, G: 150, B: 60, A: 255}
	colOK     = color.RGBA{R: 60, G: 150, B: 80, A: 255}
	colFailed = color.RGBA{R: 230, G: 150, B: 60, A: 255}
	colLost   = color.RGBA{R: 200, G: 16, B: 46, A: 255}
)

// WriteChart draws one panel per series (and one of the requests so far)
// into a PNG: samples in blue, the fit after warm-up in red, the end of
// warm-up dashed grey, pod kills in orange.
func WriteChart(path string, samples []Sample, checks []Check, warmupEnd float64, faults []FaultEvent) error {
	defs := Series()
	byKey := make(map[string]Check, len(checks))
	for _, c := range checks {
		byKey[c.Key] = c
	}
	var kills []float64
	for _, e := range faults {
		if e.Fault == FaultKill && e.On {
			kills = append(kills, e.At)
		}
	}
	var panels []*plot.Plot
	for _, d := range defs {
		p, err := seriesPanel(d, byKey[d.Key], samples, warmupEnd, kills)
		if err != nil {
			return err
		}
		panels = append(panels, p)
	}
	rp, err := requestsPanel(samples)
	if err != nil {
		return err
	}
	panels = append(panels, rp)
	if len(samples) > 0 {
		for _, p := range panels { // one time axis for all
			p.X.Min, p.X.Max = samples[0].T, samples[len(samples)-1].T
			p.Y.Tick.Marker = plainTicks{}
		}
	}
	const cols = 2
	rows := (len(panels) + cols - 1) / cols
	grid := make([][]*plot.Plot, rows)
	for j := range grid {
		grid[j] = make([]*plot.Plot, cols)
		for i := range grid[j] {
			if k := j*cols + i; k < len(panels) {
				grid[j][i] = panels[k]
			} else {
				grid[j][i] = plot.New()
				grid[j][i].HideAxes()
			}
		}
	}
	w, h := 11*vg.Inch, vg.Length(rows)*2.6*vg.Inch
	img := vgimg.New(w, h)
	dc := draw.New(img)
	t := draw.Tiles{Rows: rows, Cols: cols, PadX: vg.Millimeter * 6, PadY: vg.Millimeter * 6,
		PadTop: vg.Millimeter * 3, PadBottom: vg.Millimeter * 3, PadLeft: vg.Millimeter * 3, PadRight: vg.Millimeter * 3}
	cs := plot.Align(grid, t, dc)
	for j := range grid {
		for i := range grid[j] {
			grid[j][i].Draw(cs[j][i])
		}
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// seriesPanel draws one series.
func seriesPanel(d SeriesDef, c Check, samples []Sample, warmupEnd float64, kills []float64) (*plot.Plot, error) {
	p := plot.New()
	title := d.Label
	switch {
	case c.Rule == RuleInfoOnly:
	case c.Flat:
		title += fmt.Sprintf(" — flat (%s)", growthCell(c))
	default:
		title += " — NOT FLAT"
	}
	p.Title.Text = title
	p.X.Label.Text = "s since load start"
	p.Add(plotter.NewGrid())
	var pts plotter.XYs
	lo, hi := math.Inf(1), math.Inf(-1)
	for i := range samples {
		v := d.Value(&samples[i])
		if math.IsNaN(v) {
			continue
		}
		pts = append(pts, plotter.XY{X: samples[i].T, Y: v})
		lo, hi = min(lo, v), max(hi, v)
	}
	if len(pts) == 0 {
		return p, nil
	}
	if !math.IsNaN(c.Start) {
		lo, hi = min(lo, c.Start, c.End), max(hi, c.Start, c.End)
	}
	pad := (hi - lo) * 0.08
	if pad == 0 {
		pad = math.Max(1, math.Abs(hi)*0.05)
	}
	lo, hi = lo-pad, hi+pad
	if lo > 0 && lo < (hi-lo)*0.5 {
		lo = 0
	}
	p.Y.Min, p.Y.Max = lo, hi
	vline := func(x float64, col color.Color, dashed bool) error {
		l, err := plotter.NewLine(plotter.XYs{{X: x, Y: lo}, {X: x, Y: hi}})
		if err != nil {
			return err
		}
		l.Color, l.Width = col, vg.Points(0.8)
		if dashed {
			l.Dashes = []vg.Length{vg.Points(3), vg.Points(3)}
		}
		p.Add(l)
		return nil
	}
	for _, k := range kills {
		if err := vline(k, colKill, false); err != nil {
			return nil, err
		}
	}
	if err := vline(warmupEnd, colWarm, true); err != nil {
		return nil, err
	}
	l, s, err := plotter.NewLinePoints(pts)
	if err != nil {
		return nil, err
	}
	l.Color, l.Width = colSeries, vg.Points(1.2)
	s.Color, s.Radius, s.Shape = colSeries, vg.Points(1.5), draw.CircleGlyph{}
	p.Add(l, s)
	if !math.IsNaN(c.Start) && c.Rule != RuleInfoOnly {
		fit, err := plotter.NewLine(plotter.XYs{{X: c.From, Y: c.Start}, {X: c.To, Y: c.End}})
		if err != nil {
			return nil, err
		}
		fit.Color, fit.Width = colFit, vg.Points(1.5)
		fit.Dashes = []vg.Length{vg.Points(5), vg.Points(3)}
		p.Add(fit)
	}
	return p, nil
}

// plainTicks are gonum's default ticks labelled without trailing zeros.
type plainTicks struct{}

func (plainTicks) Ticks(lo, hi float64) []plot.Tick {
	ts := plot.DefaultTicks{}.Ticks(lo, hi)
	for i := range ts {
		if ts[i].Label != "" {
			ts[i].Label = strconv.FormatFloat(ts[i].Value, 'g', 6, 64)
		}
	}
	return ts
}

// requestsPanel draws the cumulative request outcomes.
func requestsPanel(samples []Sample) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = "requests so far"
	p.X.Label.Text = "s since load start"
	p.Add(plotter.NewGrid())
	p.Legend.Top, p.Legend.Left = true, true
	for _, sr := range []struct {
		name string
		col  color.Color
		v    func(*Sample) int64
	}{
		{"ok", colOK, func(s *Sample) int64 { return s.OK }},
		{"failed (clear)", colFailed, func(s *Sample) int64 { return s.Failed }},
		{"lost + cut", colLost, func(s *Sample) int64 { return s.Lost + s.Cut }},
	} {
		var pts plotter.XYs
		for i := range samples {
			if samples[i].Phase == PhaseBaseline {
				continue
			}
			pts = append(pts, plotter.XY{X: samples[i].T, Y: float64(sr.v(&samples[i]))})
		}
		if len(pts) == 0 {
			continue
		}
		l, err := plotter.NewLine(pts)
		if err != nil {
			return nil, err
		}
		l.Color, l.Width = sr.col, vg.Points(1.5)
		p.Add(l)
		p.Legend.Add(sr.name, l)
	}
	return p, nil
}
