package discovery

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Costs are an endpoint's serving costs as kvroute has measured them: what
// a routing policy needs to turn a load into a wait, learned per endpoint so
// that no engine's speed is assumed. A Costs value is an immutable snapshot
// (Endpoint.Costs); a zero field means "not measured yet".
//
// Sources. The router's own requests, through their leases: every streamed
// response's time to first byte, against the prompt tokens left to compute
// ahead of and including it and the requests in flight when it was sent,
// fits TTFT ≈ fixed + tokens / prefill rate + in-flight × per-request cost
// (a least-squares fit with forgetting, regularised toward the prior
// prefill rate, robust to outliers); the tokens are split into the
// request's own, which the engine computes after everything ahead, and
// those of the requests still before their first byte, some of which the
// engine has already computed, so each has its own rate; the time from first byte to the end of
// a stream gives the decode time of a request. And the engine's /metrics,
// when scraped: the mean inter-token latency over each scrape interval
// (vLLM's vllm:inter_token_latency_seconds, before V1
// vllm:time_per_output_token_seconds; SGLang's
// sglang:time_per_output_token_seconds) gives the decode step, and the
// number of running requests while others wait with KV to spare
// (vllm:num_requests_running against vllm:num_requests_waiting and
// vllm:kv_cache_usage_perc) gives the batch limit, the engine's
// max_num_seqs.
type Costs struct {
	// PrefillTokensPerSec is the rate at which the endpoint computes
	// uncached prompt tokens, queue included: the slope of its TTFT in the
	// tokens to compute. The prior (CalibrationConfig) until measured.
	PrefillTokensPerSec float64 `json:"prefill_tokens_per_sec"`
	// PendingTokensPerSec is the rate at which the router's pending
	// prefill ahead of a request drains, as that request's TTFT shows it:
	// faster than the prefill rate, since part of what is pending is
	// already computed when the request arrives.
	PendingTokensPerSec float64 `json:"pending_tokens_per_sec"`
	// LoadTokensPerSec is the rate at which the endpoint loads cached
	// tokens held on a slower tier than the GPU (CPU memory, storage)
	// instead of computing them: the slope of its TTFT in the tokens the
	// policy expected it to load. LoadSpeedup × PrefillTokensPerSec until
	// warmupSamples requests loaded some.
	LoadTokensPerSec float64 `json:"load_tokens_per_sec"`
	// FixedSec is the part of a TTFT that no load explains: the network,
	// request parsing, tokenisation, the first engine step.
	FixedSec float64 `json:"fixed_sec"`
	// InFlightSec is what one more request in flight adds to a TTFT
	// (decode work sharing the steps that compute the prompt).
	InFlightSec float64 `json:"ttft_per_in_flight_sec"`
	// DecodeStepSec is the engine's mean inter-token latency (0: unknown).
	DecodeStepSec float64 `json:"decode_step_sec"`
	// DecodeSec is the mean time from a stream's first byte to its end: how
	// long a request holds a place in the running batch (0: unknown).
	DecodeSec float64 `json:"decode_sec"`
	// PrefillTokens is the mean number of prompt tokens a request left to
	// compute, as the policy estimated them (0: unknown).
	PrefillTokens float64 `json:"prefill_tokens_per_request"`
	// BatchLimit is the most requests the engine was seen running while
	// others waited (0: never seen saturated, or seen running more since).
	BatchLimit int `json:"batch_limit"`
	// PeakRunning is the most requests a scrape showed the engine running
	// since it (re)started: no batch limit is below it.
	PeakRunning int `json:"peak_running"`
	// Queued: a scrape showed requests waiting with a full KV cache (the
	// engine queues on memory, not at a batch limit).
	Queued bool `json:"queued_on_kv,omitempty"`
	// FromFleet names the fields above that were not measured on this
	// endpoint yet and are the median of the other endpoints of its fleet
	// instead (pods behind one Service usually run one configuration):
	// "batch_limit", "decode_step_sec", "decode_sec".
	FromFleet []string `json:"from_fleet,omitempty"`
	// Sample counts: TTFTs fitted, decode times, scrape intervals with
	// tokens, and scrapes that showed a waiting queue.
	TTFTSamples   int `json:"ttft_samples"`
	DecodeSamples int `json:"decode_samples"`
	StepSamples   int `json:"decode_step_samples"`
	LimitSamples  int `json:"batch_limit_samples"`
}

