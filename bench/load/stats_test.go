package load

import (
	"math"
	"reflect"
	"sort"
	"testing"
)

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Max(1, math.Abs(b)) }

func TestPercentile(t *testing.T) {
	for _, tc := range []struct {
		name   string
		sorted []float64
		p      float64
		want   float64
	}{
		// numpy.percentile(…, method="linear") by hand: rank = p/100·(n−1).
		{name: "median of four", sorted: []float64{1, 2, 3, 4}, p: 50, want: 2.5},
		{name: "p90 of four", sorted: []float64{1, 2, 3, 4}, p: 90, want: 3.7},
		{name: "p99 of four", sorted: []float64{1, 2, 3, 4}, p: 99, want: 3.97},
		{name: "p0", sorted: []float64{1, 2, 3, 4}, p: 0, want: 1},
		{name: "p100", sorted: []float64{1, 2, 3, 4}, p: 100, want: 4},
		{name: "single", sorted: []float64{7}, p: 90, want: 7},
		{name: "p25 of two", sorted: []float64{10, 30}, p: 25, want: 15},
		{name: "p90 of eleven", sorted: []float64{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 100}, p: 90, want: 9},
		{name: "p95 of eleven", sorted: []float64{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 100}, p: 95, want: 54.5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Percentile(tc.sorted, tc.p); !near(got, tc.want) {
				t.Fatalf("Percentile(%v, %v) = %v, want %v", tc.sorted, tc.p, got, tc.want)
			}
		})
	}
	if !math.IsNaN(Percentile(nil, 50)) {
		t.Fatal("no values must give NaN")
	}
}

func TestNewDist(t *testing.T) {
	got := NewDist([]float64{0.4, 0.1, 0.3, 0.2})
	want := Dist{N: 4, Mean: 250, P50: 250, P90: 370, P99: 397, Max: 400}
	for _, f := range []struct {
		name      string
		got, want float64
	}{
		{"mean", got.Mean, want.Mean}, {"p50", got.P50, want.P50}, {"p90", got.P90, want.P90},
		{"p99", got.P99, want.P99}, {"max", got.Max, want.Max},
	} {
		if !near(f.got, f.want) {
			t.Errorf("%s = %v ms, want %v", f.name, f.got, f.want)
		}
	}
	if got.N != 4 || NewDist(nil) != (Dist{}) {
		t.Fatal("counts wrong")
	}
}

