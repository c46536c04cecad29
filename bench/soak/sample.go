package soak

import (
	"fmt"
	"io"
	"math"
	"sync"
	"time"
)

// Sample phases.
const (
	PhaseBaseline = "baseline" // kvroute ready, no load yet
	PhaseLoad     = "load"     // requests being sent
	PhaseDrain    = "drain"    // load stopped, requests finishing
	PhaseFinal    = "final"    // drained and settled: the last sample
)

// Sample is one reading of kvroute's resources and the client's counters.
// Values kvroute's /metrics did not give are NaN.
type Sample struct {
	T     float64 `json:"t_s"` // seconds since the load began (negative: baseline)
	Phase string  `json:"phase"`
	Fault string  `json:"fault"` // the fault on at the time, "" for none

	RSSMiB       float64 `json:"rss_mib"`        // /proc/<pid>/status VmRSS
	FDs          float64 `json:"fds"`            // entries of /proc/<pid>/fd
	Goroutines   float64 `json:"goroutines"`     // go_goroutines
	HeapMiB      float64 `json:"heap_inuse_mib"` // go_memstats_heap_inuse_bytes
	InFlight     float64 `json:"in_flight"`      // kvroute_in_flight_requests
	Queued       float64 `json:"queued"`         // kvroute_queued_requests (newer builds)
	IndexEntries float64 `json:"index_entries"`  // kvroute_prefix_index_entries
	IndexMiB     float64 `json:"index_mib"`      // kvroute_prefix_index_bytes
	CPUPercent   float64 `json:"cpu_pct"`        // process_cpu_seconds_total over the interval

	Sent           int64 `json:"sent"`
	OK             int64 `json:"ok"`
	Failed         int64 `json:"failed"`    // clear errors: an error status or SSE error event
	Abandoned      int64 `json:"abandoned"` // by the client, on purpose
	Cut            int64 `json:"cut"`       // streams the pod cut (kill, drop), passed on truncated
	Lost           int64 `json:"lost"`      // neither answered nor clearly failed, no pod cut
	Skipped        int64 `json:"skipped"`   // not sent: the client's in-flight cap was reached
	ClientInFlight int64 `json:"client_in_flight"`
}

// sampler reads samples of the router every interval.
type sampler struct {
	r     *router
	gen   *generator // nil before the load
	flt   *faulter   // nil without faults
	start time.Time  // the load's start (T = 0)
	out   io.Writer  // one progress line per sample; nil: quiet

	mu      sync.Mutex
	phase   string
	samples []Sample
	lastCPU float64
	lastAt  time.Time
	errs    int
	lastErr error
}

func (s *sampler) setPhase(p string) {
	s.mu.Lock()
	s.phase = p
	s.mu.Unlock()
}

// take reads one sample in the current phase and keeps it.
func (s *sampler) take() Sample {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	smp := Sample{T: now.Sub(s.start).Seconds(), Phase: s.phase,
		RSSMiB: math.NaN(), FDs: math.NaN(), Goroutines: math.NaN(), HeapMiB: math.NaN(), InFlight: math.NaN(), Queued: math.NaN(),
		IndexEntries: math.NaN(), IndexMiB: math.NaN(), CPUPercent: math.NaN()}
	if s.flt != nil && s.phase == PhaseLoad {
		smp.Fault = s.flt.current()
	}
	if rss, fds, err := procStatus(s.r.pid); err == nil {
		smp.RSSMiB, smp.FDs = float64(rss)/(1<<20), float64(fds)
	} else {
		s.errs++
		s.lastErr = err
	}
	m, err := s.r.scrape(MetricGoroutines, MetricHeapInuse, MetricInFlight, MetricIndexEntries, MetricIndexBytes, MetricCPU, MetricQueued)
	if err != nil {
		s.errs++
		s.lastErr = err
	}
	get := func(name string, scale float64) float64 {
		if v, ok := m[name]; ok {
			return v * scale
		}
		return math.NaN()
	}
	smp.Goroutines = get(MetricGoroutines, 1)
	smp.HeapMiB = get(MetricHeapInuse, 1.0/(1<<20))
	smp.InFlight = get(MetricInFlight, 1)
	smp.Queued = get(MetricQueued, 1)
	smp.IndexEntries = get(MetricIndexEntries, 1)
	smp.IndexMiB = get(MetricIndexBytes, 1.0/(1<<20))
	if cpu, ok := m[MetricCPU]; ok {
		if !s.lastAt.IsZero() {
			smp.CPUPercent = 100 * (cpu - s.lastCPU) / now.Sub(s.lastAt).Seconds()
		}
		s.lastCPU, s.lastAt = cpu, now
	}
	if g := s.gen; g != nil {
		smp.Sent, smp.OK, smp.Failed, smp.Abandoned = g.sent.Load(), g.ok.Load(), g.failed.Load(), g.abandoned.Load()
		smp.Cut, smp.Lost, smp.Skipped, smp.ClientInFlight = g.cut.Load(), g.lost.Load(), g.skipped.Load(), g.inFlight.Load()
	}
	s.samples = append(s.samples, smp)
	if s.out != nil {
		fmt.Fprintf(s.out, "%7.1fs %-8s rss %6.1f MiB  heap %5.1f MiB  fds %4.0f  goroutines %4.0f  in-flight %3.0f  index %5.0f  cpu %3.0f%%  ok %d  failed %d  abandoned %d  cut %d  lost %d  %s\n",
			smp.T, smp.Phase, smp.RSSMiB, smp.HeapMiB, smp.FDs, smp.Goroutines, smp.InFlight, smp.IndexEntries, smp.CPUPercent,
			smp.OK, smp.Failed, smp.Abandoned, smp.Cut, smp.Lost, smp.Fault)
	}
	return smp
}

// loop samples every interval until stop is closed.
func (s *sampler) loop(interval time.Duration, stop <-chan struct{}, done chan<- struct{}) {
	defer close(done)
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			s.take()
		case <-stop:
			return
		}
	}
}

func (s *sampler) all() []Sample {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Sample(nil), s.samples...)
}