// CalibrationConfig configures the learning of endpoints' Costs.
type CalibrationConfig struct {
	// Disabled turns learning off: Endpoint.Costs stays nil.
	Disabled bool
	// PrefillTokensPerSec is the prior prefill rate (the fit starts from
	// it and is pulled toward it while samples are few). Default 20,000.
	PrefillTokensPerSec float64
	// Window is the number of samples after which an old one counts for
	// 1/e as much as a new one. Default 500: a few minutes of traffic on
	// one endpoint, short enough to follow an engine's change of speed.
	Window int
}

// Defaults of CalibrationConfig.
const (
	DefaultPriorPrefillTokensPerSec = 20000
	DefaultCalibrationWindow        = 500
)

// LoadSpeedup is the prior of how much faster an engine loads a cached
// token from its CPU tier than it computes one (vLLM's OffloadingConnector,
// vllm.v1.kv_offload, loads a block the GPU evicted back instead of
// recomputing it): by arithmetic, a token's KV (128 KiB for Llama-3.1-8B
// in bf16) crosses PCIe at ≈ 25 GB/s, ≈ 190,000 tokens a second, against
// ≈ 20,000 tokens a second of prefill. Each endpoint's own TTFTs correct
// it (Costs.LoadTokensPerSec).
const LoadSpeedup = 10

func (c CalibrationConfig) withDefaults() CalibrationConfig {
	c.PrefillTokensPerSec = orDefault(c.PrefillTokensPerSec, DefaultPriorPrefillTokensPerSec)
	c.Window = orDefault(c.Window, DefaultCalibrationWindow)
	return c
}

// Bounds of what learning may conclude, so that a burst of nonsense (a
// paused process, a clock jump) cannot make an endpoint look infinitely
// fast or slow: the prefill rate stays within a factor of rateBound of the
// prior, the fixed latency below maxFixedSec.
const (
	rateBound   = 100.0
	maxFixedSec = 10.0
	// Outliers: a TTFT further than outlierScale × the running mean
	// absolute residual from the fit is clipped to that distance, once
	// warmupSamples samples have set the scale.
	outlierScale  = 3.0
	warmupSamples = 10
	// Means of decode times, prefill tokens and decode steps move by this
	// share of each new sample.
	meanRate = 0.05
	// limitWindow is how many saturated scrapes the batch limit is the
	// maximum of. Routing takes the limit from the first such scrape;
	// the fit leaves samples out past it only once minLimitSamples
	// scrapes confirmed it (see limit).
	limitWindow     = 32
	minLimitSamples = 3
	// kvBoundUsage: a scrape with requests waiting at this KV usage or
	// more shows a full cache, not a batch limit (vLLM admits a request
	// only when its blocks fit, and keeps a few percent free).
	kvBoundUsage = 0.9
)

// Feature scales of the fit, so its matrix is well conditioned: tokens in
// thousands, requests in tens.
const (
	tokenUnit    = 1000.0
	inFlightUnit = 10.0
)

// calibrator learns one endpoint's Costs. Its methods are safe for
// concurrent use; each publishes a new snapshot.
type calibrator struct {
	mu    sync.Mutex
	cfg   CalibrationConfig
	out   *atomic.Pointer[Costs] // where snapshots are published
	fleet *fleetCosts            // the fleet's measurements; nil: none
	fit   regression
	// Running means and their sample counts (streams observed, scrape
	// intervals with tokens); a stream gives both means of its row.
	decodeSec, prefillTokens, stepSec float64
	streamN, stepN                    int
	// loadN counts the fitted samples that loaded tokens from a slower
	// tier.
	loadN int
	// The running counts of the last saturated scrapes, a ring.
	limits [limitWindow]int
	limitN int
	// peak is the most requests any scrape showed running since the
	// engine (re)started: no batch limit is below it.
	peak int64
	// kvQueued: a scrape showed requests waiting with the KV cache full.
	kvQueued bool
	// The inter-token latency histogram at the last scrape.
	lastITLSum, lastITLCount float64
	haveITL                  bool
}

