package proxy

import (
	"bytes"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// startPrefixOnPods starts n simulated pods (time scale 100) behind the
// proxy with the prefix policy, and returns their configuration.
func startPrefixOnPods(t *testing.T, n int) (sim.Config, *sim.Fleet, *harness) {
	cfg := sim.DefaultConfig()
	cfg.TimeScale = 100
	fleet := startSimFleet(t, n, cfg)
	policy := routing.NewPrefix(prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: 1000}), 1024, routing.DefaultPrefixParams())
	return cfg, fleet, startProxy(t, policy, Options{Learner: policy}, fleet.URLs()...)
}

// Under a hot prefix the prefix policy keeps requests on the pod that
// caches the prefix until that pod saturates, then spills to an idle pod,
// where the prefix becomes warm too. The saturation is made deterministic:
// the warm pod holds every request it gets (a stall fault) until the test
// releases them, so its in-flight count only grows.
func TestHotPrefixSpillsOnSimulatedPods(t *testing.T) {
	cfg, fleet, h := startPrefixOnPods(t, 3)

	system := strings.Repeat("You are the support assistant of a large company; follow the policy. ", 120) // ≈ 2k tokens
	send := func(i int) {
		body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":8}`, cfg.Model, system+fmt.Sprintf(" Question %d?", i))
		resp := post(t, h.url+"/v1/completions", body)
		if got := readAll(t, resp); resp.StatusCode != 200 {
			t.Errorf("status %d: %s", resp.StatusCode, got)
		}
	}
	send(0) // the prefix's home pod caches it
	var home int
	for i, e := range h.pool.Load().Endpoints {
		if e.Requests() == 1 {
			home = i
		}
	}
	if err := fleet.Pod(home).SetFaults(sim.Faults{StallUntilRelease: true}); err != nil {
		t.Fatal(err)
	}

	var wg sync.WaitGroup
	for i := 1; i <= 40; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); send(i) }()
	}
	// Every request not stalled at home completes; wait for those.
	deadline := time.Now().Add(20 * time.Second)
	for {
		held := h.pool.Load().Endpoints[home].InFlight()
		done := int64(0)
		for i, e := range h.pool.Load().Endpoints {
			if i != home {
				done += int64(e.Requests()) - e.InFlight()
			}
		}
		if held+done == 40 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d held at home, %d done elsewhere, of 40", held, done)
		}
		time.Sleep(time.Millisecond)
	}
	fleet.Pod(home).ReleaseStalls()
	_ = fleet.Pod(home).SetFaults(sim.Faults{})
	wg.Wait()
	h.waitIdle(t)

	reasons := map[string]float64{}
	for _, r := range []string{routing.ReasonWarm, routing.ReasonSpill, routing.ReasonCold} {
		reasons[r] = counterValue(t, h.reg, "kvroute_routing_decisions_total", map[string]string{"reason": r})
	}
	atHome := h.pool.Load().Endpoints[home].Requests() - 1
	if reasons[routing.ReasonSpill] == 0 || atHome >= 40 || atHome < 10 {
		t.Fatalf("reasons %v, %d of 40 at the saturated home", reasons, atHome)
	}
	if reasons[routing.ReasonWarm] < 35 {
		t.Fatalf("after the spill the prefix should be warm on the new pod: reasons %v", reasons)
	}
	t.Logf("reasons %v; %d of 40 stayed on the saturated home", reasons, atHome)
}

