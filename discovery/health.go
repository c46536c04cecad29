package discovery

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// HealthConfig configures active health probes: GET <endpoint URL><Path>
// every Interval (± Jitter); FailThreshold failures in a row mark the
// endpoint down, RiseThreshold successes in a row bring it back. A zero
// field takes its default. Probes use their own connections and never touch
// the in-flight counters.
type HealthConfig struct {
	// Disabled turns active probing off (endpoints are then never down).
	Disabled bool
	// Interval between probe rounds. Default 5 s: with FailThreshold 3, a
	// dead pod is marked down within ~15 s, while passive ejection reacts
	// to live traffic at once.
	Interval time.Duration
	// Timeout of one probe. Default 2 s: vLLM answers /health from its API
	// server process even when the engine is saturated.
	Timeout time.Duration
	// Jitter spreads rounds by ± this fraction of Interval so router
	// replicas do not probe in lockstep. Default 0.1.
	Jitter float64
	// FailThreshold is the consecutive failed probes that mark an endpoint
	// down. Default 3, so a busy pod that misses one probe keeps its
	// traffic.
	FailThreshold int
	// RiseThreshold is the consecutive successful probes that bring a down
	// endpoint back. Default 2.
	RiseThreshold int
	// Path is the probe path of every endpoint. Default (empty): per
	// dialect, "/health" (vLLM and SGLang: 200 when serving, 503 when the
	// engine is dead; llama.cpp: 503 while loading its model) and Ollama's
	// "/api/version" (it has no /health). A 404 or 405 is never a failed
	// probe: the engine is alive and serves another path.
	Path string
	// Workers is the number of probes in flight at once. Default 16.
	Workers int
}

// Defaults of HealthConfig and PassiveConfig.
const (
	DefaultHealthInterval  = 5 * time.Second
	DefaultHealthTimeout   = 2 * time.Second
	DefaultHealthJitter    = 0.1
	DefaultFailThreshold   = 3
	DefaultRiseThreshold   = 2
	DefaultHealthPath      = "/health"
	DefaultHealthWorkers   = 16
	DefaultEjectFailures   = 5
	DefaultEjectCooldown   = 5 * time.Second
	DefaultMaxCooldown     = 2 * time.Minute
	DefaultMaxEjectedShare = 0.5
)

func (c HealthConfig) withDefaults() HealthConfig {
	c.Interval = orDefault(c.Interval, DefaultHealthInterval)
	c.Timeout = orDefault(c.Timeout, DefaultHealthTimeout)
	c.Jitter = orDefault(c.Jitter, DefaultHealthJitter)
	c.FailThreshold = orDefault(c.FailThreshold, DefaultFailThreshold)
	c.RiseThreshold = orDefault(c.RiseThreshold, DefaultRiseThreshold)
	c.Workers = orDefault(c.Workers, DefaultHealthWorkers)
	return c
}

func (c HealthConfig) validate() error {
	switch {
	case c.Interval < 0 || c.Timeout < 0:
		return fmt.Errorf("%w: health interval and timeout must be positive", ErrBadConfig)
	case c.Jitter < 0 || c.Jitter >= 1:
		return fmt.Errorf("%w: health jitter must be in [0, 1)", ErrBadConfig)
	case c.FailThreshold < 1 || c.RiseThreshold < 1 || c.Workers < 1:
		return fmt.Errorf("%w: health thresholds and workers must be at least 1", ErrBadConfig)
	case c.Path != "" && c.Path[0] != '/':
		return fmt.Errorf("%w: health path %q must start with /", ErrBadConfig, c.Path)
	}
	return nil
}

// PassiveConfig configures passive ejection: after Failures consecutive
// failures reported by the proxy ((*Endpoint).ReportFailure), the endpoint
// is ejected for Cooldown; each further ejection doubles the cooldown up to
// MaxCooldown, and an endpoint that stayed in for MaxCooldown after
// returning starts again from Cooldown. An ejected endpoint returns on its
// own when its cooldown ends. A zero field takes its default.
type PassiveConfig struct {
	// Disabled turns passive ejection off.
	Disabled bool
	// Failures is the consecutive failures that eject. Default 5 (Envoy's
	// outlier detection default for consecutive 5xx).
	Failures int
	// Cooldown is the first ejection's length. Default 5 s.
	Cooldown time.Duration
	// MaxCooldown caps the doubling. Default 2 min.
	MaxCooldown time.Duration
	// MaxEjectedShare is the largest share of a role's endpoints that may
	// be ejected at once (Envoy's max_ejection_percent): when every pod
	// fails, kvroute keeps trying them rather than refusing all traffic.
	// Default 0.5; 1 allows ejecting all.
	MaxEjectedShare float64
}