func newCalibrator(cfg CalibrationConfig, out *atomic.Pointer[Costs], fleet *fleetCosts) *calibrator {
	cfg = cfg.withDefaults()
	c := &calibrator{cfg: cfg, out: out, fleet: fleet}
	lambda := 1 - 1/float64(cfg.Window)
	// Prior: no fixed latency, the prior prefill rate for the request's
	// own tokens and for those ahead of it, no in-flight cost, each worth
	// about one sample of typical magnitude (2k tokens, a few requests in
	// flight): a handful of samples outweighs it.
	prior := tokenUnit / cfg.PrefillTokensPerSec
	c.fit.init([features]float64{0, prior, prior, 0, prior / LoadSpeedup}, [features]float64{1, 4, 4, 1, 4}, lambda)
	return c
}

// observe adds one streamed response: its time to first byte ttfb and
// from there to its end (decode), its own prompt tokens to compute (own)
// and to load from a slower tier (loaded), the router's pending prefill
// tokens ahead of it when it was sent (ahead) and the requests in flight
// before it (inFlight).
func (c *calibrator) observe(ttfb, decode time.Duration, own, loaded, ahead, inFlight int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.streamN++
	c.decodeSec = mean(c.decodeSec, decode.Seconds(), c.streamN)
	c.prefillTokens = mean(c.prefillTokens, float64(own), c.streamN)
	// Past the batch limit a request also waits for a place in the batch,
	// which the fit does not model: such samples would bias the rate.
	if l := c.limit(minLimitSamples); l == 0 || inFlight < int64(l) {
		c.fit.add([features]float64{1, float64(own) / tokenUnit, float64(ahead) / tokenUnit, float64(inFlight) / inFlightUnit, float64(loaded) / tokenUnit}, ttfb.Seconds())
		if loaded > 0 {
			c.loadN++
		}
	}
	c.publish()
}

// observeEngine adds one scrape: the cumulative inter-token latency
// histogram's sum and count (itlOK false when the engine exports none),
// the running and waiting requests, the KV cache's usage and its capacity
// in tokens (0: unknown).
func (c *calibrator) observeEngine(itlSum, itlCount float64, itlOK bool, running, waiting int64, kvUsage float64, kvTokens int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if itlOK {
		dSum, dCount := itlSum-c.lastITLSum, itlCount-c.lastITLCount
		// A reset (engine restart) shows as counts going down: start over
		// from this scrape.
		if c.haveITL && dCount >= 1 && dSum >= 0 {
			c.stepN++
			c.stepSec = mean(c.stepSec, dSum/dCount, c.stepN)
		}
		c.lastITLSum, c.lastITLCount, c.haveITL = itlSum, itlCount, true
	}
	// Requests wait either for a place in the batch (max_num_seqs) or for
	// KV blocks. Only the first is a limit on requests: how many fit in a
	// full cache depends on their lengths, and a request whose prefix is
	// cached needs few new blocks. The cache is full for the next request
	// when it is nearly full or has room for less than two of the prompts
	// the endpoint computes on average.
	kvFull := kvUsage >= kvBoundUsage ||
		kvTokens > 0 && (1-kvUsage)*float64(kvTokens) < 2*c.prefillTokens
	c.peak = max(c.peak, running)
	if waiting > 0 && running > 0 && !kvFull {
		c.limits[c.limitN%limitWindow] = int(min(running, math.MaxInt32))
		c.limitN++
	}
	c.kvQueued = c.kvQueued || waiting > 0 && kvFull
	c.publish()
}

// restart forgets what depends on the engine process: the histogram
// baseline and the batch limit (a restarted engine may be configured
// differently). The fitted speeds stay: the hardware did not change.
func (c *calibrator) restart() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.haveITL, c.limitN, c.peak, c.kvQueued = false, 0, 0, false
	c.publish()
}

// limit returns the batch limit: the largest running count of the last
// limitWindow saturated scrapes; 0 until n scrapes showed one, and 0 while
// it is below the most requests the engine was seen running (peak).
//
// Requests also wait with KV to spare when a burst of prompts exceeds the
// engine's token budget per step (vLLM's max_num_batched_tokens): such a
// scrape shows a queue behind fewer requests than the batch holds. On
// bench/sim under multi-turn load they gave "limits" of 3–5 where the
// engine had run more, and the wait model then priced a warm home past
// its "limit" and spilled its conversations. A full batch shows the same
// count every time it fills, never exceeded, so the peak tells the two
// apart: a real limit is the most the engine ever runs.
//
// Routing (Costs.BatchLimit) takes the limit from the first saturated
// scrape: on an engine whose batch is small, the requests a router keeps
// sending to a warm endpoint while it waits for more scrapes each queue for
// a whole decode time (llm-d's simulator, 9 sequences: ten requests
// 1.7–2.1 s in the first 3 s of the hot prefix, issue #24). The fit leaves
// out samples past the limit only once three scrapes showed it: a spurious
// limit there loses the samples the fit needs.
func (c *calibrator) limit(n int) int {
	if c.limitN < n {
		return 0
	}
	l := 0
	for i := range min(c.limitN, limitWindow) {
		l = max(l, c.limits[i])
	}
	if int64(l) < c.peak {
		return 0
	}
	return l
}

