package soak

import (
	"fmt"
	"math"
)

// Rules of the flatness checks.
const (
	RuleGrowth   = "growth"    // the fitted growth after warm-up stays under Limits.GrowthPct
	RuleCount    = "count"     // stays under the warm-up max + slack, and returns to idle after the load
	RuleDrain    = "drain"     // is back near 0 once the load stopped and drained
	RuleBounded  = "bounded"   // never exceeds its designed bound
	RuleInfoOnly = "info-only" // reported, not judged
)

// Limits are the thresholds of the verdict.
type Limits struct {
	// GrowthPct is the largest fitted growth after warm-up, in percent of
	// the fitted start (RSS).
	GrowthPct float64
	// Slack and SlackPct bound counts (goroutines, FDs): the larger of
	// Slack and SlackPct% of the reference value.
	Slack, SlackPct float64
	// InFlightEnd is the most requests kvroute may still count in flight
	// after the drain.
	InFlightEnd float64
	// IndexBound is the most prefix-index entries the fleet's KV capacity
	// allows (0: judge the index by growth).
	IndexBound float64
}

// DefaultLimits: RSS may grow 20% after warm-up; goroutines and FDs stay
// within the warm-up max + max(10, 10%) and return to the idle level +
// that slack; in-flight returns to 0.
func DefaultLimits() Limits {
	return Limits{GrowthPct: 20, Slack: 10, SlackPct: 10, InFlightEnd: 0.5}
}

func (l Limits) slack(ref float64) float64 {
	if math.IsNaN(ref) {
		return l.Slack
	}
	return max(l.Slack, l.SlackPct/100*ref)
}

// SeriesDef is one sampled series and how it is judged.
type SeriesDef struct {
	Key   string // CSV column
	Label string
	Rule  string
	Value func(*Sample) float64
	// Optional series may be missing from kvroute's metrics (older
	// builds); a required one missing fails its check.
	Optional bool
}

// Series returns the judged and charted series, in table order.
func Series() []SeriesDef {
	return []SeriesDef{
		{Key: "rss_mib", Label: "RSS (MiB)", Rule: RuleGrowth, Value: func(s *Sample) float64 { return s.RSSMiB }},
		{Key: "heap_inuse_mib", Label: "Go heap in use (MiB)", Rule: RuleInfoOnly, Value: func(s *Sample) float64 { return s.HeapMiB }},
		{Key: "goroutines", Label: "goroutines", Rule: RuleCount, Value: func(s *Sample) float64 { return s.Goroutines }},
		{Key: "fds", Label: "open FDs", Rule: RuleCount, Value: func(s *Sample) float64 { return s.FDs }},
		{Key: "in_flight", Label: "in-flight requests", Rule: RuleDrain, Value: func(s *Sample) float64 { return s.InFlight }},
		{Key: "queued", Label: "queued requests", Rule: RuleDrain, Optional: true, Value: func(s *Sample) float64 { return s.Queued }},
		{Key: "index_entries", Label: "prefix index entries", Rule: RuleBounded, Value: func(s *Sample) float64 { return s.IndexEntries }},
		{Key: "cpu_pct", Label: "kvroute CPU (%)", Rule: RuleInfoOnly, Value: func(s *Sample) float64 { return s.CPUPercent }},
	}
}

// Check is the verdict on one series. Values are NaN where unknown.
type Check struct {
	Key   string `json:"key"`
	Label string `json:"label"`
	Rule  string `json:"rule"`
	// Baseline is the idle value before the load; WarmupMax the largest
	// value during warm-up; Start and End the fitted line's values at the
	// first and last steady sample (after warm-up, under load); Max the
	// largest steady value; Final the value after the drain.
	Baseline, WarmupMax, Start, End, Max, Final float64
	// GrowthPct is (End − Start) / Start in percent; PerMinute the slope.
	GrowthPct, PerMinute float64
	// Intercept and Slope of the fit (per second), and the fit's window.
	Intercept, Slope float64
	From, To         float64
	Samples          int // steady samples fitted
	Limit            string
	Flat             bool
	Why              string // what failed, or a note
}

// FitLine fits y = a + b·x by least squares over the pairs where neither
// is NaN; ok is false with fewer than two such points or no spread in x.
func FitLine(xs, ys []float64) (a, b float64, ok bool) {
	var n, sx, sy, sxx, sxy float64
	for i := range xs {
		x, y := xs[i], ys[i]
		if math.IsNaN(x) || math.IsNaN(y) {
			continue
		}
		n++
		sx += x
		sy += y
		sxx += x * x
		sxy += x * y
	}
	if n < 2 {
		return 0, 0, false
	}
	d := n*sxx - sx*sx
	if d == 0 {
		return sy / n, 0, false
	}
	b = (n*sxy - sx*sy) / d
	a = (sy - b*sx) / n
	return a, b, true
}

// GrowthPct returns the growth from start to end in percent of start; a
// start of 0 gives 0 for no growth and +Inf for any.
func GrowthPct(start, end float64) float64 {
	switch {
	case start > 0:
		return 100 * (end - start) / start
	case end <= start:
		return 0
	}
	return math.Inf(1)
}

