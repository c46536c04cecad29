package discovery

import (
	"math"
	"math/rand/v2"
	"slices"
	"sync/atomic"
	"testing"
	"time"
)

// engineTruth is a synthetic endpoint whose TTFT is known exactly.
type engineTruth struct {
	rate      float64 // prefill tokens/s
	fixed     float64 // seconds
	perFlight float64 // seconds per request in flight
}

func (e engineTruth) ttft(tokens, inFlight int64) float64 {
	return e.fixed + float64(tokens)/e.rate + float64(inFlight)*e.perFlight
}

func newTestCalibrator(prior float64) (*calibrator, *atomic.Pointer[Costs]) {
	out := new(atomic.Pointer[Costs])
	return newCalibrator(CalibrationConfig{PrefillTokensPerSec: prior}, out, nil), out
}

// feed sends n observations drawn like real traffic: prompts of varied
// length, some cached, some queued behind others, 5% noise, and one in 20
// a wild outlier (a paused process, a retried connection).
func feed(c *calibrator, truth engineTruth, n int, rng *rand.Rand) {
	for range n {
		own := int64(rng.IntN(4096))
		if rng.IntN(3) == 0 {
			own = int64(rng.IntN(64)) // a cached prefix: a few tokens left
		}
		ahead := int64(0)
		if rng.IntN(2) == 0 {
			ahead = int64(rng.IntN(8192))
		}
		inFlight := int64(rng.IntN(12))
		y := truth.ttft(ahead+own, inFlight) * (1 + 0.05*rng.NormFloat64())
		if rng.IntN(20) == 0 {
			y *= 10 + 20*rng.Float64()
		}
		c.observe(time.Duration(y*float64(time.Second)), time.Second, own, 0, ahead, inFlight)
	}
}

// The fit recovers a known prefill rate from 300 noisy observations with
// outliers, whatever the prior: an engine a tenth of the prior's speed,
// one at the prior, one three times faster.
func TestCalibrationLearnsThePrefillRate(t *testing.T) {
	for _, tc := range []struct {
		name  string
		truth engineTruth
	}{
		{name: "slow large model", truth: engineTruth{rate: 2000, fixed: 0.05, perFlight: 0.004}},
		{name: "the prior's engine", truth: engineTruth{rate: 20000, fixed: 0.02, perFlight: 0.0003}},
		{name: "fast small model", truth: engineTruth{rate: 60000, fixed: 0.008, perFlight: 0.0001}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, out := newTestCalibrator(20000)
			feed(c, tc.truth, 300, rand.New(rand.NewPCG(1, 2)))
			got := out.Load()
			if rel := math.Abs(got.PrefillTokensPerSec-tc.truth.rate) / tc.truth.rate; rel > 0.1 {
				t.Errorf("prefill rate %.0f tokens/s, truth %.0f (off by %.0f%%)", got.PrefillTokensPerSec, tc.truth.rate, 100*rel)
			}
			// The intercept carries the bias of the one-sided outliers
			// that survive clipping; it matters little to routing.
			if math.Abs(got.FixedSec-tc.truth.fixed) > 0.04 {
				t.Errorf("fixed %.3f s, truth %.3f s", got.FixedSec, tc.truth.fixed)
			}
			if got.TTFTSamples != 300 || got.PrefillTokens <= 0 {
				t.Errorf("samples %d, mean prefill tokens %.0f", got.TTFTSamples, got.PrefillTokens)
			}
		})
	}
}

