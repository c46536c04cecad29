package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/kvroute/kvroute/app"
	"github.com/kvroute/kvroute/bench/sim"
)

// The fault suite (issue #12, item 4): simulated pods, a real kvroute
// (app.New with DefaultConfig and static backends unless noted,
// policy prefix), real HTTP clients, and one injected fault per test. Each
// test checks that every request completed or got a clear error (a status
// ≥ 400 with an OpenAI-style JSON error, or a stream visibly cut), that
// kvroute's in-flight counters return to 0, and that no goroutine outlives
// it (faultLeakCheck; TestMain checks the whole package too). The harness
// is in faults_helpers_test.go.

// A pod killed under load, two ways: "closed" (the simulator's Close:
// its streams are cut, the requests it holds are answered 503, its port
// refuses connections) and "crashed" (its node dies: every connection to
// it is reset, its port refuses connections). The streams it was serving
// continue on another pod (issue #28), or, past the retry budget, are cut
// (the client sees an error event, or no [DONE] and a read error); its
// non-streaming requests, answered 503 ("not served") or reset before
// their answer's first byte, are re-sent whole to another pod, or, past
// the retry budget, end with a 5xx JSON error; the other pods' requests
// complete, and later requests succeed on the other pods.
func TestFaultPodKilledUnderLoad(t *testing.T) {
	t.Run("closed", func(t *testing.T) { faultKillUnderLoad(t, false) })
	t.Run("crashed", func(t *testing.T) { faultKillUnderLoad(t, true) })
}

func faultKillUnderLoad(t *testing.T, crash bool) {
	faultLeakCheck(t)
	cfg := faultSimConfig()
	fleet := startFaultFleet(t, 3, cfg)
	backends := fleet.URLs()
	var relays []*faultRelay
	if crash { // every pod behind a relay, whose crash is the node's
		for i := range backends {
			relays = append(relays, startFaultRelay(t, fleet.URL(i)[len("http://"):], 0))
			backends[i] = relays[i].URL()
		}
	}
	r := startFaultRig(t, backends, cfg.Model, nil)
	ctx, cancel := context.WithTimeout(context.Background(), faultGuard)
	defer cancel()
	const streams, plain, tokens = 6, 6, 1000
	sum := func(v []int) int {
		n := 0
		for _, x := range v {
			n += x
		}
		return n
	}

	calls := make([]*faultCall, streams)
	for i := range calls {
		calls[i] = r.open(ctx, faultBody(cfg.Model, fmt.Sprintf("kill stream %d", i), tokens, true), true)
		if !calls[i].event() {
			t.Fatalf("stream %d: no first event: %v", i, calls[i].finish())
		}
	}
	r.waitFor("every stream running", func() bool { return sum(faultRunning(fleet)) == streams })
	onPod := faultRunning(fleet) // streams per pod
	results := make([]faultResult, plain)
	var wg sync.WaitGroup
	for i := range results {
		wg.Go(func() {
			results[i] = r.open(ctx, faultBody(cfg.Model, fmt.Sprintf("kill plain %d", i), tokens, false), false).finish()
		})
	}
	r.waitFor("every request running", func() bool { return sum(faultRunning(fleet)) == streams+plain })
	all := faultRunning(fleet)
	victim := 0
	for i, n := range onPod {
		if n > onPod[victim] {
			victim = i
		}
	}
	statusErrs, retries := r.metric("kvroute_upstream_errors_total", "kind=status"), r.metric("kvroute_retries_total")
	t.Logf("running per pod: streams %v, all %v; killing pod %d", onPod, all, victim)
	if crash {
		relays[victim].crash()
	} else if err := fleet.Pod(victim).Close(); err != nil {
		t.Logf("pod close: %v", err)
	}

	cut := faultStreamsCut(t, calls)
	wg.Wait()
	failed := faultRequestsFailed(t, results)
	answered503 := int(r.metric("kvroute_upstream_errors_total", "kind=status") - statusErrs)
	resent := int(r.metric("kvroute_retries_total") - retries)
	continued := int(r.metric("kvroute_migrations_total", "outcome=continued"))
	t.Logf("after the kill: %d of %d streams continued on another pod, %d cut; %d of %d requests failed (5xx), %d re-sent (%d after the pod's 503)",
		continued, streams, cut, failed, plain, resent, answered503)
	if cut+continued != onPod[victim] {
		t.Errorf("%d streams continued and %d cut, want the %d the killed pod was serving in all", continued, cut, onPod[victim])
	}
	if failed+resent != all[victim]-onPod[victim] {
		t.Errorf("%d requests failed and %d were re-sent, want the %d the killed pod was serving in all",
			failed, resent, all[victim]-onPod[victim])
	}
	if crash && answered503 != 0 {
		t.Errorf("%d 503 answers from a crashed pod", answered503)
	}

	faultCheckAfterKill(t, r, backends[victim])
}