// Evaluate judges each series of samples: warm-up samples are those of the
// load phase before warmupEnd (seconds), steady samples those after.
func Evaluate(samples []Sample, warmupEnd float64, lim Limits) []Check {
	var out []Check
	for _, def := range Series() {
		out = append(out, evaluate(def, samples, warmupEnd, lim))
	}
	return out
}

func evaluate(def SeriesDef, samples []Sample, warmupEnd float64, lim Limits) Check {
	nan := math.NaN()
	c := Check{Key: def.Key, Label: def.Label, Rule: def.Rule, Baseline: nan, WarmupMax: nan, Start: nan, End: nan,
		Max: nan, Final: nan, GrowthPct: nan, PerMinute: nan, Intercept: nan, Slope: nan, From: nan, To: nan}
	xs, ys := c.phases(def, samples, warmupEnd)
	c.Samples = len(xs)
	if len(xs) == 0 && math.IsNaN(c.Baseline) && math.IsNaN(c.Final) && math.IsNaN(c.WarmupMax) {
		c.Limit = "–"
		c.Why = "not exported by this kvroute"
		c.Flat = def.Optional
		if !def.Optional {
			c.Why = "missing from every sample"
		}
		return c
	}
	a, b, ok := FitLine(xs, ys)
	if ok {
		c.From, c.To = xs[0], xs[len(xs)-1]
		c.Intercept, c.Slope = a, b
		c.Start, c.End = a+b*c.From, a+b*c.To
		c.GrowthPct = GrowthPct(c.Start, c.End)
		c.PerMinute = b * 60
	}
	c.Flat = true
	fail := func(format string, args ...any) {
		c.Flat = false
		if c.Why != "" {
			c.Why += "; "
		}
		c.Why += fmt.Sprintf(format, args...)
	}
	needFit := func() bool {
		if len(xs) < 3 || !ok {
			fail("only %d samples after warm-up", len(xs))
			return false
		}
		return true
	}
	switch def.Rule {
	case RuleGrowth:
		c.Limit = fmt.Sprintf("growth ≤ %.0f%%", lim.GrowthPct)
		if needFit() && c.GrowthPct > lim.GrowthPct {
			fail("grew %.1f%% after warm-up", c.GrowthPct)
		}
	case RuleCount:
		c.Limit = fmt.Sprintf("fit end ≤ warm-up max + max(%.0f, %.0f%%); after drain ≤ idle + slack", lim.Slack, lim.SlackPct)
		if needFit() {
			if math.IsNaN(c.WarmupMax) {
				fail("no warm-up sample")
			} else if bound := c.WarmupMax + lim.slack(c.WarmupMax); c.End > bound {
				fail("fitted end %.0f > warm-up max %.0f + slack", c.End, c.WarmupMax)
			}
		}
		switch {
		case math.IsNaN(c.Final):
			fail("no sample after the drain")
		case !math.IsNaN(c.Baseline) && c.Final > c.Baseline+lim.slack(c.Baseline):
			fail("%.0f after the drain against %.0f idle before the load", c.Final, c.Baseline)
		}
	case RuleDrain:
		c.Limit = fmt.Sprintf("≤ %g after the drain", lim.InFlightEnd)
		needFit()
		switch {
		case math.IsNaN(c.Final):
			fail("no sample after the drain")
		case c.Final > lim.InFlightEnd:
			fail("%.0f still in flight after the drain", c.Final)
		}
	case RuleBounded:
		if lim.IndexBound > 0 {
			c.Limit = fmt.Sprintf("≤ %.0f (KV capacity of the fleet)", lim.IndexBound)
			needFit()
			if top := nanMax(c.Max, c.Final); top > lim.IndexBound {
				fail("%.0f entries > bound %.0f", top, lim.IndexBound)
			} else if ok && c.GrowthPct > lim.GrowthPct {
				c.Why = fmt.Sprintf("grew after warm-up, within its bound (%.0f%% of it)", 100*top/lim.IndexBound)
			}
		} else {
			c.Limit = fmt.Sprintf("growth ≤ %.0f%%", lim.GrowthPct)
			if needFit() && c.GrowthPct > lim.GrowthPct {
				fail("grew %.1f%% after warm-up", c.GrowthPct)
			}
		}
	case RuleInfoOnly:
		c.Limit = "reported only"
	}
	return c
}

// phases reads def's series in samples by phase: the idle baseline, the
// warm-up's maximum, the maximum after warm-up and the value after the
// drain into c, and the samples after warm-up (times xs, values ys), which
// the line is fitted to.
func (c *Check) phases(def SeriesDef, samples []Sample, warmupEnd float64) (xs, ys []float64) {
	for i := range samples {
		s := &samples[i]
		v := def.Value(s)
		if math.IsNaN(v) {
			continue
		}
		switch {
		case s.Phase == PhaseBaseline:
			c.Baseline = v
		case s.Phase == PhaseFinal:
			c.Final = v
		case s.Phase == PhaseLoad && s.T < warmupEnd:
			c.WarmupMax = nanMax(c.WarmupMax, v)
		case s.Phase == PhaseLoad:
			xs, ys = append(xs, s.T), append(ys, v)
			c.Max = nanMax(c.Max, v)
		}
	}
	return xs, ys
}

// nanMax is max ignoring NaN operands.
func nanMax(a, b float64) float64 {
	switch {
	case math.IsNaN(a):
		return b
	case math.IsNaN(b):
		return a
	}
	return max(a, b)
}
