package discovery

import (
	"fmt"
	"net/http"
	"testing"
	"time"
)

func roomEndpoint(t *testing.T) *Endpoint {
	t.Helper()
	e, err := NewEndpoint("http://10.0.0.1:8000", RoleMixed)
	if err != nil {
		t.Fatal(err)
	}
	e.calib = newCalibrator(CalibrationConfig{}, &e.costs, nil)
	return e
}

// An engine's room: its batch limit once known, a slow start before
// (a third as much again as the most it ran, at least SlowStart); a short
// queue beyond it for requests of a saturated fleet.
func TestRoom(t *testing.T) {
	e := roomEndpoint(t)
	if e.roomLimit() != SlowStart {
		t.Fatalf("a new engine's room limit is %d, want the slow start %d", e.roomLimit(), SlowStart)
	}
	e.SetCosts(&Costs{PeakRunning: 6})
	if e.roomLimit() != 8 {
		t.Fatalf("after 6 running: %d, want 8", e.roomLimit())
	}
	e.SetCosts(&Costs{PeakRunning: 6, Queued: true})
	if e.roomLimit() != 12 {
		t.Fatalf("after 6 running and a queue on a full KV cache: %d, want 12", e.roomLimit())
	}
	e.SetCosts(&Costs{PeakRunning: 1})
	if e.roomLimit() != SlowStart {
		t.Fatalf("after 1 running: %d, want the slow start %d", e.roomLimit(), SlowStart)
	}
	e.SetCosts(&Costs{BatchLimit: 4, PeakRunning: 4})
	var leases []Lease
	for range 3 {
		leases = append(leases, e.Acquire(0))
	}
	if !e.HasRoom() {
		t.Fatal("3 of 4 running: no room")
	}
	leases = append(leases, e.Acquire(0))
	if e.HasRoom() || !e.QueueRoom() {
		t.Fatalf("4 of 4 running: room %v, queue room %v; want none, some", e.HasRoom(), e.QueueRoom())
	}
	for range QueueSlack(4) {
		leases = append(leases, e.Acquire(0))
	}
	if e.QueueRoom() {
		t.Fatal("the short queue is full but has room")
	}
	for _, l := range leases {
		l.Release()
	}
	failing := roomEndpoint(t)
	failing.metricsFailing.Store(true)
	if failing.roomLimit() != 0 {
		t.Fatalf("an engine whose scrape fails has a room limit %d: it would stay capped", failing.roomLimit())
	}
	unscraped, err := New(Options{Scrape: ScrapeConfig{Disabled: true}})
	if err != nil {
		t.Fatal(err)
	}
	blind := roomEndpoint(t)
	blind.owner = unscraped
	if blind.roomLimit() != 0 {
		t.Fatalf("with scraping off the room limit is %d: every engine would stay capped at the slow start", blind.roomLimit())
	}
	llama := roomEndpoint(t)
	llama.SetDialect(DialectLlamaCpp)
	llama.noMetricsUntil.Store(1)
	if llama.roomLimit() != SlowStart {
		t.Fatalf("llama.cpp before its slots: %d, want the slow start", llama.roomLimit())
	}
	llama.info.Store(&EngineInfo{Slots: 2})
	if llama.roomLimit() != 2 {
		t.Fatalf("llama.cpp with 2 slots: %d", llama.roomLimit())
	}
}