// faultRunning returns the requests each pod of fleet runs.
func faultRunning(fleet *sim.Fleet) []int {
	out := make([]int, fleet.Len())
	for i := range out {
		out[i] = fleet.Pod(i).Stats().Running
	}
	return out
}

// faultStreamsCut finishes the streams of calls and returns how many were
// visibly cut; each of the others must complete.
func faultStreamsCut(t *testing.T, calls []*faultCall) (cut int) {
	t.Helper()
	for i, c := range calls {
		res := c.finish()
		switch {
		case res.completed():
		case res.cut():
			cut++
		default:
			t.Errorf("stream %d: neither complete nor visibly cut: %v", i, res)
		}
	}
	return cut
}

// faultRequestsFailed returns how many of the non-streaming results are a
// 5xx JSON error; each of the others must complete.
func faultRequestsFailed(t *testing.T, results []faultResult) (failed int) {
	t.Helper()
	for i, res := range results {
		switch {
		case res.completed():
		case res.jsonError() && res.Status >= 500:
			failed++
		default:
			t.Errorf("request %d: neither complete nor a 5xx JSON error: %v", i, res)
		}
	}
	return failed
}

// faultCheckAfterKill checks that requests after the kill of the pod at
// victim succeed on the other pods, and that r is idle afterwards.
func faultCheckAfterKill(t *testing.T, r *faultRig, victim string) {
	t.Helper()
	stale := 0
	for i := range 12 {
		res := r.do(fmt.Sprintf("after kill %d", i), 16, i%2 == 0)
		switch {
		case res.completed():
		case faultStaleConnBug(res):
			stale++
			t.Logf("request %d after the kill: %v", i, res)
		default:
			t.Errorf("request %d after the kill: %v", i, res)
		}
	}
	t.Logf("killed pod: %s; retries %v, denied %v", r.endpointState(victim),
		r.metric("kvroute_retries_total"), r.metric("kvroute_retries_budget_exhausted_total"))
	r.checkIdle()
	if stale > 0 {
		t.Errorf("%d later requests got 502 on a pooled connection the closed pod had closed", stale)
	}
}

// faultStaleConnBug reports the answer of a request written on a pooled
// connection its pod had closed and not re-sent: 502 with fasthttp's
// ErrConnectionClosed (fixed: the connection is checked before writing).
func faultStaleConnBug(res faultResult) bool {
	return res.Status == http.StatusBadGateway && strings.Contains(string(res.Body), "closed connection before returning the first response byte")
}

// A pod that shuts down gracefully (closing its idle keep-alive connections,
// as uvicorn does on SIGTERM, before its endpoint leaves DNS or fails a
// probe): a request kvroute then writes on such a pooled connection was
// never received, and must be re-sent (on a new connection, refused, then
// to another pod), not answered 502. Round-robin makes the pods' turns
// deterministic: each of the two pods gets one request, so each has one
// idle pooled connection; pod A closes; the next two requests take one turn
// each.
func TestFaultStaleConnectionAfterPodClose(t *testing.T) {
	faultLeakCheck(t)
	cfg := faultSimConfig()
	fleet := startFaultFleet(t, 2, cfg)
	r := startFaultRig(t, fleet.URLs(), cfg.Model, func(c *app.Config) { c.Policy = "round-robin" })
	for i := range 2 {
		if res := r.do(fmt.Sprintf("warm %d", i), 4, false); !res.completed() {
			t.Fatalf("request %d: %v", i, res)
		}
	}
	if err := fleet.Pod(0).Close(); err != nil {
		t.Logf("pod close: %v", err)
	}
	time.Sleep(50 * time.Millisecond) // the pod's FIN reaches kvroute's idle connection
	var bug []faultResult
	for i := range 2 {
		res := r.do(fmt.Sprintf("after close %d", i), 4, false)
		switch {
		case res.completed():
		case faultStaleConnBug(res):
			bug = append(bug, res)
		default:
			t.Errorf("request %d: %v", i, res)
		}
	}
	retries := r.metric("kvroute_retries_total")
	connectErrs := r.metric("kvroute_upstream_errors_total", "kind=connect")
	r.checkIdle()
	if len(bug) > 0 {
		t.Errorf("a request no pod received got %v; kvroute_retries_total %v, upstream connect errors %v", bug[0], retries, connectErrs)
	}
}

