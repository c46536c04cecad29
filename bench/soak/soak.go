// Package soak is the engine of kvsoak (make soak): it runs the real
// kvroute binary as a child process in front of simulated vLLM pods served
// in this process, sends a mix of shared-prefix, multi-turn and random
// requests (streaming and not, some abandoned by the client) while faults
// rotate over the pods (5xx and 429 storms, stalls before the first byte
// and in mid-stream, dropped connections, a pod killed and restarted), and
// samples kvroute's resources every few seconds: RSS and open FDs from
// /proc, goroutines, in-flight requests and the prefix index from its
// admin /metrics. After a warm-up it fits a line to each series and judges
// whether kvroute stays flat; it also counts the requests lost (neither
// answered nor clearly failed) and checks that SIGTERM ends kvroute within
// its drain timeout.
package soak

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"time"

	"github.com/kvroute/kvroute/bench/sim"
)

// ErrConfig is wrapped by every configuration error.
var ErrConfig = errors.New("soak: invalid config")

// Config describes one soak run.
type Config struct {
	// Duration is how long requests are sent.
	Duration time.Duration
	// Interval is the sampling period.
	Interval time.Duration
	// Pods is the number of simulated pods (at least 2: one is killed at
	// times).
	Pods int
	// Out is the directory of the results.
	Out string
	// KVRoute is the path of the kvroute binary; KVRouteArgs are added to
	// its command line (after --listen, --admin-listen and --backends).
	KVRoute     string
	KVRouteArgs []string
	// Seed makes the workloads, the mix and the pods reproducible.
	Seed uint64
	// Rate is the mean request rate (Poisson arrivals), requests/s.
	Rate float64
	// Mix is the shape of the traffic.
	Mix Mix
	// MaxInFlight caps the client's requests in flight; an arrival past
	// the cap is skipped and counted.
	MaxInFlight int
	// RequestTimeout bounds one request; one that runs out is lost.
	RequestTimeout time.Duration
	// Warmup is the share of Duration before the fits start.
	Warmup float64
	// Settle is the wait after the drain before the last sample, so idle
	// connections and workers expire (kvroute closes idle upstream
	// connections after 4 s, fasthttp's idle workers after 10 s).
	Settle time.Duration
	// DrainTimeout is kvroute's --drain-timeout (its default, 30 s): after
	// SIGTERM it must exit 0 within it.
	DrainTimeout time.Duration
	// Faults enables the fault schedule.
	Faults bool
	// KVBlocks is each pod's KV capacity in blocks of 16 tokens; a small
	// cache bounds kvroute's prefix index early in the run.
	KVBlocks int
	// Limits are the thresholds of the verdict (IndexBound is derived from
	// the pods when 0).
	Limits Limits
	// Log receives progress lines; nil: quiet.
	Log io.Writer
}

// DefaultConfig returns the defaults of make soak.
func DefaultConfig() Config {
	return Config{Duration: 10 * time.Minute, Interval: 5 * time.Second, Pods: 4, Out: "bench/results/soak",
		KVRoute: "bin/kvroute", Seed: 1, Rate: 8, Mix: DefaultMix(), MaxInFlight: 64, RequestTimeout: time.Minute,
		Warmup: 0.2, Settle: 12 * time.Second, DrainTimeout: 30 * time.Second, Faults: true, KVBlocks: 2048,
		Limits: DefaultLimits()}
}

// Validate reports every problem of c.
func (c *Config) Validate() error {
	var errs []error
	bad := func(format string, a ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrConfig}, a...)...))
	}
	if c.Duration <= 0 {
		bad("duration %s must be positive", c.Duration)
	}
	if c.Interval <= 0 || c.Interval > c.Duration/4 {
		bad("interval %s must be positive and at most a quarter of the duration", c.Interval)
	}
	if c.Pods < 2 {
		bad("need at least 2 pods, got %d", c.Pods)
	}
	if !(c.Rate > 0) {
		bad("rate %v must be positive", c.Rate)
	}
	if c.MaxInFlight < 1 {
		bad("max in flight %d must be ≥ 1", c.MaxInFlight)
	}
	if c.Warmup < 0 || c.Warmup > 0.8 {
		bad("warm-up share %v outside [0, 0.8]", c.Warmup)
	}
	if c.RequestTimeout <= 0 || c.DrainTimeout <= 0 || c.Settle < 0 {
		bad("timeouts must be positive")
	}
	if c.KVBlocks < 512 {
		bad("KV blocks %d < 512 (the longest requests need ~400)", c.KVBlocks)
	}
	if c.Out == "" || c.KVRoute == "" {
		bad("--out and --kvroute are required")
	}
	m := c.Mix
	if m.Shared < 0 || m.Multi < 0 || m.Shared+m.Multi > 1 || m.Stream < 0 || m.Stream > 1 || m.Abandon < 0 || m.Abandon > 1 ||
		m.AbandonMin < 0 || m.AbandonMax < m.AbandonMin {
		bad("mix shares must be in [0,1] (shared + multi ≤ 1) and the abandon delays ordered")
	}
	return errors.Join(errs...)
}