func (c PassiveConfig) withDefaults() PassiveConfig {
	c.Failures = orDefault(c.Failures, DefaultEjectFailures)
	c.Cooldown = orDefault(c.Cooldown, DefaultEjectCooldown)
	c.MaxCooldown = orDefault(c.MaxCooldown, DefaultMaxCooldown)
	c.MaxEjectedShare = orDefault(c.MaxEjectedShare, DefaultMaxEjectedShare)
	return c
}

func (c PassiveConfig) validate() error {
	switch {
	case c.Failures < 1:
		return fmt.Errorf("%w: passive ejection failures must be at least 1", ErrBadConfig)
	case c.Cooldown < 0 || c.MaxCooldown < c.Cooldown:
		return fmt.Errorf("%w: ejection cooldown must be positive and at most the max cooldown", ErrBadConfig)
	case c.MaxEjectedShare < 0 || c.MaxEjectedShare > 1:
		return fmt.Errorf("%w: max ejected share must be in [0, 1]", ErrBadConfig)
	}
	return nil
}

func orDefault[T comparable](v, d T) T {
	var zero T
	if v == zero {
		return d
	}
	return v
}

// proberLoop is the active health-check loop.
func (f *Fleet) proberLoop() loopConfig {
	h := f.o.Health
	return loopConfig{
		interval: h.Interval, jitter: h.Jitter, workers: h.Workers,
		busy: func(e *Endpoint) *atomic.Bool { return &e.probing },
		newWorker: func() func(context.Context, *Endpoint) {
			return f.probe
		},
	}
}

// probe runs one probe of e and applies the thresholds. It detects e's
// dialect from the probe's answer when needed (dialect.go), and probes
// again at once when the dialect's probe path differs; a probe path the
// engine does not serve (404, 405) counts neither way and asks for
// detection.
func (f *Fleet) probe(ctx context.Context, e *Endpoint) {
	h := &f.o.Health
	path := f.healthPath(e.Dialect())
	a := f.probeOnce(ctx, e.URL+path, h.Timeout)
	if ctx.Err() != nil {
		return // shutting down: not the endpoint's fault
	}
	if f.o.Dialect == DialectUnknown && !e.detected.Load() {
		var first *answer
		if path == DefaultHealthPath || a.status == 0 {
			first = &a // no answer at all says the same of /health
		}
		f.ensureDetected(ctx, e, first)
		if p := f.healthPath(e.Dialect()); p != path {
			a = f.probeOnce(ctx, e.URL+p, h.Timeout)
			if ctx.Err() != nil {
				return
			}
		}
	}
	if a.status == http.StatusNotFound || a.status == http.StatusMethodNotAllowed {
		f.unserved(e)
		return
	}
	err := a.err
	if err == nil {
		e.probeFails.Store(0)
		n := e.probeOKs.Add(1)
		if int(n) >= h.RiseThreshold && e.flags.Load()&flagDown != 0 {
			e.flags.And(^flagDown)
			f.log.Info("endpoint up", zap.String("endpoint", e.URL), zap.Stringer("role", e.Role), zap.Int32("probes", n))
			f.event("up", e)
		}
		f.event("probe-ok", e)
		return
	}
	e.probeOKs.Store(0)
	n := e.probeFails.Add(1)
	f.m.probeFailures[roleIndex(e.Role)].Inc()
	if int(n) >= h.FailThreshold && e.flags.Load()&flagDown == 0 {
		e.flags.Or(flagDown)
		e.detected.Store(false) // what answers when it returns may be another engine
		f.log.Warn("endpoint down", zap.String("endpoint", e.URL), zap.Stringer("role", e.Role),
			zap.Int32("failed_probes", n), zap.Error(err))
		f.event("down", e)
	}
	f.event("probe-fail", e)
}

// answer is a probe's result: the status (0: no answer), the Server
// header, and an error for anything but a 200.
type answer struct {
	status int
	server string
	err    error
}

// probeOnce GETs url and reports anything but a 200 as an error.
func (f *Fleet) probeOnce(ctx context.Context, url string, timeout time.Duration) answer {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return answer{err: err}
	}
	resp, err := f.client.Do(req)
	if err != nil {
		return answer{err: err}
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // reuse the connection
	resp.Body.Close()
	a := answer{status: resp.StatusCode, server: resp.Header.Get("Server")}
	if resp.StatusCode != http.StatusOK {
		a.err = fmt.Errorf("%w: %s", ErrStatus, resp.Status)
	}
	return a
}