// A pod that does not answer within --response-header-timeout: the client
// gets 504 with a JSON error, and the request is never re-sent (a pod that
// timed out may be generating): every pod stalls, and each request is
// held by exactly one of them.
func TestFaultStallBeforeFirstByte(t *testing.T) {
	faultLeakCheck(t)
	cfg := faultSimConfig()
	cfg.Faults.StallFirstByte = sim.Duration(faultGuard) // until the pods close
	fleet := startFaultFleet(t, 2, cfg)
	r := startFaultRig(t, fleet.URLs(), cfg.Model, func(c *app.Config) {
		c.ResponseHeaderTimeout = 300 * time.Millisecond
	})
	stalled := func() int {
		n := 0
		for i := range fleet.Len() {
			n += fleet.Pod(i).Stats().Stalled
		}
		return n
	}
	const n = 4
	for i := range n {
		res := r.do(fmt.Sprintf("stall %d", i), 16, i%2 == 1)
		if res.Status != http.StatusGatewayTimeout || !res.jsonError() {
			t.Errorf("request %d: want a 504 JSON error, got %v", i, res)
		}
		if got := stalled(); got != i+1 {
			t.Errorf("after request %d the pods hold %d requests, want %d: a timed-out request was re-sent", i, got, i+1)
		}
	}
	if v := r.metric("kvroute_retries_total"); v != 0 {
		t.Errorf("kvroute_retries_total = %v, want 0: no retry after a timeout", v)
	}
	if v := r.metric("kvroute_upstream_errors_total", "kind=timeout"); v != n {
		t.Errorf("upstream timeouts = %v, want %d", v, n)
	}
	r.checkIdle()
}

// A pod whose stream stops mid-answer (a relay freezes its bytes, the
// connection stays open): the stream ends at --stream-idle-timeout, cut
// (no [DONE]), kvroute counts an upstream body error and closes the
// upstream connection, and the pod aborts the request.
func TestFaultStallMidStream(t *testing.T) {
	faultLeakCheck(t)
	cfg := faultSimConfig()
	fleet := startFaultFleet(t, 1, cfg)
	relay := startFaultRelay(t, fleet.URL(0)[len("http://"):], 0)
	r := startFaultRig(t, []string{relay.URL()}, cfg.Model, func(c *app.Config) {
		c.StreamIdleTimeout = 300 * time.Millisecond
	})
	ctx, cancel := context.WithTimeout(context.Background(), faultGuard)
	defer cancel()
	c := r.open(ctx, faultBody(cfg.Model, "stall mid-stream", 5000, true), true)
	for range 3 {
		if !c.event() {
			t.Fatalf("stream ended early: %v", c.finish())
		}
	}
	relay.frozen.Store(true)
	res := c.finish()
	if !res.cut() {
		t.Fatalf("want a cut stream, got %v", res)
	}
	if v := r.metric("kvroute_upstream_errors_total", "kind=body"); v != 1 {
		t.Errorf("upstream body errors = %v, want 1", v)
	}
	if logs := r.logs.FilterMessage("upstream body failed").All(); len(logs) != 1 ||
		!strings.Contains(fmt.Sprint(logs[0].ContextMap()["error"]), "timeout") {
		t.Errorf("want one upstream body failure, a timeout; logged %v", logs)
	}
	pod := fleet.Pod(0)
	r.waitFor("the pod to abort the stalled request", func() bool { return podAborted(t, pod) == 1 })
	if v := podFinished(t, pod); v != 0 {
		t.Errorf("the pod finished %v requests, want 0", v)
	}
	t.Logf("cut after %d events; the pod sent %d bytes", res.Events, relay.fromPod.Load())
	r.checkIdle()
}

// The same stall with a second pod (issue #28): the stalled stream
// continues on the other pod once --stream-idle-timeout passes, and the
// client reads it to the end, every token and no error; the stalled pod
// aborts its request.
func TestFaultStallMidStreamContinues(t *testing.T) {
	faultLeakCheck(t)
	cfg := faultSimConfig()
	cfg.EOSProbability = 0 // every answer is max_tokens long
	fleet := startFaultFleet(t, 2, cfg)
	relays := []*faultRelay{startFaultRelay(t, fleet.URL(0)[len("http://"):], 0), startFaultRelay(t, fleet.URL(1)[len("http://"):], 0)}
	r := startFaultRig(t, []string{relays[0].URL(), relays[1].URL()}, cfg.Model, func(c *app.Config) {
		c.StreamIdleTimeout = 300 * time.Millisecond
	})
	ctx, cancel := context.WithTimeout(context.Background(), faultGuard)
	defer cancel()
	const tokens = 400
	c := r.open(ctx, faultBody(cfg.Model, "stall mid-stream, then elsewhere", tokens, true), true)
	for range 3 {
		if !c.event() {
			t.Fatalf("stream ended early: %v", c.finish())
		}
	}
	victim := 0
	if relays[1].fromPod.Load() > relays[0].fromPod.Load() {
		victim = 1
	}
	relays[victim].frozen.Store(true)
	res := c.finish()
	if !res.completed() || res.Events < tokens {
		t.Fatalf("want the whole stream (%d events), got %v", tokens, res)
	}
	if v := r.metric("kvroute_migrations_total", "cause=timeout", "outcome=continued"); v != 1 {
		t.Errorf("streams continued after the idle timeout = %v, want 1", v)
	}
	r.waitFor("the stalled pod to abort its request", func() bool { return podAborted(t, fleet.Pod(victim)) == 1 })
	t.Logf("%d events; the stalled pod %d", res.Events, victim)
	r.checkIdle()
}

