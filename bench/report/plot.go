package report

import (
	"image/color"
	"math"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"

	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/scenario"
)

// Chart size: 16:10 at 7 inches, readable in a Markdown page.
const (
	chartW = 7 * vg.Inch
	chartH = 4.375 * vg.Inch
)

// writeCharts draws the TTFT CDF per policy and, when the runs had rate
// stages, throughput and p90 TTFT against the offered rate.
func writeCharts(dir string, rep *scenario.Report) ([]string, error) {
	var files []string
	title := rep.Scenario.Name
	if p, err := ttftCDF(title, rep.Runs); err != nil {
		return files, err
	} else if p != nil {
		path := filepath.Join(dir, FileTTFTCDF)
		if err := p.Save(chartW, chartH, path); err != nil {
			return files, err
		}
		files = append(files, path)
	}
	staged := false
	for _, r := range rep.Runs {
		staged = staged || len(r.Stages) > 1
	}
	if !staged {
		return files, nil
	}
	// Offered output tokens/s: the offered rate × the mean output length.
	var reqs, toks float64
	for _, r := range rep.Runs {
		reqs += float64(r.Summary.Completed)
		toks += float64(r.Summary.OutputTokens)
	}
	perReq := 0.0
	if reqs > 0 {
		perReq = toks / reqs
	}
	for _, c := range []struct {
		file, title, y string
		log            bool
		val            func(*load.Summary) float64
		offered        float64
	}{
		{FileThroughput, title + ": output throughput", "output tokens/s", false,
			func(s *load.Summary) float64 { return s.OutputThroughput }, perReq},
		{FileTTFTRate, title + ": p90 time to first token", "p90 TTFT (s, log)", true,
			func(s *load.Summary) float64 { return s.TTFT.P90 / 1e3 }, 0},
	} {
		p, err := byRate(c.title, c.y, c.log, rep.Runs, c.val, c.offered)
		if err != nil {
			return files, err
		}
		path := filepath.Join(dir, c.file)
		if err := p.Save(chartW, chartH, path); err != nil {
			return files, err
		}
		files = append(files, path)
	}
	return files, nil
}

// ttftCDF plots the empirical CDF of successful requests' TTFT per run on a
// log time axis; nil when no run has a success.
func ttftCDF(title string, runs []*load.Result) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = title + ": time to first token"
	p.X.Label.Text = "TTFT (s, log)"
	p.Y.Label.Text = "fraction of requests ≤ x"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = logTicks{}
	p.Y.Min, p.Y.Max = 0, 1
	p.Add(plotter.NewGrid())
	p.Legend.Top, p.Legend.Left = false, false
	styles := runStyles(runs)
	var mine []plot.Plotter
	drawn := false
	for i, r := range runs {
		var xs []float64
		for _, q := range r.Requests {
			if q.Err == "" && q.TTFT > 0 {
				xs = append(xs, q.TTFT)
			}
		}
		if len(xs) == 0 {
			continue
		}
		slices.Sort(xs)
		// At most ~2,000 points per line: every k-th order statistic.
		step := max(1, len(xs)/2000)
		pts := make(plotter.XYs, 0, len(xs)/step+2)
		for j := 0; j < len(xs); j += step {
			pts = append(pts, plotter.XY{X: xs[j], Y: float64(j+1) / float64(len(xs))})
		}
		pts = append(pts, plotter.XY{X: xs[len(xs)-1], Y: 1})
		l, err := plotter.NewLine(pts)
		if err != nil {
			return nil, err
		}
		styles[i].line(l)
		if styles[i].own {
			mine = append(mine, l)
		} else {
			p.Add(l)
		}
		p.Legend.Add(r.Label, l)
		drawn = true
	}
	if !drawn {
		return nil, nil
	}
	p.Add(mine...) // on top
	p.Legend.XOffs = -vg.Points(4)
	p.Legend.YOffs = vg.Points(8)
	return p, nil
}

// byRate plots one figure per run against each stage's offered rate; with
// offeredPerReq > 0 it first draws the offered load (see addOffered).
func byRate(title, ylabel string, logY bool, runs []*load.Result, val func(*load.Summary) float64, offeredPerReq float64) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "offered load (requests/s)"
	p.Y.Label.Text = ylabel
	p.Add(plotter.NewGrid())
	if logY {
		p.Y.Scale = plot.LogScale{}
		p.Y.Tick.Marker = logTicks{}
	} else {
		p.Y.Min = 0
	}
	p.Legend.Top, p.Legend.Left = true, true
	if offeredPerReq > 0 {
		if err := addOffered(p, runs, offeredPerReq); err != nil {
			return nil, err
		}
	}
	styles := runStyles(runs)
	var mine []plot.Plotter
	for i, r := range runs {
		var pts plotter.XYs
		for _, st := range r.Stages {
			v := val(&st.Summary)
			if math.IsInf(float64(st.Rate), 0) || math.IsNaN(v) || (logY && v <= 0) {
				continue
			}
			pts = append(pts, plotter.XY{X: float64(st.Rate), Y: v})
		}
		if len(pts) == 0 {
			continue
		}
		l, s, err := plotter.NewLinePoints(pts)
		if err != nil {
			return nil, err
		}
		styles[i].line(l)
		styles[i].points(s)
		if styles[i].own {
			mine = append(mine, l, s)
		} else {
			p.Add(l, s)
		}
		p.Legend.Add(r.Label, l, s)
	}
	p.Add(mine...) // on top
	return p, nil
}