// A request passed on unparsed (a router or a scraper in front GETting the
// engines' /metrics and /health through the API port) reaches an engine
// but is no routing decision: only the completion is counted.
func TestPassThroughIsNoDecision(t *testing.T) {
	cfg, _, h := startPrefixOnPods(t, 1)
	for _, path := range []string{"/metrics", "/health"} {
		resp, err := http.Get(h.url + path)
		if err != nil {
			t.Fatal(err)
		}
		if readAll(t, resp); resp.StatusCode != 200 {
			t.Fatalf("GET %s: %d", path, resp.StatusCode)
		}
	}
	resp := post(t, h.url+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"hello","max_tokens":4}`, cfg.Model))
	if got := readAll(t, resp); resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, got)
	}
	h.waitIdle(t)
	var n float64
	for _, r := range []string{routing.ReasonWarm, routing.ReasonSpill, routing.ReasonCold} {
		n += counterValue(t, h.reg, "kvroute_routing_decisions_total", map[string]string{"reason": r})
	}
	if n != 1 {
		t.Fatalf("%v routing decisions counted, want the completion's only", n)
	}
}

// pickLog is the prefix policy, recording each pick's request name (the
// prompt's "#name" tail) and endpoint.
type pickLog struct {
	*routing.Prefix
	mu    sync.Mutex
	picks []string // "name@endpoint URL"
}

func (l *pickLog) Pick(r *routing.Request, set *discovery.Set) routing.Decision {
	d := l.Prefix.Pick(r, set)
	if d.Endpoint != nil {
		name, _, _ := strings.Cut(string(r.Body[bytes.LastIndexByte(r.Body, '#')+1:]), `"`)
		l.mu.Lock()
		l.picks = append(l.picks, name+"@"+d.Endpoint.URL)
		l.mu.Unlock()
	}
	return d
}

// wait returns the picks once there are n.
func (l *pickLog) wait(t *testing.T, n int) []string {
	t.Helper()
	for deadline := time.Now().Add(guard); ; time.Sleep(time.Millisecond) {
		l.mu.Lock()
		picks := slices.Clone(l.picks)
		l.mu.Unlock()
		if len(picks) >= n {
			return picks
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d picks, want %d: %q", len(picks), n, picks)
		}
	}
}

// Through the proxy, on simulated pods that each take one request of the
// router (--max-in-flight-per-endpoint 1) and hold it until released: a
// backlog's freed place goes to the waiter whose prompt is cached where it
// freed, not to the first waiter, whose own pod is busy (it would
// recompute its prompt there and copy it).
func TestWarmGrantOnSimulatedPods(t *testing.T) {
	cfg := sim.DefaultConfig()
	cfg.TimeScale = 100
	cfg.Faults.StallUntilRelease = true
	fleet := startSimFleet(t, 2, cfg)
	policy := &pickLog{Prefix: routing.NewPrefix(prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: 1000}), 1024, routing.DefaultPrefixParams())}
	h := startProxy(t, policy, Options{Learner: policy, Warm: policy.WarmRoom,
		Limits: Limits{MaxInFlightPerEndpoint: 1, QueueTimeout: guard, MaxQueue: 100}}, fleet.URLs()...)

	var wg sync.WaitGroup
	send := func(group, name string) {
		system := strings.Repeat(fmt.Sprintf("[group %s] follow the support policy. ", group), 80) // 2.7 KB
		body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":4}`, cfg.Model, system+"#"+name)
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp := post(t, h.url+"/v1/completions", body)
			if got := readAll(t, resp); resp.StatusCode != 200 {
				t.Errorf("%s: status %d: %s", name, resp.StatusCode, got)
			}
		}()
	}
	eps := h.pool.Load().Endpoints
	// A pick is logged before its lease is taken: wait for the lease, or
	// the next request could still see the pod free.
	leased := func(n int64) {
		t.Helper()
		for deadline := time.Now().Add(guard); eps[0].InFlight()+eps[1].InFlight() < n; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%d leases, want %d", eps[0].InFlight()+eps[1].InFlight(), n)
			}
		}
	}
	send("A", "a0")
	podA := policy.wait(t, 1)[0]
	leased(1)
	send("B", "b0") // pod A is at its cap: pod B
	podB := policy.wait(t, 2)[1]
	if podA[3:] == podB[3:] {
		t.Fatalf("a0 and b0 on one pod: %q, %q", podA, podB)
	}
	leased(2)
	send("A", "a1")
	queueLen(t, h.srv, 1)
	send("A", "a2")
	queueLen(t, h.srv, 2)
	send("B", "b1")
	queueLen(t, h.srv, 3)

	b := slices.IndexFunc(eps, func(e *discovery.Endpoint) bool { return strings.HasSuffix(podB, "@"+e.URL) })
	fleet.Pod(b).ReleaseStalls() // b0 ends, and pod B takes requests at once from now on
	if got, want := policy.wait(t, 3)[2], "b1"+podB[2:]; got != want {
		t.Errorf("%s took pod B's freed place, want %s (group B is cached there; a1 and a2 wait for pod A)", got, want)
	}
	fleet.Pod(1 - b).ReleaseStalls()
	wg.Wait()
	h.waitIdle(t)
}