// Pods that all drop their connections mid-stream (DropAfterTokens): each
// stream is continued on another pod (issue #28), which drops it too, until
// --max-migrations (2) or the retry budget is spent; then the client sees
// a visibly cut stream of 5 events per leg. kvroute counts an upstream
// body error per failed leg; non-streaming answers are not affected.
func TestFaultDropMidStream(t *testing.T) {
	faultLeakCheck(t)
	cfg := faultSimConfig()
	cfg.Faults.DropAfterTokens = 5
	fleet := startFaultFleet(t, 2, cfg)
	r := startFaultRig(t, fleet.URLs(), cfg.Model, nil)
	const n = 3
	events := 0
	for i := range n {
		res := r.do(fmt.Sprintf("drop %d", i), 50, true)
		if !res.cut() || res.Events == 0 || res.Events > 15 || res.Events%5 != 0 {
			t.Errorf("stream %d: want 5 events per leg, at most 3 legs, then a cut; got %v", i, res)
		}
		events += res.Events
	}
	if res := r.do("drop plain", 50, false); !res.completed() {
		t.Errorf("non-streaming request: %v", res)
	}
	continued := r.metric("kvroute_migrations_total", "outcome=continued")
	if v := r.metric("kvroute_upstream_errors_total", "kind=body"); v != n+continued || events != 5*int(n+continued) {
		t.Errorf("upstream body errors = %v, %v events, want %v and %v (%v legs continued)", v, events, n+continued, 5*(n+continued), continued)
	}
	r.checkIdle()
}

// Error storms: pods answering every inference request with 500, 503 or
// 429, first one pod of three, then all of them. 503 and 429 say "not
// served" and are re-sent to another pod, 500 is passed on; retries stay
// within the retry budget (20% of requests, at least 3, per 10 s), a pod
// failing with 5xx is ejected after --eject-failures consecutive failures
// (never more than half of the pool), 429 never ejects.
func TestFaultErrorStorm(t *testing.T) {
	for _, tc := range []faultStorm{
		{status: 500}, {status: 503}, {status: 429},
		{status: 500, all: true}, {status: 503, all: true}, {status: 429, all: true},
	} {
		t.Run(tc.name(), tc.run)
	}
}

// faultStorm is an error storm: the first pod of three (all three: all)
// answers every inference request with status.
type faultStorm struct {
	status int
	all    bool
}

func (tc faultStorm) name() string {
	if tc.all {
		return fmt.Sprintf("all pods %d", tc.status)
	}
	return fmt.Sprintf("one pod %d", tc.status)
}

// stormFigures are what a storm's requests got (answers by status, 200
// for a completed one) and kvroute's counters afterwards; state is the
// first pod's endpoint state.
type stormFigures struct {
	got                                    map[int]int
	retries, denied, ejections, statusErrs float64
	state                                  string
}

func (tc faultStorm) run(t *testing.T) {
	faultLeakCheck(t)
	good := faultSimConfig()
	bad := good
	bad.Faults.ErrorRate, bad.Faults.ErrorStatus = 1, tc.status
	cfgs := []sim.Config{bad, good, good}
	if tc.all {
		cfgs = []sim.Config{bad, bad, bad}
	}
	for i := range cfgs {
		cfgs[i].Seed += uint64(i)
	}
	fleet, err := sim.StartFleetOf(cfgs...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fleet.Close() })
	// A long cooldown: an ejected pod stays out for the whole test
	// however slow the machine.
	r := startFaultRig(t, fleet.URLs(), good.Model, func(c *app.Config) { c.EjectCooldown = time.Minute })
	const n = 30
	start := time.Now()
	f := stormFigures{got: map[int]int{}}
	for i := range n {
		res := r.do(fmt.Sprintf("storm %d", i), 8, i%2 == 1)
		switch {
		case res.completed():
			f.got[200]++
		case res.jsonError():
			f.got[res.Status]++
		default:
			t.Errorf("request %d: %v", i, res)
		}
	}
	elapsed := time.Since(start)
	mfs := r.metrics()
	f.retries = faultSum(mfs["kvroute_retries_total"])
	f.denied = faultSum(mfs["kvroute_retries_budget_exhausted_total"])
	f.ejections = faultSum(mfs["kvroute_discovery_ejections_total"])
	f.statusErrs = faultSum(mfs["kvroute_upstream_errors_total"], "kind=status") // answers re-sent
	f.state = r.endpointState(fleet.URL(0))
	t.Logf("answers %v; retries %v, denied by the budget %v, re-sent answers %v, ejections %v, pod 0 %s",
		f.got, f.retries, f.denied, f.statusErrs, f.ejections, f.state)

	// The retry budget over the test's 10 s windows.
	windows := int(elapsed/(10*time.Second)) + 1
	budget := max(float64(r.cfg.MinRetries*windows), r.cfg.RetryBudget*n+float64(r.cfg.MinRetries*(windows-1)))
	if f.retries > budget {
		t.Errorf("%v retries for %d requests: above the retry budget (%v)", f.retries, n, budget)
	}
	tc.check(t, r.cfg, n, f)
	r.checkIdle()
}