func TestSummarizeAndGoodput(t *testing.T) {
	// Four requests over 10 s: three succeed, one fails; SLO TTFT ≤ 200 ms
	// and TPOT ≤ 20 ms.
	rs := []RequestResult{
		{Start: 0, TTFT: 0.1, E2EL: 1.1, OutputTokens: 51, PromptTokens: 100, CachedTokens: 50, ITL: []float32{0.02, 0.02}},
		{Start: 1, TTFT: 0.3, E2EL: 1.3, OutputTokens: 51, PromptTokens: 100, CachedTokens: 0, ITL: []float32{0.02}},
		{Start: 2, TTFT: 0.15, E2EL: 2.15, OutputTokens: 51, PromptTokens: 200, CachedTokens: 150},
		{Start: 9, E2EL: 1, Err: "http_503", Status: 503, ErrDetail: "busy"},
	}
	for i := range rs {
		if rs[i].Err == "" {
			rs[i].TPOT = (rs[i].E2EL - rs[i].TTFT) / float64(rs[i].OutputTokens-1)
		}
	}
	slo := SLO{TTFT: 200, TPOT: 20}
	s := Summarize(rs, slo, 0)
	// TPOTs: 20 ms, 20 ms, 40 ms; so only request 0 meets both objectives.
	checks := []struct {
		name      string
		got, want float64
	}{
		{"duration", s.Duration, 10},
		{"request throughput", s.RequestThroughput, 0.3},
		{"output throughput", s.OutputThroughput, 15.3},
		{"input throughput", s.InputThroughput, 40},
		{"goodput", s.Goodput, 0.1},
		{"cached rate", s.CachedRate, 0.5},
		{"ttft p50", s.TTFT.P50, 150},
		{"tpot max", s.TPOT.Max, 40},
		{"itl mean", s.ITL.Mean, 20},
	}
	for _, c := range checks {
		if math.Abs(c.got-c.want) > 1e-6 {
			t.Errorf("%s = %v, want %v", c.name, c.got, c.want)
		}
	}
	if s.Completed != 3 || s.Failed != 1 || !reflect.DeepEqual(s.Errors, map[string]int{"http_503": 1}) ||
		!reflect.DeepEqual(s.ErrorSamples, map[string]string{"http_503": "busy"}) {
		t.Fatalf("counts %d/%d %v, samples %v", s.Completed, s.Failed, s.Errors, s.ErrorSamples)
	}
	if s.ITL.N != 3 {
		t.Fatalf("ITL n = %d, want every gap", s.ITL.N)
	}

	t.Run("each objective alone", func(t *testing.T) {
		for _, tc := range []struct {
			name string
			slo  SLO
			good int
		}{
			{name: "ttft", slo: SLO{TTFT: 150}, good: 2},
			{name: "tpot", slo: SLO{TPOT: 25}, good: 2},
			{name: "e2el", slo: SLO{E2EL: 1200}, good: 1},
			{name: "none", slo: SLO{}, good: 0},
		} {
			t.Run(tc.name, func(t *testing.T) {
				s := Summarize(rs, tc.slo, 10)
				if want := float64(tc.good) / 10; !near(s.Goodput, want) {
					t.Fatalf("goodput %v, want %v", s.Goodput, want)
				}
			})
		}
	})
}

func TestHistogramQuantile(t *testing.T) {
	// 10 observations: 2 ≤ 0.1, 6 in (0.1, 0.25], 2 in (0.25, 0.5].
	h := Histogram{Bounds: []float64{0.1, 0.25, 0.5}, Cumulative: []float64{2, 8, 10}, Count: 10}
	for _, tc := range []struct {
		name         string
		q            float64
		want, lo, hi float64
	}{
		{name: "p10", q: 0.1, want: 0.05, lo: 0, hi: 0.1},
		{name: "p50", q: 0.5, want: 0.175, lo: 0.1, hi: 0.25},
		{name: "p90", q: 0.9, want: 0.375, lo: 0.25, hi: 0.5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v, lo, hi := h.Quantile(tc.q)
			if !near(v, tc.want) || lo != tc.lo || hi != tc.hi {
				t.Fatalf("Quantile(%v) = %v in (%v, %v], want %v in (%v, %v]", tc.q, v, lo, hi, tc.want, tc.lo, tc.hi)
			}
		})
	}
	d := h.Sub(Histogram{Bounds: h.Bounds, Cumulative: []float64{1, 1, 1}, Count: 1})
	if d.Count != 9 || d.Cumulative[1] != 7 {
		t.Fatalf("Sub = %+v", d)
	}
}

func TestGaps(t *testing.T) {
	for _, tc := range []struct {
		name  string
		load  Load
		rate  Rate
		wantV float64 // variance of gaps ÷ mean² (1/b for Gamma, 0 constant)
	}{
		{name: "poisson", load: Load{}, rate: 4, wantV: 1},
		{name: "bursty", load: Load{Burstiness: 0.25}, rate: 4, wantV: 4},
		{name: "smooth", load: Load{Burstiness: 4}, rate: 4, wantV: 0.25},
		{name: "constant", load: Load{Arrival: ArrivalConstant}, rate: 4, wantV: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := newGaps(42, tc.load)
			const n = 20000
			var sum, sq float64
			for range n {
				x := g.next(tc.rate)
				sum += x
				sq += x * x
			}
			mean := sum / n
			cv2 := (sq/n - mean*mean) / (mean * mean)
			if math.Abs(mean-0.25) > 0.25*0.05 {
				t.Fatalf("mean gap %v, want 0.25", mean)
			}
			if math.Abs(cv2-tc.wantV) > 0.1*math.Max(tc.wantV, 0.1) {
				t.Fatalf("variance/mean² = %v, want %v", cv2, tc.wantV)
			}
		})
	}
	if g := newGaps(1, Load{}); g.next(Rate(math.Inf(1))) != 0 {
		t.Fatal("rate inf must send at once")
	}
}

