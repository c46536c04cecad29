package report

import (
	"cmp"
	"fmt"
	"image/color"
	"path/filepath"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/scenario"
	"github.com/kvroute/kvroute/bench/sim"
)

// pressureFamily returns the workload a pressure scenario belongs to
// ("shared-prefix" for shared-prefix-pressure-2x), "" for other scenarios.
func pressureFamily(name string) string {
	if !slices.Contains(scenario.PressureNames(), name) {
		return ""
	}
	fam, _, _ := strings.Cut(name, "-pressure-")
	return fam
}

// writePressureCharts draws, for every engine, profile and workload of
// the pressure scenarios among reps that ran at two sizes or more, each
// policy's engine hit rate against the prefix working set (× the fleet's
// KV), beside the infinite-cache ideal: dir/pressure-<workload>[-<engine>
// [-<profile>]].png. It returns the files written.
func writePressureCharts(dir string, reps []*scenario.Report) ([]string, error) {
	groups := map[string][]*scenario.Report{}
	var order []string
	for _, rep := range reps {
		fam := pressureFamily(rep.Scenario.Name)
		if fam == "" {
			continue
		}
		k := fam + "\x00" + profileOf(&rep.Scenario)
		if _, ok := groups[k]; !ok {
			order = append(order, k)
		}
		groups[k] = append(groups[k], rep)
	}
	var files []string
	for _, k := range order {
		g := groups[k]
		if len(g) < 2 {
			continue
		}
		fam, prof, _ := strings.Cut(k, "\x00")
		p, err := pressureChart(fam+" under cache pressure ("+prof+")", g)
		if err != nil {
			return files, err
		}
		name := "pressure-" + fam
		if prof != sim.DefaultProfile {
			name += "-" + strings.ReplaceAll(prof, "/", "-")
		}
		path := filepath.Join(dir, name+".png")
		if err := p.Save(chartW, chartH, path); err != nil {
			return files, err
		}
		files = append(files, path)
	}
	return files, nil
}

// pressureChart plots hit rate against working-set share, a line per
// policy and the ideal dashed.
func pressureChart(title string, reps []*scenario.Report) (*plot.Plot, error) {
	slices.SortFunc(reps, func(a, b *scenario.Report) int {
		return cmp.Compare(a.Scenario.Fleet.WorkingSetShare, b.Scenario.Fleet.WorkingSetShare)
	})
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "prefix working set (× the fleet's KV)"
	p.Y.Label.Text = "engine prefix-cache hit rate"
	p.Y.Min, p.Y.Max = 0, 1
	p.Add(plotter.NewGrid())
	ideal := make(plotter.XYs, 0, len(reps))
	byPolicy := map[string]plotter.XYs{}
	var runs []*load.Result // one per policy, for the styles, in first-seen order
	for _, rep := range reps {
		x := rep.Scenario.Fleet.WorkingSetShare
		ideal = append(ideal, plotter.XY{X: x, Y: rep.IdealHitRate})
		for _, r := range rep.Runs {
			if r.Engine == nil {
				continue
			}
			if _, ok := byPolicy[r.Label]; !ok {
				runs = append(runs, r)
			}
			byPolicy[r.Label] = append(byPolicy[r.Label], plotter.XY{X: x, Y: r.Engine.HitRate})
		}
	}
	l, err := plotter.NewLine(ideal)
	if err != nil {
		return nil, err
	}
	l.Color, l.Dashes, l.Width = color.Gray{Y: 120}, []vg.Length{vg.Points(4), vg.Points(3)}, vg.Points(1)
	p.Add(l)
	p.Legend.Add("ideal (infinite cache)", l)
	styles := runStyles(runs)
	for i, r := range runs {
		pts := byPolicy[r.Label]
		l, s, err := plotter.NewLinePoints(pts)
		if err != nil {
			return nil, fmt.Errorf("report: %s: %w", r.Label, err)
		}
		styles[i].line(l)
		styles[i].points(s)
		p.Add(l, s)
		p.Legend.Add(r.Label, l, s)
	}
	p.Legend.Top = true
	return p, nil
}