// check checks the figures f of n requests in the storm against what
// kvroute, configured by cfg, should have done with them.
func (tc faultStorm) check(t *testing.T, cfg app.Config, n int, f stormFigures) {
	t.Helper()
	ejectable := 1 // at most half of the 3 pods
	switch {
	case tc.status == 500 && !tc.all:
		// Passed on until the pod is ejected, then answered by the others.
		if f.retries != 0 || f.got[500] > cfg.EjectFailures || f.got[200]+f.got[500] != n {
			t.Errorf("want ≤ %d 500s passed on, the rest answered, no retry", cfg.EjectFailures)
		}
		if f.got[500] == cfg.EjectFailures && (f.ejections != 1 || f.state != "ejected") {
			t.Errorf("the failing pod was not ejected after %d failures", f.got[500])
		}
	case !tc.all:
		// Re-sent to a good pod unless the budget was spent; a 503
		// pod is ejected, a 429 one never.
		if float64(f.got[tc.status]) != f.denied || f.got[200]+f.got[tc.status] != n {
			t.Errorf("want every %d passed on to be a retry the budget denied (%v denied)", tc.status, f.denied)
		}
		if f.statusErrs != f.retries {
			t.Errorf("%v answers re-sent, %v retries", f.statusErrs, f.retries)
		}
		if tc.status == 429 && (f.ejections != 0 || f.state != "up") {
			t.Errorf("a pod answering 429 was ejected")
		}
		// The bad pod answered statusErrs + got[503] requests, all
		// failures in a row.
		if tc.status == 503 && int(f.statusErrs)+f.got[503] >= cfg.EjectFailures && (f.ejections != 1 || f.state != "ejected") {
			t.Errorf("the failing pod was not ejected after %v failures", int(f.statusErrs)+f.got[503])
		}
	default:
		// Every answer is the pods' error, passed on.
		if f.got[tc.status] != n {
			t.Errorf("want %d answers %d", n, tc.status)
		}
		if tc.status == 500 && f.retries != 0 {
			t.Errorf("500 must not be retried")
		}
		if tc.status != 500 && f.denied == 0 {
			t.Errorf("the budget never denied a retry")
		}
		if tc.status == 429 && f.ejections != 0 || f.ejections > float64(ejectable) {
			t.Errorf("%v ejections", f.ejections)
		}
	}
}

// faultZone is a DNS server on 127.0.0.1 that answers a headless Service's
// SRV query (_http._tcp.NAME: one target per pod, its port, and the target's
// A record 127.0.0.1 in the additional section) like CoreDNS; it can stop
// and start again on the same address.
type faultZone struct {
	name  string
	mu    sync.Mutex
	ports []int
	addr  string
	srv   *dns.Server
	done  chan struct{}
}

func (z *faultZone) set(ports ...int) {
	z.mu.Lock()
	z.ports = ports
	z.mu.Unlock()
}

