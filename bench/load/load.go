// Package load drives a workload at one OpenAI-compatible base URL and
// measures it the way vLLM's `bench serve` does: arrival processes and rising
// rate stages, a streaming SSE client, per-request TTFT, ITL, TPOT and E2E
// latency, throughput and goodput summaries, the engines' own /metrics
// counters and the machine's CPU over the run.
package load

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"
)

// ErrConfig is wrapped by every configuration error.
var ErrConfig = errors.New("load: invalid config")

// Arrival is how a load spaces its requests.
type Arrival uint8

// Arrival processes.
const (
	// ArrivalGamma draws gaps from Gamma(shape b, scale 1/(rate·b)): b = 1
	// (the default) is a Poisson process, b < 1 burstier, b > 1 smoother.
	// Rate +Inf sends everything at once.
	ArrivalGamma Arrival = iota
	// ArrivalConstant sends every 1/rate seconds.
	ArrivalConstant
	// ArrivalClosed keeps Concurrency requests in flight: a worker sends
	// its next request when the previous one ends.
	ArrivalClosed
	// ArrivalTrace sends each session's first request at its At time.
	ArrivalTrace
)

// String returns the arrival's flag spelling.
func (a Arrival) String() string {
	switch a {
	case ArrivalConstant:
		return "constant"
	case ArrivalClosed:
		return "closed"
	case ArrivalTrace:
		return "trace"
	}
	return "poisson"
}

// MarshalText implements encoding.TextMarshaler.
func (a Arrival) MarshalText() ([]byte, error) { return []byte(a.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (a *Arrival) UnmarshalText(b []byte) (err error) { *a, err = ParseArrival(string(b)); return err }

// ParseArrival converts a flag value (poisson, gamma, constant, closed,
// trace) to an Arrival.
func ParseArrival(s string) (Arrival, error) {
	switch strings.ToLower(s) {
	case "poisson", "gamma", "":
		return ArrivalGamma, nil
	case "constant":
		return ArrivalConstant, nil
	case "closed":
		return ArrivalClosed, nil
	case "trace":
		return ArrivalTrace, nil
	}
	return 0, fmt.Errorf("%w: unknown arrival %q (want poisson, gamma, constant, closed or trace)", ErrConfig, s)
}

// Rate is a request rate in requests per second of modelled time; +Inf
// means everything at once. It marshals to JSON as a number or "inf".
type Rate float64

// MarshalJSON implements json.Marshaler.
func (r Rate) MarshalJSON() ([]byte, error) {
	if math.IsInf(float64(r), 1) {
		return []byte(`"inf"`), nil
	}
	return json.Marshal(float64(r))
}

// UnmarshalJSON implements json.Unmarshaler ("inf" or a number).
func (r *Rate) UnmarshalJSON(b []byte) error {
	if string(b) == `"inf"` {
		*r = Rate(math.Inf(1))
		return nil
	}
	var v float64
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	*r = Rate(v)
	return nil
}

// String formats the rate ("inf" or a number).
func (r Rate) String() string {
	if math.IsInf(float64(r), 1) {
		return "inf"
	}
	return strconv.FormatFloat(float64(r), 'g', -1, 64)
}

// ParseRate parses a rate: a positive number or "inf".
func ParseRate(s string) (Rate, error) {
	if strings.EqualFold(s, "inf") {
		return Rate(math.Inf(1)), nil
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil || !(v > 0) {
		return 0, fmt.Errorf("%w: rate %q must be a positive number or inf", ErrConfig, s)
	}
	return Rate(v), nil
}

// Stage is one step of a rising-rate load: Requests requests at Rate. The
// next stage follows at once (requests still running carry over, as they
// would in production); a stage's throughput is measured over its own
// window, its latencies over the requests it sent.
type Stage struct {
	Rate     Rate `json:"rate"`
	Requests int  `json:"requests"`
}

// ParseStages parses "rate:requests,rate:requests,…" (e.g. "4:200,8:200").
func ParseStages(s string) ([]Stage, error) {
	var out []Stage
	for f := range strings.SplitSeq(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		r, n, ok := strings.Cut(f, ":")
		if !ok {
			return nil, fmt.Errorf("%w: stage %q: want rate:requests", ErrConfig, f)
		}
		rate, err := ParseRate(r)
		if err != nil {
			return nil, err
		}
		reqs, err := strconv.Atoi(n)
		if err != nil || reqs < 1 {
			return nil, fmt.Errorf("%w: stage %q: requests must be a positive integer", ErrConfig, f)
		}
		out = append(out, Stage{Rate: rate, Requests: reqs})
	}
	return out, nil
}

// Load describes how requests are sent. Rates are in modelled time: with a
// time scale s, requests go out s times faster in wall time.
type Load struct {
	Arrival Arrival `json:"arrival"`
	// Rate is the mean request rate of an open loop (ignored with Stages).
	Rate Rate `json:"rate,omitempty"`
	// Burstiness is the Gamma shape b; 0 means 1 (Poisson).
	Burstiness float64 `json:"burstiness,omitempty"`
	// Concurrency is the number of closed-loop workers.
	Concurrency int `json:"concurrency,omitempty"`
	// MaxConcurrency caps requests in flight of an open loop: a request
	// due while the cap is reached waits, unmeasured, for a slot (vLLM's
	// --max-concurrency). 0: no cap.
	MaxConcurrency int `json:"max_concurrency,omitempty"`
	// Stages, when set, make an open loop of rising rates.
	Stages []Stage `json:"stages,omitempty"`
	// Requests is how many requests to send (0: every request of the
	// workload once). Single-turn workloads are reused cyclically when it
	// exceeds their size.
	Requests int `json:"requests,omitempty"`
	// Duration stops sending new requests after this much modelled time
	// (0: no limit); with Requests 0 a single-turn workload is then cycled
	// until it expires.
	Duration time.Duration `json:"duration,omitempty"`
}

// Validate reports the first problem of l.
func (l Load) Validate() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrConfig}, a...)...)
	}
	switch {
	case l.Arrival == ArrivalClosed && l.Concurrency < 1:
		return bad("a closed loop needs concurrency ≥ 1")
	case l.Arrival == ArrivalClosed && len(l.Stages) > 0:
		return bad("stages need an open loop")
	case (l.Arrival == ArrivalGamma || l.Arrival == ArrivalConstant) && len(l.Stages) == 0 && !(l.Rate > 0):
		return bad("an open loop needs a rate > 0 (or inf) or stages")
	case l.Burstiness < 0:
		return bad("burstiness %v must be positive", l.Burstiness)
	case l.Requests < 0 || l.MaxConcurrency < 0 || l.Duration < 0:
		return bad("requests, max concurrency and duration must not be negative")
	}
	for _, s := range l.Stages {
		if !(s.Rate > 0) || s.Requests < 1 {
			return bad("stage %v:%d needs a positive rate and requests", s.Rate, s.Requests)
		}
	}
	return nil
}

