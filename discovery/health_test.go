package discovery

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

// pod is a loopback model server whose /health tests control.
type pod struct {
	*httptest.Server
	// healthy decides /health's answer; failNext fails that many probes
	// first, whatever healthy says.
	healthy  atomic.Bool
	failNext atomic.Int32
	probes   atomic.Int64
}

func startPod(t *testing.T) *pod {
	t.Helper()
	p := &pod{}
	p.healthy.Store(true)
	p.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/health" {
			http.NotFound(w, r)
			return
		}
		p.probes.Add(1)
		if p.failNext.Add(-1) >= 0 || !p.healthy.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		p.failNext.Store(0)
	}))
	t.Cleanup(p.Close)
	return p
}

// probeOptions probes every few milliseconds with the default thresholds.
func probeOptions() Options {
	return Options{
		Health: HealthConfig{Interval: 5 * time.Millisecond, Timeout: time.Second, Jitter: 0.01},
		Scrape: ScrapeConfig{Disabled: true},
	}
}

func staticFleet(t *testing.T, o Options, urls ...string) (*Fleet, *recorder, []*Endpoint) {
	t.Helper()
	f, rec := newFleet(t, o)
	if err := f.AddStatic(RoleMixed, urls); err != nil {
		t.Fatal(err)
	}
	return f, rec, f.Pool().Load().Endpoints
}

// TestProbeDownAndBack: a pod failing its probes leaves routing after the
// failure threshold and returns after the rise threshold, by itself.
func TestProbeDownAndBack(t *testing.T) {
	p := startPod(t)
	f, rec, eps := staticFleet(t, probeOptions(), p.URL)
	e := eps[0]
	run(t, f)
	rec.wait(t, 0, "probe-ok", e, 1)
	if !e.Routable() {
		t.Fatal("healthy pod not routable")
	}

	m := rec.mark()
	p.healthy.Store(false)
	rec.wait(t, m, "down", e, 1)
	if e.Routable() || e.State() != StateDown {
		t.Fatalf("after failing probes: routable %v, state %v", e.Routable(), e.State())
	}
	// The probe that marks the endpoint down records its probe-fail event
	// after the down event: wait for it.
	rec.wait(t, m, "probe-fail", e, DefaultFailThreshold)
	if n := rec.count(m, "probe-fail", e); n < DefaultFailThreshold {
		t.Errorf("down after %d failed probes, want ≥ %d", n, DefaultFailThreshold)
	}

	m = rec.mark()
	p.healthy.Store(true)
	rec.wait(t, m, "up", e, 1)
	if !e.Routable() {
		t.Fatal("recovered pod not routable")
	}
	if n := rec.count(m, "probe-ok", e); n < DefaultRiseThreshold-1 { // the up event precedes its probe-ok
		t.Errorf("up after %d good probes, want ≥ %d", n+1, DefaultRiseThreshold)
	}
	if e.InFlight() != 0 || e.Requests() != 0 {
		t.Error("probes touched the request counters")
	}
	if got := counterValue(t, f, "kvroute_discovery_probe_failures_total"); got < DefaultFailThreshold {
		t.Errorf("probe failures counted %v", got)
	}
}

// TestBusyPodSurvivesOneFailedProbe: a saturated pod that misses one probe
// keeps its traffic and its in-flight count.
func TestBusyPodSurvivesOneFailedProbe(t *testing.T) {
	p := startPod(t)
	f, rec, eps := staticFleet(t, probeOptions(), p.URL)
	e := eps[0]
	e.inFlight.Add(64)
	run(t, f)
	rec.wait(t, 0, "probe-ok", e, 1)

	m := rec.mark()
	p.failNext.Store(1)
	rec.wait(t, m, "probe-fail", e, 1)
	rec.wait(t, m, "probe-ok", e, 5)
	if n := rec.count(m, "down", e); n != 0 || !e.Routable() {
		t.Fatalf("one failed probe evicted a busy pod (down events %d)", n)
	}
	if e.InFlight() != 64 {
		t.Errorf("in-flight = %d, want 64: probes must not touch it", e.InFlight())
	}
}