// publish stores a new snapshot of the learned costs; c.mu is held, so
// snapshots are published in order.
func (c *calibrator) publish() {
	th := c.fit.theta
	lo, hi := tokenUnit/(c.cfg.PrefillTokensPerSec*rateBound), tokenUnit*rateBound/c.cfg.PrefillTokensPerSec
	s := &Costs{
		PrefillTokensPerSec: tokenUnit / min(max(th[1], lo), hi),
		PendingTokensPerSec: tokenUnit / min(max(th[2], lo), hi),
		FixedSec:            min(max(th[0], 0), maxFixedSec),
		InFlightSec:         max(th[3], 0) / inFlightUnit,
		DecodeStepSec:       c.stepSec,
		DecodeSec:           c.decodeSec,
		PrefillTokens:       c.prefillTokens,
		BatchLimit:          c.limit(1),
		PeakRunning:         int(min(c.peak, math.MaxInt32)),
		Queued:              c.kvQueued,
		TTFTSamples:         c.fit.n,
		DecodeSamples:       c.streamN,
		StepSamples:         c.stepN,
		LimitSamples:        min(c.limitN, limitWindow),
	}
	s.LoadTokensPerSec = s.PrefillTokensPerSec * LoadSpeedup
	if c.loadN >= warmupSamples {
		s.LoadTokensPerSec = tokenUnit / min(max(th[4], lo/LoadSpeedup), hi/LoadSpeedup)
	}
	if c.fleet != nil {
		c.fleet.update(c, s)
		return
	}
	c.out.Store(s)
}

// fleetCosts holds what every endpoint of a fleet has measured, so that an
// endpoint not measured yet can use its peers' values: a batch limit is
// learned only once an engine saturates, and until then the others' limit
// is a better guess than none. Safe for concurrent use; a calibrator's
// mutex may be held when calling it, never the other way round. Every
// snapshot of a fleet's endpoints is published under its mutex, so that
// one endpoint's publishing its peers' cannot race with their own.
type fleetCosts struct {
	mu       sync.Mutex
	measured map[*calibrator]Costs
}

func newFleetCosts() *fleetCosts { return &fleetCosts{measured: map[*calibrator]Costs{}} }

// update records s as c's own measurements, fills the fields c has not
// measured with the median of the others' and publishes s. When c has just
// measured a field for the first time, the peers that take it from the
// fleet are published again at once, not at their own next observation: a
// scrape interval later. Meanwhile a peer past its batch limit looked free
// for want of a decode time, and took requests that queued for a place
// (the hot prefix on llm-d's simulator, issue #24).
func (f *fleetCosts) update(c *calibrator, s *Costs) {
	f.mu.Lock()
	defer f.mu.Unlock()
	prev := f.measured[c]
	f.measured[c] = *s
	f.fill(s)
	c.out.Store(s)
	if !firstMeasured(prev, *s) {
		return
	}
	for o, own := range f.measured {
		if o != c {
			f.fill(&own)
			o.out.Store(&own)
		}
	}
}

// firstMeasured reports whether now has a value of a field the fleet
// shares (fill) that was unmeasured in prev.
func firstMeasured(prev, now Costs) bool {
	return prev.BatchLimit == 0 && now.BatchLimit > 0 || prev.DecodeStepSec == 0 && now.DecodeStepSec > 0 ||
		prev.DecodeSec == 0 && now.DecodeSec > 0
}

// fill fills the fields s has not measured with the median of the fleet's
// measurements. f.mu is held.
func (f *fleetCosts) fill(s *Costs) {
	if s.BatchLimit == 0 {
		// The peers' limit, unless this engine has run more.
		if v := f.median(func(o Costs) float64 { return float64(o.BatchLimit) }); v > 0 && int(v) >= s.PeakRunning {
			s.BatchLimit, s.FromFleet = int(v), append(s.FromFleet, "batch_limit")
		}
	}
	if s.DecodeStepSec == 0 {
		if v := f.median(func(o Costs) float64 { return o.DecodeStepSec }); v > 0 {
			s.DecodeStepSec, s.FromFleet = v, append(s.FromFleet, "decode_step_sec")
		}
	}
	if s.DecodeSec == 0 {
		if v := f.median(func(o Costs) float64 { return o.DecodeSec }); v > 0 {
			s.DecodeSec, s.FromFleet = v, append(s.FromFleet, "decode_sec")
		}
	}
}