// gaps draws inter-arrival gaps in modelled seconds.
type gaps struct {
	r     *rand.Rand
	shape float64
	kind  Arrival
}

func newGaps(seed uint64, l Load) *gaps {
	shape := l.Burstiness
	if shape == 0 {
		shape = 1
	}
	return &gaps{r: rand.New(rand.NewPCG(seed, 0x61727269)), shape: shape, kind: l.Arrival}
}

// next returns the gap before the next request at rate (0 for +Inf).
func (g *gaps) next(rate Rate) float64 {
	if math.IsInf(float64(rate), 1) {
		return 0
	}
	if g.kind == ArrivalConstant {
		return 1 / float64(rate)
	}
	if g.shape == 1 {
		return g.r.ExpFloat64() / float64(rate)
	}
	return gammaVariate(g.r, g.shape) / (float64(rate) * g.shape)
}

// gammaVariate draws from Gamma(shape, 1) (Marsaglia and Tsang 2000; for
// shape < 1 boosted by U^(1/shape)).
func gammaVariate(r *rand.Rand, shape float64) float64 {
	if shape < 1 {
		return gammaVariate(r, shape+1) * math.Pow(r.Float64(), 1/shape)
	}
	d := shape - 1.0/3
	c := 1 / math.Sqrt(9*d)
	for {
		x := r.NormFloat64()
		v := 1 + c*x
		if v <= 0 {
			continue
		}
		v = v * v * v
		u := r.Float64()
		if u < 1-0.0331*x*x*x*x || math.Log(u) < 0.5*x*x+d*(1-v+math.Log(v)) {
			return d * v
		}
	}
}
