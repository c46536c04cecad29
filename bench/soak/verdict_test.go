package soak

import (
	"bytes"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/leakcheck"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9*math.Max(1, math.Abs(b)) }

func TestFitLine(t *testing.T) {
	xs := []float64{0, 1, 2, 3, math.NaN(), 5}
	ys := []float64{1, 3, 5, 7, 100, 11} // y = 1 + 2x; the NaN pair is skipped
	a, b, ok := FitLine(xs, ys)
	if !ok || !near(a, 1) || !near(b, 2) {
		t.Fatalf("FitLine = %v, %v, %v; want 1, 2, true", a, b, ok)
	}
	if _, _, ok := FitLine([]float64{1}, []float64{1}); ok {
		t.Fatal("one point fitted")
	}
	if _, _, ok := FitLine([]float64{2, 2}, []float64{1, 3}); ok {
		t.Fatal("no spread in x fitted")
	}
}

func TestGrowthPct(t *testing.T) {
	for _, c := range []struct{ start, end, want float64 }{
		{100, 120, 20}, {100, 90, -10}, {0, 0, 0}, {0, 5, math.Inf(1)},
	} {
		if got := GrowthPct(c.start, c.end); !(got == c.want || near(got, c.want)) {
			t.Errorf("GrowthPct(%v, %v) = %v, want %v", c.start, c.end, got, c.want)
		}
	}
}

// synth builds a run: a baseline, load samples every 5 s for 600 s with
// the values f(t) gives, and a final sample.
func synth(f func(t float64) Sample, baseline, final Sample) []Sample {
	baseline.T, baseline.Phase = -1, PhaseBaseline
	out := []Sample{baseline}
	for t := 5.0; t <= 600; t += 5 {
		s := f(t)
		s.T, s.Phase = t, PhaseLoad
		out = append(out, s)
	}
	final.T, final.Phase = 615, PhaseFinal
	return append(out, final)
}

// steady is a healthy kvroute: values wobble around a level under load and
// return to idle after it.
func steady(t float64) Sample {
	w := math.Sin(t / 7) // ±1
	return Sample{RSSMiB: 40 + 2*w, HeapMiB: 10 + 3*w, FDs: 40 + 4*w, Goroutines: 80 + 6*w, InFlight: 6 + 3*w,
		Queued: 0, IndexEntries: math.Min(600, 10*t), CPUPercent: 5}
}

var (
	idle    = Sample{RSSMiB: 15, HeapMiB: 3, FDs: 20, Goroutines: 55, InFlight: 0, Queued: 0, IndexEntries: 0}
	drained = Sample{RSSMiB: 41, HeapMiB: 9, FDs: 22, Goroutines: 58, InFlight: 0, Queued: 0, IndexEntries: 600}
)

func checksByKey(cs []Check) map[string]Check {
	m := map[string]Check{}
	for _, c := range cs {
		m[c.Key] = c
	}
	return m
}

func TestEvaluateFlat(t *testing.T) {
	lim := DefaultLimits()
	lim.IndexBound = 1024
	cs := Evaluate(synth(steady, idle, drained), 120, lim)
	for _, c := range cs {
		if !c.Flat {
			t.Errorf("%s: not flat: %s", c.Label, c.Why)
		}
	}
	rss := checksByKey(cs)["rss_mib"]
	if math.Abs(rss.GrowthPct) > 5 || rss.Samples != 97 || rss.WarmupMax > 42 || rss.Final != 41 {
		t.Errorf("rss check = %+v", rss)
	}
}

func TestEvaluateLeaks(t *testing.T) {
	lim := DefaultLimits()
	lim.IndexBound = 1024
	leaky := func(t float64) Sample {
		s := steady(t)
		s.RSSMiB += t / 20        // +25 MiB over the run: ~+60% after warm-up
		s.Goroutines += t / 10    // one goroutine leaked every 10 s
		s.IndexEntries = 2 * t    // past the bound at the end
		s.Queued = math.NaN()     // an older kvroute: not exported
		s.CPUPercent = math.NaN() // info only anyway
		return s
	}
	final := drained
	final.Goroutines = 118 // the leaked ones stay after the drain
	final.InFlight = 3     // and the gauge never returns to 0
	final.Queued = math.NaN()
	base := idle
	base.Queued = math.NaN()
	m := checksByKey(Evaluate(synth(leaky, base, final), 120, lim))
	for _, k := range []string{"rss_mib", "goroutines", "in_flight", "index_entries"} {
		if m[k].Flat {
			t.Errorf("%s judged flat: %+v", k, m[k])
		}
	}
	if !m["fds"].Flat || !m["queued"].Flat || m["queued"].Why == "" {
		t.Errorf("fds %+v, queued %+v: want flat (queued not exported)", m["fds"], m["queued"])
	}
	if !strings.Contains(m["goroutines"].Why, "idle") || !strings.Contains(m["goroutines"].Why, "warm-up max") {
		t.Errorf("goroutines why = %q: want both the trend and the drain", m["goroutines"].Why)
	}
}

func TestEvaluateTooFewSamples(t *testing.T) {
	s := []Sample{{T: 1, Phase: PhaseLoad, RSSMiB: 10}, {T: 9, Phase: PhaseLoad, RSSMiB: 10}}
	c := checksByKey(Evaluate(s, 5, DefaultLimits()))["rss_mib"]
	if c.Flat || !strings.Contains(c.Why, "samples") {
		t.Errorf("rss with one steady sample: %+v", c)
	}
}

func TestCSVRoundTrip(t *testing.T) {
	in := synth(steady, idle, drained)
	in[3].Fault = "pod-kill@pod1"
	in[4].Goroutines = math.NaN()
	in[5].Sent, in[5].OK, in[5].Lost = 10, 8, 1
	var buf bytes.Buffer
	if err := WriteCSV(&buf, in); err != nil {
		t.Fatal(err)
	}
	if first, _, _ := strings.Cut(buf.String(), "\n"); !strings.HasPrefix(first, "t_s,phase,fault,rss_mib") {
		t.Fatalf("header = %q", first)
	}
	out, err := ReadCSV(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if len(out) != len(in) {
		t.Fatalf("%d rows back, want %d", len(out), len(in))
	}
	eq := func(a, b float64, tol float64) bool {
		return math.IsNaN(a) && math.IsNaN(b) || math.Abs(a-b) <= tol
	}
	for i := range in {
		a, b := in[i], out[i]
		if a.Phase != b.Phase || a.Fault != b.Fault || a.Sent != b.Sent || a.OK != b.OK || a.Lost != b.Lost ||
			!eq(a.T, b.T, 0.005) || !eq(a.RSSMiB, b.RSSMiB, 0.005) || !eq(a.Goroutines, b.Goroutines, 0.5) ||
			!eq(a.IndexEntries, b.IndexEntries, 0.5) || !eq(a.Queued, b.Queued, 0.5) {
			t.Fatalf("row %d: wrote %+v, read %+v", i, a, b)
		}
	}
	if _, err := ReadCSV(strings.NewReader("a,b\n1,2\n")); err == nil {
		t.Fatal("foreign CSV accepted")
	}
}

func TestWriteChartAndTable(t *testing.T) {
	samples := synth(steady, idle, drained)
	lim := DefaultLimits()
	lim.IndexBound = 1024
	cs := Evaluate(samples, 120, lim)
	path := filepath.Join(t.TempDir(), FileChart)
	if err := WriteChart(path, samples, cs, 120, []FaultEvent{{At: 300, Pod: 1, Fault: FaultKill, On: true}}); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil || !bytes.HasPrefix(b, []byte("\x89PNG")) {
		t.Fatalf("chart: %v, %d bytes", err, len(b))
	}
	var tab bytes.Buffer
	WriteTable(&tab, cs)
	if got := strings.Count(tab.String(), "\n"); got != len(cs)+1 || strings.Contains(tab.String(), "NOT FLAT") {
		t.Errorf("table:\n%s", tab.String())
	}
}

func TestSummarize(t *testing.T) {
	recs := []Record{
		{ID: "soak-1", Kind: KindShared, Outcome: OutcomeOK, Stream: true},
		{ID: "soak-2", Kind: KindShared, Outcome: OutcomeStatus, Status: 500},
		{ID: "soak-3", Kind: KindMulti, Outcome: OutcomeAbandoned, Stream: true},
		{ID: "soak-4", Kind: KindMulti, Outcome: OutcomeTruncated, Cut: CutKill, Stream: true},
		{ID: "soak-5", Kind: KindRandom, Outcome: OutcomeTruncated, Stream: true},
		{ID: "soak-6", Kind: KindRandom, Outcome: OutcomeTimeout},
	}
	s := summarize(recs, map[string]int{CutKill: 1})
	if s.Sent != 6 || s.OK != 1 || s.Failed != 1 || s.Statuses[500] != 1 || s.Abandoned != 1 || s.Cut != 1 ||
		s.CutBy[CutKill] != 1 || s.Lost != 2 || s.LostBy[OutcomeTimeout] != 1 || s.StreamSent != 4 {
		t.Fatalf("summary = %+v", s)
	}
	if strings.Join(s.LostIDs, ",") != "soak-5,soak-6" || !near(s.OKShare, 0.2) {
		t.Fatalf("lost ids %v, ok share %v", s.LostIDs, s.OKShare)
	}
	if k := s.ByKind[KindRandom]; k.Sent != 2 || k.Lost != 2 {
		t.Fatalf("random = %+v", k)
	}
}

func TestFaultPeriod(t *testing.T) {
	for d, want := range map[string]string{"1m0s": "3s", "10m0s": "10s", "5m0s": "5s", "2h0m0s": "10s"} {
		dd, _ := time.ParseDuration(d)
		if got := FaultPeriod(dd).String(); got != want {
			t.Errorf("FaultPeriod(%s) = %s, want %s", d, got, want)
		}
	}
}