// Where some requests load part of their prompt from a CPU tier, the fit
// learns the load rate apart from the prefill rate: an engine that loads
// 4× faster than it computes, against the prior's 10×; an engine whose
// requests never load has LoadSpeedup × its learned prefill rate.
func TestCalibrationLearnsTheLoadRate(t *testing.T) {
	const rate, load = 20000.0, 80000.0
	c, out := newTestCalibrator(rate)
	rng := rand.New(rand.NewPCG(3, 4))
	for range 400 {
		own, loaded := int64(rng.IntN(2048)), int64(0)
		if rng.IntN(2) == 0 {
			loaded = int64(rng.IntN(8192))
		}
		inFlight := int64(rng.IntN(8))
		y := (0.02 + float64(own)/rate + float64(loaded)/load + float64(inFlight)*0.0003) * (1 + 0.05*rng.NormFloat64())
		c.observe(time.Duration(y*float64(time.Second)), time.Second, own, loaded, 0, inFlight)
	}
	got := out.Load()
	if rel := math.Abs(got.LoadTokensPerSec-load) / load; rel > 0.15 {
		t.Errorf("load rate %.0f tokens/s, truth %.0f (off by %.0f%%)", got.LoadTokensPerSec, load, 100*rel)
	}
	if rel := math.Abs(got.PrefillTokensPerSec-rate) / rate; rel > 0.1 {
		t.Errorf("prefill rate %.0f tokens/s, truth %.0f", got.PrefillTokensPerSec, rate)
	}
	c, out = newTestCalibrator(rate)
	feed(c, engineTruth{rate: 5000, fixed: 0.02, perFlight: 0.0003}, 300, rand.New(rand.NewPCG(1, 2)))
	if got := out.Load(); got.LoadTokensPerSec != got.PrefillTokensPerSec*LoadSpeedup {
		t.Errorf("no request loaded: load rate %.0f tokens/s, want %d× the prefill rate %.0f", got.LoadTokensPerSec, LoadSpeedup, got.PrefillTokensPerSec)
	}
}

// Before any sample there is nothing; a first sample moves the estimate
// only part of the way from the prior; nonsense stays within the bounds.
func TestCalibrationColdStartAndBounds(t *testing.T) {
	c, out := newTestCalibrator(20000)
	if out.Load() != nil {
		t.Fatal("costs before any observation")
	}
	// One request of 2,000 tokens that took 2 s (1,000 tokens/s).
	c.observe(2*time.Second, time.Second, 2000, 0, 0, 0)
	if r := out.Load().PrefillTokensPerSec; r <= 1000 || r >= 20000 {
		t.Errorf("after one sample the rate is %.0f: it should lie between the sample's and the prior's", r)
	}
	for range 500 { // a paused process: every TTFT an hour
		c.observe(time.Hour, time.Second, 1000, 0, 0, 0)
	}
	got := out.Load()
	if got.PrefillTokensPerSec < 20000/rateBound*0.999 || got.FixedSec > maxFixedSec {
		t.Errorf("learning left its bounds: %+v", got)
	}
}

// Requests sent past the batch limit also waited for a place in the batch:
// their TTFTs do not enter the prefill fit.
func TestCalibrationSkipsSamplesPastTheBatchLimit(t *testing.T) {
	c, out := newTestCalibrator(20000)
	for range minLimitSamples { // 8 running while 3 wait: the limit is 8
		c.observeEngine(0, 0, false, 8, 3, 0.5, 0)
	}
	truth := engineTruth{rate: 2000, fixed: 0.05}
	feed(c, truth, 200, rand.New(rand.NewPCG(3, 4)))
	before := *out.Load()
	for range 100 { // queued behind a full batch: a minute each
		c.observe(time.Minute, time.Second, 100, 0, 0, 20)
	}
	after := out.Load()
	if after.BatchLimit != 8 || after.TTFTSamples != before.TTFTSamples {
		t.Fatalf("limit %d, samples %d → %d", after.BatchLimit, before.TTFTSamples, after.TTFTSamples)
	}
	if after.PrefillTokensPerSec != before.PrefillTokensPerSec {
		t.Errorf("the rate moved from %.0f to %.0f on samples past the limit", before.PrefillTokensPerSec, after.PrefillTokensPerSec)
	}
}

