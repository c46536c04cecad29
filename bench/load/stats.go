package load

import (
	"math"
	"slices"
)

// Percentile returns the p-th percentile (0 ≤ p ≤ 100) of sorted (ascending)
// by linear interpolation between closest ranks, numpy's default method and
// the one vLLM's `bench serve` reports. It returns NaN for no values.
func Percentile(sorted []float64, p float64) float64 {
	n := len(sorted)
	if n == 0 {
		return math.NaN()
	}
	if n == 1 {
		return sorted[0]
	}
	rank := p / 100 * float64(n-1)
	lo := int(math.Floor(rank))
	if lo >= n-1 {
		return sorted[n-1]
	}
	if lo < 0 {
		return sorted[0]
	}
	frac := rank - float64(lo)
	return sorted[lo] + frac*(sorted[lo+1]-sorted[lo])
}

// Dist summarises a distribution of durations, in milliseconds.
type Dist struct {
	N    int     `json:"n"`
	Mean float64 `json:"mean_ms"`
	P50  float64 `json:"p50_ms"`
	P90  float64 `json:"p90_ms"`
	P99  float64 `json:"p99_ms"`
	Max  float64 `json:"max_ms"`
}

// NewDist summarises xs, given in seconds; it sorts xs in place. The zero
// Dist (N = 0) stands for no values.
func NewDist(xs []float64) Dist {
	if len(xs) == 0 {
		return Dist{}
	}
	slices.Sort(xs)
	var sum float64
	for _, x := range xs {
		sum += x
	}
	const ms = 1e3
	return Dist{
		N:    len(xs),
		Mean: sum / float64(len(xs)) * ms,
		P50:  Percentile(xs, 50) * ms,
		P90:  Percentile(xs, 90) * ms,
		P99:  Percentile(xs, 99) * ms,
		Max:  xs[len(xs)-1] * ms,
	}
}

// SLO is a set of per-request service-level objectives for goodput, in
// milliseconds; zero fields are not checked (vLLM `--goodput ttft:… tpot:…
// e2el:…`).
type SLO struct {
	TTFT float64 `json:"ttft_ms,omitempty"`
	TPOT float64 `json:"tpot_ms,omitempty"`
	E2EL float64 `json:"e2el_ms,omitempty"`
}

// IsZero reports whether no objective is set.
func (s SLO) IsZero() bool { return s.TTFT == 0 && s.TPOT == 0 && s.E2EL == 0 }

// Met reports whether a successful request meets every objective set.
func (s SLO) Met(r *RequestResult) bool {
	const ms = 1e3
	return r.Err == "" &&
		(s.TTFT == 0 || r.TTFT*ms <= s.TTFT) &&
		(s.TPOT == 0 || r.TPOT*ms <= s.TPOT) &&
		(s.E2EL == 0 || r.E2EL*ms <= s.E2EL)
}

// Summary is the vLLM `bench serve` summary of a set of requests. Times and
// rates are in the run's modelled time (wall time × the time scale).
type Summary struct {
	// Requests counts requests sent; Completed those that ended with the
	// stream's [DONE]; Failed the rest.
	Requests  int `json:"requests"`
	Completed int `json:"completed"`
	Failed    int `json:"failed"`
	// Errors counts failures by kind (see RequestResult.Err);
	// ErrorSamples holds the first detail seen of each kind.
	Errors       map[string]int    `json:"errors,omitempty"`
	ErrorSamples map[string]string `json:"error_samples,omitempty"`
	// Duration is from the first send to the last completion, in seconds.
	Duration float64 `json:"duration_s"`
	// RequestThroughput is completed requests per second; OutputThroughput
	// and InputThroughput are output and prompt tokens of completed
	// requests per second.
	RequestThroughput float64 `json:"request_throughput"`
	OutputThroughput  float64 `json:"output_throughput"`
	InputThroughput   float64 `json:"input_throughput"`
	// Goodput is requests per second that met every objective of SLO.
	Goodput float64 `json:"goodput,omitempty"`
	SLO     SLO     `json:"slo,omitzero"`
	// Token totals of completed requests, from the streams' usage chunks.
	PromptTokens int `json:"prompt_tokens"`
	OutputTokens int `json:"output_tokens"`
	CachedTokens int `json:"cached_tokens"`
	// CachedRate is cached ÷ prompt tokens as the responses reported them
	// (prompt_tokens_details.cached_tokens); NaN-free: 0 when not reported.
	CachedRate float64 `json:"cached_rate"`
	// Latency distributions of completed requests.
	TTFT Dist `json:"ttft"`
	TPOT Dist `json:"tpot"`
	ITL  Dist `json:"itl"`
	E2EL Dist `json:"e2el"`
}

// Summarize computes the summary of rs, whose times are relative to a common
// start (seconds). duration is the span to divide by; ≤ 0 means from the
// first send to the last completion.
func Summarize(rs []RequestResult, slo SLO, duration float64) Summary {
	s := Summary{Requests: len(rs), SLO: slo}
	var ttft, tpot, itl, e2el []float64
	first, last := math.Inf(1), math.Inf(-1)
	good := 0
	for i := range rs {
		r := &rs[i]
		first = min(first, r.Start)
		last = max(last, r.Start+r.E2EL)
		if r.Err != "" {
			s.Failed++
			if s.Errors == nil {
				s.Errors = make(map[string]int)
			}
			s.Errors[r.Err]++
			if _, ok := s.ErrorSamples[r.Err]; !ok && r.ErrDetail != "" {
				if s.ErrorSamples == nil {
					s.ErrorSamples = make(map[string]string)
				}
				s.ErrorSamples[r.Err] = r.ErrDetail
			}
			continue
		}
		s.Completed++
		s.PromptTokens += r.PromptTokens
		s.OutputTokens += r.OutputTokens
		s.CachedTokens += r.CachedTokens
		ttft = append(ttft, r.TTFT)
		e2el = append(e2el, r.E2EL)
		if r.OutputTokens > 1 {
			tpot = append(tpot, r.TPOT)
		}
		for _, g := range r.ITL {
			itl = append(itl, float64(g))
		}
		if !slo.IsZero() && slo.Met(r) {
			good++
		}
	}
	if duration <= 0 && len(rs) > 0 {
		duration = last - first
	}
	s.Duration = duration
	if duration > 0 {
		s.RequestThroughput = float64(s.Completed) / duration
		s.OutputThroughput = float64(s.OutputTokens) / duration
		s.InputThroughput = float64(s.PromptTokens) / duration
		if !slo.IsZero() {
			s.Goodput = float64(good) / duration
		}
	}
	if s.PromptTokens > 0 {
		s.CachedRate = float64(s.CachedTokens) / float64(s.PromptTokens)
	}
	s.TTFT, s.TPOT, s.ITL, s.E2EL = NewDist(ttft), NewDist(tpot), NewDist(itl), NewDist(e2el)
	return s
}