// podConfigs returns the pods' configurations: the default engine
// (Llama-3.1-8B on an H100, real time) with a small KV cache.
func (c *Config) podConfigs() []sim.Config {
	out := make([]sim.Config, c.Pods)
	for i := range out {
		pc := sim.DefaultConfig()
		pc.Seed = c.Seed*1000 + uint64(i)
		pc.NumGPUBlocks = c.KVBlocks
		out[i] = pc
	}
	return out
}

// indexBytesPerToken is the most bytes of rendering per token kvroute
// ever assumes when it sizes an endpoint's index from its KV capacity
// (routing's maxBytesPerToken; it learns ≈ 4–8 on the simulator's text), so
// IndexBound is the most blocks of 1 KiB (--prefix-block-bytes) the fleet's
// KV lets it keep, whatever it learned.
const indexBytesPerToken = 16

// indexBound is the most prefix-index entries the pods' KV capacity lets
// kvroute keep.
func (c *Config) indexBound() float64 {
	pc := sim.DefaultConfig()
	tokens := float64(c.KVBlocks * pc.BlockSize)
	return float64(c.Pods) * math.Ceil(tokens*indexBytesPerToken/1024)
}

// Result is the outcome of a run.
type Result struct {
	Config    Config
	Started   time.Time
	WarmupEnd float64 // seconds since the load began
	LoadEnd   float64
	Samples   []Sample
	Records   []Record
	Faults    []FaultEvent
	PodURLs   []string
	Checks    []Check
	Requests  RequestSummary
	Shutdown  Shutdown
	Log       LogSummary
	// Problems are failures besides the series: lost requests, a bad
	// exit, a drain that did not finish.
	Problems []string
	// Notes are facts worth reading that fail nothing.
	Notes []string
	// Flat is the verdict: every check flat and no problem.
	Flat bool
	// SelfCores is kvsoak's own CPU (cores) over the run, pods included.
	SelfCores float64
	// Router holds kvroute's request, retry and upstream-error counters at
	// the end ("name{label=value}").
	Router map[string]float64
	// StalledWrites counts pod writes held by mid-stream stalls.
	StalledWrites int64
	Files         []string
}

// Shutdown is how kvroute ended.
type Shutdown struct {
	ClientDrained bool    // every request of the client ended
	RouterDrained bool    // kvroute's in-flight gauge reached 0
	DrainSeconds  float64 // from the end of the load to the router's 0
	ExitCode      int
	ExitSeconds   float64 // from SIGTERM to the exit
	Err           string
}