func TestWindowRates(t *testing.T) {
	// Request A: sent at 0, first token at 1, then gaps of 1 s: tokens at
	// 1, 2, 3, 4 (4 tokens), done at 4. Request B: sent at 2, tokens at
	// 2.5 and 5.5 (2 tokens), done at 5.5. A failure counts nothing.
	rs := []RequestResult{
		{Start: 0, TTFT: 1, E2EL: 4, OutputTokens: 4, PromptTokens: 100, ITL: []float32{1, 1, 1}},
		{Start: 2, TTFT: 0.5, E2EL: 3.5, OutputTokens: 2, PromptTokens: 50, ITL: []float32{3}},
		{Start: 1, E2EL: 1, Err: ErrKindTimeout},
	}
	for _, tc := range []struct {
		name              string
		from, to          float64
		reqs, toks, input float64
	}{
		{name: "all", from: 0, to: 10, reqs: 0.2, toks: 0.6, input: 15},
		{name: "middle", from: 2, to: 4, reqs: 0, toks: 1.5, input: 25},
		{name: "end", from: 4, to: 6, reqs: 1, toks: 1, input: 0},
		{name: "empty", from: 3, to: 3, reqs: 0, toks: 0, input: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reqs, toks, in := windowRates(rs, tc.from, tc.to)
			if !near(reqs, tc.reqs) || !near(toks, tc.toks) || !near(in, tc.input) {
				t.Fatalf("windowRates = %v req/s, %v tok/s, %v in/s; want %v, %v, %v", reqs, toks, in, tc.reqs, tc.toks, tc.input)
			}
		})
	}
}

// The engine-side view of a run: tests compare the client's TTFT with the
// engines' histogram.

// Sub returns h − before, bucket by bucket (same bounds assumed).
func (h Histogram) Sub(before Histogram) Histogram {
	out := Histogram{Bounds: h.Bounds, Cumulative: make([]float64, len(h.Cumulative)),
		Count: h.Count - before.Count, Sum: h.Sum - before.Sum}
	for i := range h.Cumulative {
		out.Cumulative[i] = h.Cumulative[i]
		if i < len(before.Cumulative) {
			out.Cumulative[i] -= before.Cumulative[i]
		}
	}
	return out
}

// Quantile estimates the q-quantile (0 ≤ q ≤ 1) as Prometheus's
// histogram_quantile does: linear interpolation inside the bucket that
// holds the rank, the lowest bucket starting at 0. It also returns that
// bucket's bounds. NaN when empty or the rank falls in +Inf.
func (h Histogram) Quantile(q float64) (v, lo, hi float64) {
	if h.Count == 0 || len(h.Bounds) == 0 {
		return math.NaN(), 0, 0
	}
	rank := q * h.Count
	i := sort.Search(len(h.Cumulative), func(i int) bool { return h.Cumulative[i] >= rank })
	if i == len(h.Bounds) {
		return math.NaN(), h.Bounds[len(h.Bounds)-1], math.Inf(1)
	}
	hi = h.Bounds[i]
	var below float64
	if i > 0 {
		lo, below = h.Bounds[i-1], h.Cumulative[i-1]
	}
	in := h.Cumulative[i] - below
	if in == 0 {
		return hi, lo, hi
	}
	return lo + (hi-lo)*(rank-below)/in, lo, hi
}