// start serves on z.addr (a new port the first time).
func (z *faultZone) start(t *testing.T) {
	t.Helper()
	addr := z.addr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	var pc net.PacketConn
	var err error
	for range 100 { // the port was just released; rebinding UDP may race
		if pc, err = net.ListenPacket("udp", addr); err == nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	z.addr = pc.LocalAddr().String()
	mux := dns.NewServeMux()
	mux.HandleFunc(".", z.serve)
	started := make(chan struct{})
	z.srv = &dns.Server{PacketConn: pc, Handler: mux, NotifyStartedFunc: func() { close(started) }}
	z.done = make(chan struct{})
	go func() { defer close(z.done); _ = z.srv.ActivateAndServe() }()
	select {
	case <-started:
	case <-time.After(faultGuard):
		t.Fatal("the DNS server did not start")
	}
}

// stop shuts the server down and waits for it.
func (z *faultZone) stop() {
	if z.srv == nil {
		return
	}
	_ = z.srv.Shutdown()
	<-z.done
	z.srv = nil
}

func (z *faultZone) serve(w dns.ResponseWriter, req *dns.Msg) {
	m := new(dns.Msg)
	m.SetReply(req)
	z.mu.Lock()
	ports := z.ports
	z.mu.Unlock()
	target := func(port int) string { return "pod-" + strconv.Itoa(port) + "." + z.name }
	hdr := func(name string, typ uint16) dns.RR_Header {
		return dns.RR_Header{Name: name, Rrtype: typ, Class: dns.ClassINET, Ttl: 1}
	}
	for _, q := range req.Question {
		switch {
		case q.Name == "_http._tcp."+z.name && q.Qtype == dns.TypeSRV:
			for _, p := range ports {
				m.Answer = append(m.Answer, &dns.SRV{Hdr: hdr(q.Name, dns.TypeSRV), Priority: 0, Weight: 50,
					Port: uint16(p), Target: target(p)})
				m.Extra = append(m.Extra, &dns.A{Hdr: hdr(target(p), dns.TypeA), A: net.IPv4(127, 0, 0, 1)})
			}
		case q.Qtype == dns.TypeA && slices.ContainsFunc(ports, func(p int) bool { return q.Name == target(p) }):
			m.Answer = append(m.Answer, &dns.A{Hdr: hdr(q.Name, dns.TypeA), A: net.IPv4(127, 0, 0, 1)})
		case q.Name == "_http._tcp."+z.name || q.Name == z.name:
			// NOERROR, no records of this type
		default:
			m.Rcode = dns.RcodeNameError
		}
	}
	_ = w.WriteMsg(m)
}

// The DNS server gone and back: kvroute discovers pods A and B through a
// headless Service's SRV records; with the DNS server stopped, its lookups
// fail and it keeps routing to A and B; when the server returns answering
// B and C, kvroute follows: C takes traffic, A none.
func TestFaultDNSGoneAndBack(t *testing.T) {
	faultLeakCheck(t)
	cfg := faultSimConfig()
	fleet := startFaultFleet(t, 3, cfg)
	port := func(i int) int {
		_, p, _ := net.SplitHostPort(fleet.URL(i)[len("http://"):])
		n, _ := strconv.Atoi(p)
		return n
	}
	z := &faultZone{name: "vllm.llm.svc.cluster.local."}
	z.set(port(0), port(1))
	z.start(t)
	t.Cleanup(z.stop)
	r := startFaultRig(t, nil, cfg.Model, func(c *app.Config) {
		c.Service, c.DNSServer, c.DNSResolvConf = "vllm.llm.svc.cluster.local:http", z.addr, ""
		c.DNSInterval = 200 * time.Millisecond
	})
	urls := func() []string {
		var out []string
		for _, e := range r.rt.Pool.Load().Endpoints {
			out = append(out, e.URL)
		}
		slices.Sort(out)
		return out
	}
	want := func(pods ...int) []string {
		var out []string
		for _, i := range pods {
			out = append(out, fleet.URL(i))
		}
		slices.Sort(out)
		return out
	}
	served := func() []float64 {
		out := make([]float64, fleet.Len())
		for i := range out {
			out[i] = podFinished(t, fleet.Pod(i))
		}
		return out
	}
	send := func(phase string, n int) {
		for i := range n {
			if res := r.do(fmt.Sprintf("dns %s %d", phase, i), 8, i%2 == 0); !res.completed() {
				t.Errorf("%s: request %d: %v", phase, i, res)
			}
		}
	}
	r.waitFor("pods A and B discovered", func() bool { return slices.Equal(urls(), want(0, 1)) })
	send("before", 8)

	// The DNS server goes away: lookups fail, the endpoints stay.
	failures := r.metric("kvroute_discovery_dns_failures_total")
	z.stop()
	r.waitFor("failed DNS lookups", func() bool { return r.metric("kvroute_discovery_dns_failures_total") >= failures+3 })
	if got := urls(); !slices.Equal(got, want(0, 1)) {
		t.Fatalf("endpoints during the DNS outage: %v, want %v", got, want(0, 1))
	}
	before := served()
	send("outage", 8)
	after := served()
	if after[0]+after[1]-before[0]-before[1] != 8 {
		t.Errorf("during the outage A and B served %v then %v", before, after)
	}

	// It comes back with a changed answer: B and C.
	z.set(port(1), port(2))
	z.start(t)
	r.waitFor("kvroute to follow the new answer", func() bool { return slices.Equal(urls(), want(1, 2)) })
	before = served()
	for i := 0; served()[2] == before[2]; i++ {
		if i == 50 {
			t.Fatalf("pod C never served: %v", served())
		}
		send(fmt.Sprintf("back-%d", i), 1)
	}
	if got := served(); got[0] != before[0] {
		t.Errorf("pod A, gone from DNS, served %v requests after the change", got[0]-before[0])
	}
	r.checkIdle()
}

// A very slow reader of a long stream: kvroute holds no more than a small
// buffer of it. The pod (behind a counting relay) generates the whole
// answer, but its bytes leave it only as the client reads: when the
// generation is over, most of the answer has not been written, and the
// live heap outside the pod and the test's own client and relay has not
// grown by anything near the answer's size. (The simulated pod formats the
// tokens generated while its write was blocked into one chunk: its own
// memory grows, as a real engine's output queue would; it is left out.)
func TestFaultSlowReader(t *testing.T) {
	faultLeakCheck(t)
	cfg := faultSimConfig()
	cfg.TimeScale = 100
	fleet := startFaultFleet(t, 1, cfg)
	relay := startFaultRelay(t, fleet.URL(0)[len("http://"):], 32<<10)
	r := startFaultRig(t, []string{relay.URL()}, cfg.Model, nil)
	pod := fleet.Pod(0)
	// The slow client's socket has a small fixed receive buffer, so that
	// the kernel does not hold much of the answer on its side either.
	tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err == nil {
			_ = c.(*net.TCPConn).SetReadBuffer(32 << 10)
		}
		return c, err
	}}
	defer tr.CloseIdleConnections()
	const n, tokens = 32, 4000 // 128,000 SSE events, ≈ 31 MB
	// Every allocation from here on is profiled, and attributed.
	defer func(rate int) { runtime.MemProfileRate = rate }(runtime.MemProfileRate)
	runtime.MemProfileRate = 1
	// Not kvroute's: the pod, the test (its client's buffer, the relay)
	// and net/http's client (the test's; kvroute's probes are not on the
	// stream's path).
	others := []string{"kvroute/bench/sim.", "github.com/kvroute/kvroute.Test", "github.com/kvroute/kvroute.(*fault",
		"net/http.(*persistConn)", "net/http.(*Transport)"}
	kv0 := faultLiveHeap(others...)
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)

	ctx, cancel := context.WithTimeout(context.Background(), faultGuard)
	defer cancel()
	body := fmt.Sprintf(`{"model":%q,"prompt":"a slow reader","max_tokens":%d,"n":%d,"stream":true}`, cfg.Model, tokens, n)
	c := r.openWith(&http.Client{Transport: tr}, ctx, body, true)
	if c.res.Err != nil || c.res.Status != http.StatusOK {
		t.Fatalf("%v", c.finish())
	}
	// Read 1 KiB every 10 ms until the pod has generated every token.
	buf := make([]byte, 1024)
	deadline := time.Now().Add(faultGuard)
	for podCounter(t, pod, "vllm:generation_tokens_total") < n*tokens {
		if time.Now().After(deadline) {
			t.Fatal("the pod never finished generating")
		}
		if _, err := c.br.Read(buf); err != nil {
			t.Fatalf("read: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	kv1 := faultLiveHeap(others...)
	runtime.ReadMemStats(&m1)
	sent, read := relay.fromPod.Load(), c.buf.Len()
	runtime.MemProfileRate = 512 << 10
	res := c.finish()
	total := int64(len(res.Body))
	growth := kv1 - kv0
	t.Logf("answer %d bytes; when generated: the client had read %d, the pod had sent %d; "+
		"live heap without the pod and the client grew %d bytes (%d to %d); the whole live heap %d to %d",
		total, read, sent, growth, kv0, kv1, m0.HeapAlloc, m1.HeapAlloc)
	if !res.completed() {
		t.Fatalf("the stream did not complete: %v", res)
	}
	if total < 16<<20 {
		t.Fatalf("answer of %d bytes: too short for the test", total)
	}
	if sent > total/2 {
		t.Errorf("the pod had sent %d of %d bytes to a client that read %d: its writes did not block", sent, total, read)
	}
	if growth > total/16 {
		t.Errorf("the live heap (without the pod and the client) grew by %d bytes for an answer of %d", growth, total)
	}
	r.checkIdle()
}

// Clients that leave: mid-stream (the body closed after a few events) and
// before the first byte (the pod holds the request; the client gives up).
// kvroute closes the upstream connection, the pod aborts the request, the
// request is counted 499 and nothing stays in flight.
func TestFaultClientLeaves(t *testing.T) {
	t.Run("mid-stream", func(t *testing.T) {
		faultLeakCheck(t)
		cfg := faultSimConfig()
		fleet := startFaultFleet(t, 1, cfg)
		r := startFaultRig(t, fleet.URLs(), cfg.Model, nil)
		pod := fleet.Pod(0)
		ctx, cancel := context.WithTimeout(context.Background(), faultGuard)
		defer cancel()
		c := r.open(ctx, faultBody(cfg.Model, "leave mid-stream", 5000, true), true)
		for range 3 {
			if !c.event() {
				t.Fatalf("stream ended early: %v", c.finish())
			}
		}
		c.resp.Body.Close() // the client leaves
		r.waitFor("the pod to abort the request", func() bool {
			st := pod.Stats()
			return podAborted(t, pod) == 1 && st.Running == 0 && st.Waiting == 0
		})
		if v := podFinished(t, pod); v != 0 {
			t.Errorf("the pod finished %v requests, want 0", v)
		}
		r.checkIdle()
		if v := r.metric("kvroute_requests_total", "code=499"); v != 1 {
			t.Errorf("requests counted 499: %v, want 1", v)
		}
	})
	t.Run("before the first byte", func(t *testing.T) {
		faultLeakCheck(t)
		cfg := faultSimConfig()
		cfg.Faults.StallUntilRelease = true
		fleet := startFaultFleet(t, 1, cfg)
		r := startFaultRig(t, fleet.URLs(), cfg.Model, nil)
		pod := fleet.Pod(0)
		for i, stream := range []bool{true, false} {
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan faultResult, 1)
			go func() {
				done <- r.open(ctx, faultBody(cfg.Model, fmt.Sprintf("leave early %d", i), 16, stream), stream).finish()
			}()
			r.waitFor("the pod to hold the request", func() bool { return pod.Stats().Stalled == i+1 })
			cancel() // the client leaves
			select {
			case res := <-done:
				if res.Err == nil {
					t.Errorf("the request did not fail: %v", res)
				}
			case <-time.After(faultGuard):
				t.Fatal("the client's request did not end")
			}
			r.waitFor("kvroute to cancel the upstream request", func() bool {
				return r.metric("kvroute_upstream_cancellations_total") == float64(i+1)
			})
			r.checkIdle()
		}
		if v := r.metric("kvroute_requests_total", "code=499"); v != 2 {
			t.Errorf("requests counted 499: %v, want 2", v)
		}
		// Once released, the pod finds the streaming request's connection
		// closed and aborts it. (The simulator, unlike vLLM, runs a
		// non-streaming request to its end whatever its connection.)
		pod.ReleaseStalls()
		r.waitFor("the pod to abort the streaming request", func() bool {
			st := pod.Stats()
			return podAborted(t, pod) == 1 && st.Running == 0 && st.Waiting == 0 && st.Stalled == 0
		})
		r.checkIdle()
	})
}

// SIGTERM under load (Run's context cancelled while streams are in
// flight): new connections are refused, the streams complete within the
// drain timeout, Run returns nil.
func TestFaultDrainUnderLoad(t *testing.T) {
	faultLeakCheck(t)
	cfg := faultSimConfig()
	fleet := startFaultFleet(t, 2, cfg)
	r := startFaultRig(t, fleet.URLs(), cfg.Model, nil)
	ctx, cancel := context.WithTimeout(context.Background(), faultGuard)
	defer cancel()
	const streams = 6
	calls := make([]*faultCall, streams)
	for i := range calls {
		calls[i] = r.open(ctx, faultBody(cfg.Model, fmt.Sprintf("drain %d", i), 600, true), true)
		if !calls[i].event() {
			t.Fatalf("stream %d: no first event: %v", i, calls[i].finish())
		}
	}
	r.cancel() // SIGTERM
	r.waitFor("new connections to be refused", func() bool {
		c, err := net.DialTimeout("tcp", r.api, time.Second)
		if err != nil {
			return true
		}
		c.Close()
		return false
	})
	results := make([]faultResult, streams)
	var wg sync.WaitGroup
	for i, c := range calls {
		wg.Go(func() { results[i] = c.finish() })
	}
	wg.Wait()
	for i, res := range results {
		if !res.completed() {
			t.Errorf("stream %d cut by the drain: %v", i, res)
		}
	}
	if err := r.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if n := r.poolInFlight(); n != 0 {
		t.Errorf("%d requests in flight after the drain", n)
	}
	if w := r.logs.FilterMessage("drain incomplete").Len(); w != 0 {
		t.Errorf("the drain was incomplete")
	}
	var finished float64
	for i := range fleet.Len() {
		finished += podFinished(t, fleet.Pod(i))
	}
	if finished != streams {
		t.Errorf("the pods finished %v requests, want %d", finished, streams)
	}
}