// Run performs one soak run and writes its results under cfg.Out. The
// error is for runs that could not be made (or were interrupted); a run
// that was made but is not flat returns Result.Flat false and no error.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Limits.IndexBound == 0 {
		cfg.Limits.IndexBound = cfg.indexBound()
	}
	logf := func(format string, a ...any) {
		if cfg.Log != nil {
			fmt.Fprintf(cfg.Log, format+"\n", a...)
		}
	}
	if _, err := os.Stat(cfg.KVRoute); err != nil {
		return nil, fmt.Errorf("kvroute binary: %w (build it with `make build`)", err)
	}
	if err := os.MkdirAll(cfg.Out, 0o755); err != nil {
		return nil, err
	}
	res := &Result{Config: cfg, Started: time.Now()}
	cpu0, wall0 := selfCPU(), time.Now()

	pcfgs := cfg.podConfigs()
	pods, err := startPods(pcfgs)
	if err != nil {
		return nil, err
	}
	defer pods.close()
	r, err := startRouter(cfg.KVRoute, pods.urls(), cfg.KVRouteArgs, filepath.Join(cfg.Out, FileLog))
	if err != nil {
		return nil, err
	}
	defer r.kill()
	if err := r.waitReady(ctx, 30*time.Second); err != nil {
		return nil, err
	}
	logf("kvroute pid %d on %s (admin %s) in front of pods %v; load %s at %g req/s, faults every %s",
		r.pid, r.api, r.admin, pods.urls(), cfg.Duration, cfg.Rate, FaultPeriod(cfg.Duration))

	gen, err := newGenerator(r.api, pcfgs[0].Model, cfg.Rate, cfg.Mix, cfg.MaxInFlight, cfg.RequestTimeout, cfg.Seed, pods)
	if err != nil {
		return nil, err
	}
	// An idle baseline, once kvroute has scraped and probed the pods.
	const baselineWait = 2 * time.Second
	smp := &sampler{r: r, out: cfg.Log, start: time.Now().Add(baselineWait)}
	smp.setPhase(PhaseBaseline)
	if !sleepCtx(ctx, baselineWait/2) {
		return nil, ctx.Err()
	}
	smp.take()
	res.profile(r, FileGoroutinesIdle)
	sleepCtx(ctx, time.Until(smp.start))

	// The load, the faults and the sampling.
	res.WarmupEnd = cfg.Warmup * cfg.Duration.Seconds()
	stopSampling, samplingDone := make(chan struct{}), make(chan struct{})
	flt := runLoad(ctx, cfg, gen, pods, smp, stopSampling, samplingDone)
	loadEnd := time.Now()
	res.LoadEnd = loadEnd.Sub(smp.start).Seconds()
	smp.setPhase(PhaseDrain)
	logf("load stopped after %.0f s; draining", res.LoadEnd)

	// The drain: the client's requests end, then kvroute's gauge.
	res.Shutdown.ClientDrained = gen.wait(cfg.RequestTimeout + 5*time.Second)
	gen.close()
	res.Shutdown.RouterDrained = waitDrained(ctx, r, cfg.DrainTimeout)
	if res.Shutdown.RouterDrained {
		res.Shutdown.DrainSeconds = time.Since(loadEnd).Seconds()
	}
	sleepCtx(ctx, cfg.Settle)
	close(stopSampling)
	<-samplingDone
	smp.setPhase(PhaseFinal)
	smp.take()
	res.profile(r, FileGoroutinesFinal)
	if m, err := r.counters(); err == nil {
		res.Router = m
	}
	res.StalledWrites = pods.stalledWrites.Load()

	// SIGTERM: kvroute must exit 0 within its drain timeout.
	res.terminate(r, cfg.DrainTimeout+10*time.Second)
	pods.close()
	if wall := time.Since(wall0).Seconds(); cpu0 >= 0 && wall > 0 {
		res.SelfCores = (selfCPU() - cpu0) / wall
	}

	res.gather(smp, gen, flt, pods, cfg)
	res.judge()
	if err := res.write(); err != nil {
		return res, err
	}
	if ctx.Err() != nil {
		return res, fmt.Errorf("soak interrupted: %w", ctx.Err())
	}
	return res, nil
}

// profile saves kvroute's goroutine profile as name under the output
// directory, noting a failure.
func (res *Result) profile(r *router, name string) {
	path := filepath.Join(res.Config.Out, name)
	if err := r.saveGoroutines(path); err != nil {
		res.Notes = append(res.Notes, err.Error())
	} else {
		res.Files = append(res.Files, path)
	}
}

// runLoad runs the load (and the faults when cfg asks for them) for
// cfg.Duration with the sampler looping beside them until stopSampling
// (samplingDone closes when it stopped); it returns the faulter (nil
// without faults) once the load and the faults stopped.
func runLoad(ctx context.Context, cfg Config, gen *generator, pods *podSet, smp *sampler, stopSampling, samplingDone chan struct{}) *faulter {
	stopLoad := make(chan struct{})
	genDone, fltDone := make(chan struct{}), make(chan struct{})
	go func() { defer close(genDone); gen.run(ctx, stopLoad) }()
	var flt *faulter
	if cfg.Faults {
		flt = newFaulter(pods, FaultPeriod(cfg.Duration), smp.start)
		go func() { defer close(fltDone); flt.run(stopLoad) }()
	} else {
		close(fltDone)
	}
	smp.mu.Lock()
	smp.gen, smp.flt = gen, flt
	smp.mu.Unlock()
	smp.setPhase(PhaseLoad)
	go smp.loop(cfg.Interval, stopSampling, samplingDone)
	sleepCtx(ctx, cfg.Duration)
	close(stopLoad)
	<-genDone
	<-fltDone
	return flt
}