// TestPassiveEjection: consecutive failures reported by the proxy eject an
// endpoint; the cooldown doubles on repeat; a success breaks the run; the
// ejected share of a pool is capped. The cooldowns are far longer than
// the test, so no ejection can end under a check; the test ends each one
// by calling unEject, as the cooldown's timer does (TestEjectionEndsByItself
// lets the timer do it).
func TestPassiveEjection(t *testing.T) {
	o := quietOptions()
	o.Passive = PassiveConfig{Failures: 3, Cooldown: time.Minute, MaxCooldown: time.Hour, MaxEjectedShare: 0.5}
	f, rec, eps := staticFleet(t, o, "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000", "http://10.0.0.4:8000")
	a, b, c := eps[0], eps[1], eps[2]
	status := func(e *Endpoint) EndpointStatus {
		for _, s := range f.Endpoints() {
			if s.URL == e.URL {
				return s
			}
		}
		t.Fatalf("%s not in introspection", e.URL)
		return EndpointStatus{}
	}

	t.Run("a success breaks the run", func(t *testing.T) {
		a.ReportFailure()
		a.ReportFailure()
		a.ReportSuccess()
		a.ReportFailure()
		a.ReportFailure()
		if !a.Routable() {
			t.Fatal("ejected without 3 consecutive failures")
		}
		if a.Failures.Load() != 4 {
			t.Errorf("Failures = %d, want 4", a.Failures.Load())
		}
	})

	var cooldowns []float64
	for i := range 3 {
		m := rec.mark()
		a.ReportFailure() // the third in a row
		if a.Routable() || a.State() != StateEjected {
			t.Fatalf("ejection %d: routable %v, state %v", i+1, a.Routable(), a.State())
		}
		if n := rec.count(m, "eject", a); n != 1 {
			t.Fatalf("ejection %d: %d eject events", i+1, n)
		}
		st := status(a)
		cooldowns = append(cooldowns, st.CooldownSec)
		if st.Ejections != i+1 || st.EjectedForSec <= 0 || st.EjectedForSec > st.CooldownSec {
			t.Errorf("ejection %d: introspection %+v", i+1, st)
		}
		a.ReportFailure() // failures while ejected do not eject again
		if n := rec.count(m, "eject", a); n != 1 {
			t.Fatalf("ejection %d: ejected again while ejected", i+1)
		}
		f.unEject(a) // the cooldown ends
		if !a.Routable() || rec.count(m, "return", a) != 1 {
			t.Fatalf("not routable after the cooldown")
		}
		a.ReportFailure()
		a.ReportFailure()
	}
	if want := []float64{60, 120, 240}; cooldowns[0] != want[0] || cooldowns[1] != want[1] || cooldowns[2] != want[2] {
		t.Errorf("cooldowns = %v, want %v", cooldowns, want)
	}

	t.Run("share cap", func(t *testing.T) {
		for _, e := range []*Endpoint{a, b, c} {
			for range 3 {
				e.ReportFailure()
			}
		}
		if a.Routable() || b.Routable() || !c.Routable() {
			t.Errorf("routable a=%v b=%v c=%v: want two of four ejected, no more", a.Routable(), b.Routable(), c.Routable())
		}
		if st := status(a); st.CooldownSec != 480 {
			t.Errorf("fourth ejection's cooldown %vs, want 480", st.CooldownSec)
		}
		f.unEject(a)
		f.unEject(b)
		// With a back, c may be ejected now.
		c.ReportFailure()
		if c.Routable() || !a.Routable() {
			t.Errorf("after a returned: c routable %v, a routable %v; want c ejected", c.Routable(), a.Routable())
		}
		f.unEject(c)
	})
	if got := counterValue(t, f, "kvroute_discovery_ejections_total"); got != 6 {
		t.Errorf("ejections counted %v, want 6", got)
	}
}

// TestEjectionEndsByItself: the ejection's own timer ends it after the
// cooldown. The test only waits for the return, so a short cooldown
// races nothing.
func TestEjectionEndsByItself(t *testing.T) {
	o := quietOptions()
	o.Passive = PassiveConfig{Failures: 2, Cooldown: 10 * time.Millisecond, MaxCooldown: time.Second, MaxEjectedShare: 1}
	f, rec, eps := staticFleet(t, o, "http://10.0.0.1:8000", "http://10.0.0.2:8000")
	e := eps[0]
	for range 2 {
		m := rec.mark()
		e.ReportFailure()
		e.ReportFailure()
		if n := rec.count(m, "eject", e); n != 1 {
			t.Fatalf("%d eject events after two failures", n)
		}
		rec.wait(t, m, "return", e, 1)
		if !e.Routable() {
			t.Fatalf("state %v after the return", e.State())
		}
	}
	if got := counterValue(t, f, "kvroute_discovery_ejections_total"); got != 2 {
		t.Errorf("ejections counted %v, want 2", got)
	}
}

// TestEndpointWithoutFleet: endpoints published on a bare Pool count
// failures but are never ejected.
func TestEndpointWithoutFleet(t *testing.T) {
	e, err := NewEndpoint("10.0.0.1:8000", RoleMixed)
	if err != nil {
		t.Fatal(err)
	}
	for range 100 {
		e.ReportFailure()
	}
	if !e.Routable() || e.Failures.Load() != 100 {
		t.Errorf("routable %v failures %d", e.Routable(), e.Failures.Load())
	}
}

func TestOptionsValidation(t *testing.T) {
	for _, tc := range []struct {
		name string
		o    Options
	}{
		{name: "negative probe interval", o: Options{Health: HealthConfig{Interval: -1}}},
		{name: "jitter of 1", o: Options{Health: HealthConfig{Jitter: 1}}},
		{name: "health path", o: Options{Health: HealthConfig{Path: "health"}}},
		{name: "cooldown above max", o: Options{Passive: PassiveConfig{Cooldown: time.Hour}}},
		{name: "share above 1", o: Options{Passive: PassiveConfig{MaxEjectedShare: 2}}},
		{name: "negative drain limit", o: Options{DrainLimit: -time.Second}},
		{name: "negative scrape timeout", o: Options{Scrape: ScrapeConfig{Timeout: -time.Second}}},
		{name: "staleness within the interval", o: Options{Scrape: ScrapeConfig{Interval: 5 * time.Second, StaleAfter: 3 * time.Second}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := New(tc.o); !errors.Is(err, ErrBadConfig) {
				t.Fatalf("err = %v, want ErrBadConfig", err)
			}
		})
	}
	if _, err := New(DefaultOptions()); err != nil {
		t.Errorf("defaults: %v", err)
	}
}