// forget drops c (its endpoint left the fleet).
func (f *fleetCosts) forget(c *calibrator) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.measured, c)
}

// median returns the median of the positive values v takes over the
// measured endpoints (0: none). f.mu is held.
func (f *fleetCosts) median(v func(Costs) float64) float64 {
	var xs []float64
	for _, c := range f.measured {
		if x := v(c); x > 0 {
			xs = append(xs, x)
		}
	}
	if len(xs) == 0 {
		return 0
	}
	slices.Sort(xs)
	return xs[len(xs)/2]
}

// mean folds x into the running mean m of n samples: the plain mean while
// n is small, then an exponential average moving by meanRate.
func mean(m, x float64, n int) float64 {
	return m + (x-m)*max(1/float64(n), meanRate)
}

// features are the fit's: 1, the request's own tokens, the tokens ahead of
// it, the requests in flight, the tokens it loads from a slower tier.
const features = 5

// regression is a least-squares fit of y ≈ θ·x over the features with
// exponential forgetting (λ per sample), regularised toward a prior θ0 of
// diagonal precision w that keeps its weight however many samples come:
//
//	A = λA + x xᵀ + (1−λ) diag(w),  b = λb + x y + (1−λ) w∘θ0,  θ = A⁻¹b
//
// Samples whose residual exceeds outlierScale × the running mean absolute
// residual are clipped to that residual (Huber's estimator, in effect).
type regression struct {
	a      [features][features]float64
	b      [features]float64
	prior  [features]float64
	w      [features]float64
	lambda float64
	theta  [features]float64
	scale  float64 // running mean absolute residual
	n      int
}

func (g *regression) init(prior, w [features]float64, lambda float64) {
	g.prior, g.w, g.lambda, g.theta = prior, w, lambda, prior
	for i := range features {
		g.a[i][i] = w[i]
		g.b[i] = w[i] * prior[i]
	}
}

func (g *regression) add(x [features]float64, y float64) {
	if math.IsNaN(y) || math.IsInf(y, 0) || y < 0 {
		return
	}
	var pred float64
	for i := range features {
		pred += g.theta[i] * x[i]
	}
	r := y - pred
	if g.n >= warmupSamples {
		lim := outlierScale * g.scale
		r = min(max(r, -lim), lim)
	}
	if g.n == 0 {
		g.scale = math.Abs(r)
	} else {
		g.scale += (math.Abs(r) - g.scale) * max(1/float64(g.n+1), meanRate)
	}
	y = pred + r
	l := g.lambda
	for i := range features {
		for j := range features {
			g.a[i][j] = l*g.a[i][j] + x[i]*x[j]
		}
		g.a[i][i] += (1 - l) * g.w[i]
		g.b[i] = l*g.b[i] + x[i]*y + (1-l)*g.w[i]*g.prior[i]
	}
	if th, ok := solve(g.a, g.b); ok {
		g.theta = th
	}
	g.n++
}

// solve solves a x = b by Gaussian elimination with partial pivoting; ok
// is false for a (numerically) singular a.
func solve(a [features][features]float64, b [features]float64) (x [features]float64, ok bool) {
	for col := range features {
		p := col
		for r := col + 1; r < features; r++ {
			if math.Abs(a[r][col]) > math.Abs(a[p][col]) {
				p = r
			}
		}
		if math.Abs(a[p][col]) < 1e-12 {
			return x, false
		}
		a[col], a[p] = a[p], a[col]
		b[col], b[p] = b[p], b[col]
		for r := col + 1; r < features; r++ {
			f := a[r][col] / a[col][col]
			for k := col; k < features; k++ {
				a[r][k] -= f * a[col][k]
			}
			b[r] -= f * b[col]
		}
	}
	for i := features - 1; i >= 0; i-- {
		s := b[i]
		for k := i + 1; k < features; k++ {
			s -= a[i][k] * x[k]
		}
		x[i] = s / a[i][i]
	}
	return x, true
}