// addOffered draws the offered load (rate × perReq) as a grey dashed line.
func addOffered(p *plot.Plot, runs []*load.Result, perReq float64) error {
	var pts plotter.XYs
	for _, r := range runs {
		for _, st := range r.Stages {
			if !math.IsInf(float64(st.Rate), 0) {
				pts = append(pts, plotter.XY{X: float64(st.Rate), Y: float64(st.Rate) * perReq})
			}
		}
		if len(pts) > 0 {
			break
		}
	}
	if len(pts) == 0 {
		return nil
	}
	l, err := plotter.NewLine(pts)
	if err != nil {
		return err
	}
	l.Color = color.Gray{Y: 150}
	l.Dashes = []vg.Length{vg.Points(2), vg.Points(3)}
	p.Add(l)
	p.Legend.Add("offered", l)
	return nil
}

// lineStyle is how a run is drawn. kvroute's own policies (prefix and its
// replicas) stand out in every chart: thick, solid, saturated, drawn last;
// the baselines and peers are thinner, dashed and softer.
type lineStyle struct {
	own    bool
	color  color.Color
	width  vg.Length
	dashes []vg.Length
	shape  draw.GlyphDrawer
	radius vg.Length
}

// runStyles returns the style of each run, in order.
func runStyles(runs []*load.Result) []lineStyle {
	out := make([]lineStyle, len(runs))
	other := 0
	for i, r := range runs {
		if c, ok := ownColor(r.Label); ok {
			out[i] = lineStyle{own: true, color: c, width: vg.Points(3),
				shape: draw.CircleGlyph{}, radius: vg.Points(3.5)}
			continue
		}
		out[i] = lineStyle{color: otherColor(other), width: vg.Points(1.25), dashes: plotutil.Dashes(1 + other),
			shape: plotutil.Shape(1 + other), radius: vg.Points(2.5)}
		other++
	}
	return out
}

// ownColor returns the colour of one of kvroute's own policies: crimson for
// "prefix", dark maroon for its variants ("prefix-3-replicas"); false for
// any other policy.
func ownColor(label string) (color.Color, bool) {
	switch {
	case label == "prefix":
		return color.RGBA{R: 200, G: 16, B: 46, A: 255}, true
	case strings.HasPrefix(label, "prefix-"):
		return color.RGBA{R: 110, G: 10, B: 40, A: 255}, true
	}
	return nil, false
}

// otherColor returns the i-th colour for policies other than kvroute's:
// soft hues without red, so none is mistaken for the prefix policy.
func otherColor(i int) color.Color {
	palette := []color.RGBA{
		{R: 90, G: 155, B: 212, A: 255},  // blue
		{R: 122, G: 195, B: 106, A: 255}, // green
		{R: 250, G: 167, B: 91, A: 255},  // orange
		{R: 158, G: 103, B: 171, A: 255}, // purple
		{R: 80, G: 180, B: 180, A: 255},  // teal
		{R: 190, G: 160, B: 60, A: 255},  // ochre
		{R: 120, G: 120, B: 120, A: 255}, // grey
	}
	return palette[i%len(palette)]
}

func (s lineStyle) line(l *plotter.Line) {
	l.Color, l.Width, l.Dashes = s.color, s.width, s.dashes
}

func (s lineStyle) points(p *plotter.Scatter) {
	p.Color, p.Shape, p.Radius = s.color, s.shape, s.radius
}

// logTicks labels 1, 2 and 5 times powers of ten, with minor ticks between.
type logTicks struct{}

func (logTicks) Ticks(lo, hi float64) []plot.Tick {
	if lo <= 0 || hi <= 0 || hi < lo {
		return nil
	}
	var ts []plot.Tick
	for e := math.Floor(math.Log10(lo)); e <= math.Ceil(math.Log10(hi)); e++ {
		base := math.Pow(10, e)
		for m := 1; m < 10; m++ {
			v := float64(m) * base
			if v < lo*0.999 || v > hi*1.001 {
				continue
			}
			t := plot.Tick{Value: v}
			if m == 1 || m == 2 || m == 5 {
				t.Label = strconv.FormatFloat(v, 'g', 3, 64)
			}
			ts = append(ts, t)
		}
	}
	return ts
}