// The decode step is the mean inter-token latency over each scrape
// interval; a counter reset (engine restart) starts over without a bogus
// sample, and a restart forgets the batch limit.
func TestCalibrationFromEngineScrapes(t *testing.T) {
	c, out := newTestCalibrator(20000)
	c.observeEngine(10, 1000, true, 4, 0, 0.5, 0) // baseline only
	if got := out.Load(); got.StepSamples != 0 || got.DecodeStepSec != 0 {
		t.Fatalf("a first scrape is only a baseline: %+v", got)
	}
	c.observeEngine(10+0.02*500, 1500, true, 8, 2, 0.5, 0) // 500 tokens at 20 ms
	c.observeEngine(20+0.03*500, 2000, true, 6, 1, 0.5, 0) // 500 tokens at 30 ms
	// Routing takes the limit from the first saturated scrape; the fit
	// leaves samples out past it only once three showed it.
	if got := out.Load(); got.BatchLimit != 8 || c.limit(minLimitSamples) != 0 {
		t.Errorf("after %d saturated scrapes the limit is %d for routing, %d for the fit", got.LimitSamples, got.BatchLimit, c.limit(minLimitSamples))
	}
	c.observeEngine(20+0.03*500, 2000, true, 7, 1, 0.5, 0) // no tokens, a third queue
	got := out.Load()
	if got.StepSamples != 2 || math.Abs(got.DecodeStepSec-0.025) > 1e-9 {
		t.Errorf("decode step %.4f s over %d samples, want 0.025 over 2", got.DecodeStepSec, got.StepSamples)
	}
	if got.BatchLimit != 8 || got.LimitSamples != 3 {
		t.Errorf("batch limit %d over %d samples, want 8 over 3", got.BatchLimit, got.LimitSamples)
	}
	c.observeEngine(30+0.03*500, 2500, true, 20, 5, 0.95, 0) // waiting for KV, not for a place
	c.prefillTokens = 2000
	c.observeEngine(30+0.03*500, 2500, true, 20, 5, 0.85, 20000) // 3,000 tokens free: not two prompts
	// Neither is a limit of 20, and an engine running 20 has no limit of 8.
	if got := out.Load(); got.BatchLimit != 0 {
		t.Errorf("a full cache taken for a batch limit: %+v", got)
	}
	c.restart()
	c.observeEngine(1, 100, true, 3, 0, 0.5, 0) // counters restarted from zero
	got = out.Load()
	if got.StepSamples != 3 || got.BatchLimit != 0 {
		t.Errorf("after a restart: %+v", got)
	}
	c.observeEngine(1+0.01*100, 200, true, 3, 0, 0.5, 0)
	if got := out.Load(); got.StepSamples != 4 || got.DecodeStepSec >= 0.0267 {
		t.Errorf("no new sample after the restart: %+v", got)
	}
}

// A queue behind fewer requests than the engine has been seen running is
// a burst waiting for the token budget, not a full batch; a full batch is
// a limit from its first scrape.
func TestBatchLimitIsNeverBelowWhatRan(t *testing.T) {
	c, out := newTestCalibrator(20000)
	c.observeEngine(0, 0, false, 8, 0, 0.3, 0) // 8 running, nothing waiting
	c.observeEngine(0, 0, false, 4, 3, 0.3, 0) // a burst over the token budget
	if got := out.Load(); got.BatchLimit != 0 {
		t.Fatalf("a burst behind 4 taken for a limit, where 8 ran: %+v", got)
	}
	c.observeEngine(0, 0, false, 9, 2, 0.4, 0) // a full batch
	if got := out.Load(); got.BatchLimit != 9 || c.limit(minLimitSamples) != 0 {
		t.Fatalf("limit %d for routing after one full batch (want 9), %d for the fit (want 0)", got.BatchLimit, c.limit(minLimitSamples))
	}
}

// A lease feeds its endpoint's calibrator: a completed stream is a TTFT
// and a decode-time sample, with the prompt tokens the engine said it
// computed; a whole response and a released (failed or cut) stream are
// neither.
func TestLeaseObservations(t *testing.T) {
	e, err := NewEndpoint("http://10.0.0.1:8000", RoleMixed)
	if err != nil {
		t.Fatal(err)
	}
	e.calib = newCalibrator(CalibrationConfig{}, &e.costs, nil)
	busy := e.Acquire(500) // ahead of the next one
	l := e.Acquire(1000)
	l.FirstByte(true)
	l.Complete(800) // the engine had 200 of the tokens cached after all
	got := e.Costs()
	if got == nil || got.TTFTSamples != 1 || got.DecodeSamples != 1 || got.PrefillTokens != 800 {
		t.Fatalf("after one stream: %+v", got)
	}
	whole := e.Acquire(10)
	whole.FirstByte(false)
	whole.Complete(Uncomputed)
	cut := e.Acquire(10)
	cut.FirstByte(true)
	cut.Release()
	busy.Release()
	if got := e.Costs(); got.TTFTSamples != 1 || got.DecodeSamples != 1 {
		t.Errorf("want the complete stream's samples only: %+v", got)
	}
	if e.InFlight() != 0 || e.PendingPrefill() != 0 {
		t.Errorf("leases leaked: %d in flight, %d pending", e.InFlight(), e.PendingPrefill())
	}
}