// An engine without metrics or slots (Ollama) has room for what the router
// saw it run at once and a third as much again, at least one more: streams
// from their first byte, whole responses from their dispatch; the slow
// start's before it ran anything, whether or not its /metrics was tried.
func TestRoomSeenRunning(t *testing.T) {
	for _, absent := range []bool{false, true} {
		// Ollama's /metrics read before its dialect was known (404) or
		// not: the same room.
		ollama := roomEndpoint(t)
		ollama.SetDialect(DialectOllama)
		if absent {
			ollama.noMetricsUntil.Store(1)
		}
		if ollama.roomLimit() != SlowStart {
			t.Fatalf("an engine without metrics or slots, seen running nothing: %d, want the slow start", ollama.roomLimit())
		}
		var ls []Lease
		for range 3 {
			l := ollama.Acquire(0)
			l.Streams()
			ls = append(ls, l)
		}
		if ollama.roomLimit() != SlowStart {
			t.Fatalf("three streams before a first byte: %d, want the slow start", ollama.roomLimit())
		}
		ls[0].FirstByte(true)
		if ollama.roomLimit() != 2 {
			t.Fatalf("one of three streams running: %d, want 2", ollama.roomLimit())
		}
		for i := range ls {
			ls[i].Release()
		}
		if ollama.awaiting.Load() != 0 {
			t.Fatalf("awaiting %d after every lease ended", ollama.awaiting.Load())
		}
		ls = ls[:0]
		for range 6 { // whole responses run from their dispatch
			ls = append(ls, ollama.Acquire(0))
		}
		ls[0].FirstByte(false)
		if ollama.roomLimit() != 8 {
			t.Fatalf("six whole responses: %d, want 8", ollama.roomLimit())
		}
		for i := range ls {
			ls[i].Release()
		}
	}
}

// A 429 with others of the known requests running is backpressure: the
// engine is full at that load until it falls; a 429 with none running is
// a refusal of everything, backed off.
func TestReportShed(t *testing.T) {
	e := roomEndpoint(t)
	a, b, c := e.Acquire(0), e.Acquire(0), e.Acquire(0)
	if !e.ReportShed(0) {
		t.Fatal("a 429 beside two running is not backpressure")
	}
	if !e.Full() || e.Shedding() {
		t.Fatalf("full %v, shedding %v; want full, not shedding", e.Full(), e.Shedding())
	}
	c.Release() // the refused request's lease: two run, as when it refused
	if !e.Full() {
		t.Fatal("not full at the load it refused at")
	}
	a.Release()
	if e.Full() {
		t.Fatal("still full below the load it refused at")
	}
	b.Release()
	d := e.Acquire(0)
	if e.ReportShed(0) || !e.Shedding() {
		t.Fatal("a 429 with nothing else running is not a refusal")
	}
	d.Release()
}

// A cold router's slow start learns an engine's batch limit by scrapes it
// asks for as its load reaches the limit, not at the scrape rounds (an
// hour apart here): four run, then five are sent and four run while one
// waits, and the limit is four.
// scrapedOnDemand runs a fleet of the one endpoint at url, without
// probes, whose rounds of scrapes are an hour apart (only scrapes asked
// for come), and waits for its first scrape. *ep is set to the endpoint
// before the fleet runs (the pod's handler may read it).
func scrapedOnDemand(t *testing.T, url string, ep **Endpoint) *recorder {
	t.Helper()
	o := Options{Health: HealthConfig{Disabled: true},
		Scrape: ScrapeConfig{Interval: time.Hour, StaleAfter: 2 * time.Hour, Jitter: 0.01}}
	f, rec, eps := staticFleet(t, o, url)
	*ep = eps[0]
	run(t, f)
	rec.wait(t, 0, "scrape", *ep, 1)
	return rec
}

func TestSlowStartScrapesAsItClimbs(t *testing.T) {
	const batch = 4
	var e *Endpoint
	p := startMetricsPod(t, nil)
	p.during = func(*http.Request) {
		n := e.InFlight()
		p.text = fmt.Appendf(nil, "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} %d\nvllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} %d\n",
			min(n, batch), max(0, n-batch))
	}
	rec := scrapedOnDemand(t, p.URL, &e)
	var leases []Lease
	defer func() {
		for _, l := range leases {
			l.Release()
		}
	}()
	climb := func(want int64) {
		for e.HasRoom() {
			leases = append(leases, e.Acquire(0))
		}
		rec.until(t, fmt.Sprintf("room limit %d", want), func() bool { return e.roomLimit() == want })
	}
	climb(rampLimit(batch))
	climb(batch)
	if e.BatchLimit() != batch || e.InFlight() != rampLimit(batch) {
		t.Fatalf("batch limit %d with %d in flight; want %d with %d", e.BatchLimit(), e.InFlight(), batch, rampLimit(batch))
	}
}