// terminate sends kvroute SIGTERM and records how it exited: it must exit
// 0 within timeout.
func (res *Result) terminate(r *router, timeout time.Duration) {
	code, took, err := r.terminate(timeout)
	res.Shutdown.ExitCode, res.Shutdown.ExitSeconds = code, took.Seconds()
	if err != nil {
		res.Shutdown.Err = err.Error()
	}
	r.logFile.Close()
}

// waitDrained waits, at most timeout, until kvroute's in-flight gauge reads
// 0, and reports whether it did.
func waitDrained(ctx context.Context, r *router, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for {
		m, err := r.scrape(MetricInFlight)
		if v, ok := m[MetricInFlight]; err == nil && ok && v == 0 {
			return true
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// gather fills res from the run's parts once they stopped: the samples,
// the client's records, the faults, the checks, the request summary and
// the log's analysis.
func (res *Result) gather(smp *sampler, gen *generator, flt *faulter, pods *podSet, cfg Config) {
	res.PodURLs = pods.urls()
	res.Samples = smp.all()
	res.Records = gen.snapshot()
	if flt != nil {
		res.Faults = flt.eventsCopy()
		flt.mu.Lock()
		for _, e := range flt.errs {
			res.Problems = append(res.Problems, e.Error())
		}
		flt.mu.Unlock()
	}
	res.Checks = Evaluate(res.Samples, res.WarmupEnd, cfg.Limits)
	res.Requests = summarize(res.Records, pods.cutCounts())
	res.Log = analyzeLog(filepath.Join(cfg.Out, FileLog))
	if smp.errs > 0 {
		msg := fmt.Sprintf("%d sampling errors (last: %v)", smp.errs, smp.lastErr)
		if smp.errs*10 > len(res.Samples) {
			res.Problems = append(res.Problems, msg)
		} else {
			res.Notes = append(res.Notes, msg)
		}
	}
}

// judge fills Problems and Notes from the requests, the shutdown and the
// log, and sets Flat.
func (res *Result) judge() {
	cfg := res.Config
	rq := &res.Requests
	if rq.Lost > 0 {
		res.Problems = append(res.Problems, fmt.Sprintf("%d requests lost (neither answered nor clearly failed, and no pod cut them): %v",
			rq.Lost, rq.LostIDs))
	}
	if rq.Cut > 0 {
		res.Notes = append(res.Notes, fmt.Sprintf("%d streams cut by their pod (%d killed, %d dropped connections) reached the client as truncated responses, without an SSE error event",
			rq.Cut, rq.CutBy[CutKill], rq.CutBy[CutDrop]))
	}
	if rq.Sent > 0 && rq.OKShare < 0.8 {
		res.Notes = append(res.Notes, fmt.Sprintf("only %.0f%% of the requests that ran to an end succeeded", 100*rq.OKShare))
	}
	if rq.Skipped > 0 {
		res.Notes = append(res.Notes, fmt.Sprintf("%d arrivals skipped at the client's in-flight cap (%d)", rq.Skipped, cfg.MaxInFlight))
	}
	sd := res.Shutdown
	if !sd.ClientDrained {
		res.Problems = append(res.Problems, "requests still running at the client after the load stopped (hang)")
	}
	if !sd.RouterDrained {
		res.Problems = append(res.Problems, fmt.Sprintf("kvroute's in-flight gauge did not return to 0 within %s of the end of the load", cfg.DrainTimeout))
	}
	switch {
	case sd.Err != "":
		res.Problems = append(res.Problems, "SIGTERM: "+sd.Err)
	case sd.ExitCode != 0:
		res.Problems = append(res.Problems, fmt.Sprintf("kvroute exited with code %d after SIGTERM", sd.ExitCode))
	case sd.ExitSeconds > cfg.DrainTimeout.Seconds():
		res.Problems = append(res.Problems, fmt.Sprintf("kvroute took %.1f s to exit, more than its drain timeout %s", sd.ExitSeconds, cfg.DrainTimeout))
	}
	if res.Log.Panics > 0 {
		res.Problems = append(res.Problems, fmt.Sprintf("%d panics in kvroute's log", res.Log.Panics))
	}
	if res.Log.DrainIncomplete {
		res.Problems = append(res.Problems, "kvroute logged \"drain incomplete\"")
	}
	res.Flat = len(res.Problems) == 0
	for _, c := range res.Checks {
		res.Flat = res.Flat && c.Flat
	}
}

// sleepCtx sleeps for d or until ctx ends; it reports whether d passed.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