// passiveFailure handles the n-th consecutive failure reported on e.
func (f *Fleet) passiveFailure(e *Endpoint, n int) {
	p := &f.o.Passive
	if p.Disabled || n < p.Failures || e.flags.Load()&flagEjected != 0 {
		return
	}
	f.ejectMu.Lock()
	if e.flags.Load()&flagEjected != 0 || !f.mayEject(e) {
		f.ejectMu.Unlock()
		return
	}
	now := time.Now()
	if !e.lastReturn.IsZero() && now.Sub(e.lastReturn) > p.MaxCooldown {
		e.ejectLevel = 0
	}
	cool := p.Cooldown
	for i := 0; i < e.ejectLevel && cool < p.MaxCooldown; i++ {
		cool *= 2
	}
	cool = min(cool, p.MaxCooldown)
	e.ejectLevel++
	e.cooldown, e.ejectedUntil = cool, now.Add(cool)
	e.flags.Or(flagEjected)
	e.passiveFails.Store(0)
	level := e.ejectLevel
	f.ejectMu.Unlock()

	f.m.ejections[roleIndex(e.Role)].Inc()
	f.log.Warn("endpoint ejected", zap.String("endpoint", e.URL), zap.Stringer("role", e.Role),
		zap.Int("consecutive_failures", n), zap.Duration("cooldown", cool), zap.Int("ejections_in_a_row", level))
	f.event("eject", e)
	time.AfterFunc(cool, func() { f.unEject(e) })
}

// mayEject reports whether ejecting e keeps the ejected share of its role
// within MaxEjectedShare. f.ejectMu is held.
func (f *Fleet) mayEject(e *Endpoint) bool {
	group := f.pool.Load().Role(e.Role)
	ejected, member := 0, false
	for _, o := range group {
		if o == e {
			member = true
		} else if o.flags.Load()&flagEjected != 0 {
			ejected++
		}
	}
	if !member {
		return true // draining: no new traffic anyway
	}
	return float64(ejected+1) <= f.o.Passive.MaxEjectedShare*float64(len(group))
}

// unEject ends e's ejection.
func (f *Fleet) unEject(e *Endpoint) {
	f.ejectMu.Lock()
	e.flags.And(^flagEjected)
	e.lastReturn = time.Now()
	e.passiveFails.Store(0)
	f.ejectMu.Unlock()
	f.log.Info("endpoint returned from ejection", zap.String("endpoint", e.URL), zap.Stringer("role", e.Role))
	f.event("return", e)
}

// loopConfig describes a periodic per-endpoint job (probe or scrape): one
// scheduling goroutine hands the current Set's endpoints to a fixed pool of
// workers every interval (± jitter); an endpoint whose previous job is
// still running is skipped.
type loopConfig struct {
	interval time.Duration
	jitter   float64
	workers  int
	// busy returns the endpoint's in-progress flag for this job.
	busy func(*Endpoint) *atomic.Bool
	// newWorker returns one worker's job function (with its own scratch).
	newWorker func() func(context.Context, *Endpoint)
	// sweep, when set, runs at the start of every round.
	sweep func(now time.Time, set *Set)
	// now, when set, takes endpoints to run the job on at once, between
	// rounds.
	now <-chan *Endpoint
}

// runLoop runs c until ctx is done and its workers have finished.
func (f *Fleet) runLoop(ctx context.Context, c loopConfig) {
	jobs := make(chan *Endpoint)
	var wg sync.WaitGroup
	for range c.workers {
		do := c.newWorker()
		wg.Go(func() {
			for e := range jobs {
				do(ctx, e)
				c.busy(e).Store(false)
			}
		})
	}
	defer func() {
		close(jobs)
		wg.Wait()
	}()
	// hand gives e to a worker unless its job is running; false when ctx
	// is done.
	hand := func(e *Endpoint) bool {
		if !c.busy(e).CompareAndSwap(false, true) {
			return true
		}
		select {
		case jobs <- e:
			return true
		case <-ctx.Done():
			c.busy(e).Store(false)
			return false
		}
	}
	t := time.NewTimer(0) // first round at once
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case e := <-c.now:
			if !hand(e) {
				return
			}
		case now := <-t.C:
			set := f.pool.Load()
			if c.sweep != nil {
				c.sweep(now, set)
			}
			for _, e := range set.Endpoints {
				if !hand(e) {
					return
				}
			}
			t.Reset(jittered(c.interval, c.jitter))
		}
	}
}

// jittered returns d ± up to j×d, uniformly.
func jittered(d time.Duration, j float64) time.Duration {
	if j <= 0 {
		return d
	}
	return time.Duration(float64(d) * (1 + j*(2*rand.Float64()-1)))
}