// A lease's load is what the request met from all the router replicas:
// the peers' requests in flight and prefill (their gossip) count with this
// router's own. Eight replicas' fits, each seeing an eighth of the load,
// ascribed it to the prompt: cold prompts, sent where the fleet was idle,
// came back faster than warm ones sent where it was busy, and some
// endpoints' prefill rates were learned at the bound, 2,000,000 tokens a
// second, which made every spill there look free (issue #37).
func TestLeaseCountsThePeersLoad(t *testing.T) {
	e, err := NewEndpoint("http://10.0.0.1:8000", RoleMixed)
	if err != nil {
		t.Fatal(err)
	}
	e.calib = newCalibrator(CalibrationConfig{}, &e.costs, nil)
	own := e.Acquire(300)
	e.SetPeerInFlight(7)
	e.AddPeerPrefill(2000, time.Now().Add(time.Minute))
	l := e.Acquire(100)
	if l.before != 8 || l.ahead != 2300 {
		t.Errorf("the lease met %d in flight and %d tokens ahead, want 8 and 2300", l.before, l.ahead)
	}
	l.Release()
	own.Release()
}

// An endpoint that has not seen its engine saturate uses the median batch
// limit (and decode times) its peers measured, marked as such; its own
// measurement replaces it.
func TestUnmeasuredEndpointsUseTheFleetsMedian(t *testing.T) {
	fleet := newFleetCosts()
	var outs [4]atomic.Pointer[Costs]
	var cs [4]*calibrator
	for i := range cs {
		cs[i] = newCalibrator(CalibrationConfig{}, &outs[i], fleet)
	}
	for i, limit := range []int64{8, 8, 16} {
		cs[i].observeEngine(float64(i), 100, true, limit, 2, 0.5, 0)
		cs[i].observeEngine(float64(i)+2, 200, true, limit, 2, 0.5, 0) // 20 ms steps
		cs[i].observeEngine(float64(i)+2, 200, true, limit, 2, 0.5, 0)
	}
	cs[3].observeEngine(0, 0, false, 3, 0, 0.5, 0) // never saturated, no histogram
	got := outs[3].Load()
	if got.BatchLimit != 8 || got.DecodeStepSec != 0.02 || len(got.FromFleet) != 2 {
		t.Errorf("from the fleet: %+v", got)
	}
	cs[3].observeEngine(0, 0, false, 12, 1, 0.5, 0)
	if got := outs[3].Load(); got.BatchLimit != 12 || slices.Contains(got.FromFleet, "batch_limit") {
		t.Errorf("own measurement: %+v", got)
	}
	// The first decode time measured anywhere reaches the peers at once,
	// not at their next scrape.
	cs[0].observe(30*time.Millisecond, 2*time.Second, 300, 0, 0, 0)
	for i := 1; i < len(cs); i++ {
		if got := outs[i].Load(); got.DecodeSec != 2 || !slices.Contains(got.FromFleet, "decode_sec") || got.BatchLimit != []int{8, 16, 12}[i-1] {
			t.Errorf("endpoint %d after a peer's first decode time: %+v", i, got)
		}
	}
	// An engine seen running more than the peers' limit does not take it.
	var bigOut atomic.Pointer[Costs]
	big := newCalibrator(CalibrationConfig{}, &bigOut, fleet)
	big.observeEngine(0, 0, false, 20, 0, 0.5, 0)
	if got := bigOut.Load(); got.BatchLimit != 0 || got.PeakRunning != 20 {
		t.Errorf("an engine that ran 20 took the fleet's limit: %+v", got)
	}
	fleet.forget(big)
	fleet.forget(cs[2])
	if len(fleet.measured) != 3 {
		t.Errorf("%d endpoints after one left", len(fleet.measured))
	}
}
