package proxy

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/metrics"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// guardWait bounds every wait of the tests of this file and of
// transport_test.go; a deadlock guard, not a speed assertion.
const guardWait = 10 * time.Second

// fleetHarness is a kvroute proxy on 127.0.0.1:0 whose endpoints a real
// discovery Fleet manages (static backends, passive ejection on the
// failures the proxy reports; no probes, no scraping).
type fleetHarness struct {
	url   string
	fleet *discovery.Fleet
	// reg holds the proxy's metrics and the Fleet's.
	reg *prometheus.Registry
}

// startFleetProxy runs a Fleet over backends with passive ejection p and a
// proxy in front of it under the policy named policy, until the test ends.
func startFleetProxy(t *testing.T, policy string, lim Limits, p discovery.PassiveConfig, backends ...string) *fleetHarness {
	t.Helper()
	return startFleetProxyWith(t, policy, lim, discovery.Options{
		Health:  discovery.HealthConfig{Disabled: true},
		Scrape:  discovery.ScrapeConfig{Disabled: true},
		Passive: p,
	}, backends...)
}

// startFleetProxyWith is startFleetProxy with the Fleet's options o.
func startFleetProxyWith(t *testing.T, policy string, lim Limits, o discovery.Options, backends ...string) *fleetHarness {
	t.Helper()
	f, err := discovery.New(o)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.AddStatic(discovery.RoleMixed, backends); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(guardWait):
			t.Error("the Fleet did not stop")
		}
	})

	reg := prometheus.NewRegistry()
	reg.MustRegister(f)
	pick := policyByName(t, policy)
	srv := New(Options{Limits: lim, Picker: pick, Pool: f.Pool(), Metrics: metrics.New(reg, Classes, nil),
		Logger: zap.NewNop(), BlockSize: 1024})
	return &fleetHarness{url: serveLoopback(t, srv), fleet: f, reg: reg}
}

// policyByName builds a policy of routing's table as the router does.
func policyByName(t testing.TB, name string) routing.Picker {
	t.Helper()
	np, ok := routing.Policies()[name]
	if !ok {
		t.Fatalf("no policy %q", name)
	}
	return np(routing.PolicyConfig{
		BlockBytes: 1024,
		Index:      prefix.IndexConfig{BlocksPerEndpoint: 10_000},
		Prefix:     routing.DefaultPrefixParams(),
	})
}

// endpoint returns the Fleet's endpoint of base URL u.
func (h *fleetHarness) endpoint(t *testing.T, u string) *discovery.Endpoint {
	t.Helper()
	for _, e := range h.fleet.Pool().Load().Endpoints {
		if e.URL == strings.TrimRight(u, "/") {
			return e
		}
	}
	t.Fatalf("no endpoint %s", u)
	return nil
}

// namedBackend answers every request with code, its name in X-Backend
// and a small JSON body, and counts the requests.
func namedBackend(t *testing.T, name string, code int) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var hits atomic.Int64
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Backend", name)
		w.WriteHeader(code)
		fmt.Fprintf(w, `{"backend":%q,"status":%d}`, name, code)
	}))
	t.Cleanup(s.Close)
	return s, &hits
}

// completion posts a distinct small completion request (i makes the
// prompt distinct, so the prefix policy spreads them) and returns the
// status and the backend that answered ("" for kvroute itself).
func completion(t *testing.T, url string, i int) (int, string) {
	t.Helper()
	resp := post(t, url+"/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"request %d: say hi","max_tokens":4}`, i))
	readAll(t, resp)
	return resp.StatusCode, resp.Header.Get("X-Backend")
}

// TestFailingEndpointsAreEjected: under every policy, an endpoint that
// answers 500 and one that refuses connections are ejected by the
// failures the proxy reports, and traffic then goes to the healthy ones
// only: no more attempts on the ejected ones, no more retries.
func TestFailingEndpointsAreEjected(t *testing.T) {
	for _, policy := range routing.PolicyNames(routing.Policies()) {
		t.Run(policy, func(t *testing.T) {
			five, fiveHits := namedBackend(t, "five", 500)
			good1, _ := namedBackend(t, "good1", 200)
			good2, _ := namedBackend(t, "good2", 200)
			refused := closedAddr(t)
			h := startFleetProxy(t, policy, Limits{Retries: 2},
				// A cooldown far beyond the test: the ejections last.
				discovery.PassiveConfig{Failures: 3, Cooldown: time.Hour, MaxCooldown: time.Hour, MaxEjectedShare: 0.5},
				five.URL, refused, good1.URL, good2.URL)
			eFive, eRefused := h.endpoint(t, five.URL), h.endpoint(t, refused)
			eGood1, eGood2 := h.endpoint(t, good1.URL), h.endpoint(t, good2.URL)

			i := 0
			for ; eFive.Routable() || eRefused.Routable(); i++ {
				if i == 400 {
					t.Fatalf("after %d requests: 500 endpoint %v (%d failures), refusing endpoint %v (%d failures)",
						i, eFive.State(), eFive.Failures.Load(), eRefused.State(), eRefused.Failures.Load())
				}
				code, from := completion(t, h.url, i)
				switch {
				case code == 500 && from == "five":
				case code == 200 && (from == "good1" || from == "good2"):
				default:
					t.Fatalf("request %d: status %d from %q", i, code, from)
				}
			}
			if eFive.State() != discovery.StateEjected || eRefused.State() != discovery.StateEjected {
				t.Fatalf("states %v and %v, want ejected", eFive.State(), eRefused.State())
			}
			if !eGood1.Routable() || !eGood2.Routable() || eGood1.Failures.Load() != 0 || eGood2.Failures.Load() != 0 {
				t.Fatalf("healthy endpoints %v (%d failures), %v (%d failures)",
					eGood1.State(), eGood1.Failures.Load(), eGood2.State(), eGood2.Failures.Load())
			}
			if n := counterValue(t, h.reg, "kvroute_discovery_ejections_total", nil); n != 2 {
				t.Errorf("ejections counted %v, want 2", n)
			}

			// Traffic now goes to the healthy endpoints only.
			hits, tries := fiveHits.Load(), eRefused.Requests()
			retries := counterValue(t, h.reg, "kvroute_retries_total", nil)
			served := map[string]int{}
			for j := range 40 {
				code, from := completion(t, h.url, i+j)
				if code != 200 || (from != "good1" && from != "good2") {
					t.Fatalf("after the ejections: status %d from %q", code, from)
				}
				served[from]++
			}
			if fiveHits.Load() != hits || eRefused.Requests() != tries {
				t.Errorf("ejected endpoints still tried: 500 endpoint %d more, refusing endpoint %d more",
					fiveHits.Load()-hits, eRefused.Requests()-tries)
			}
			if r := counterValue(t, h.reg, "kvroute_retries_total", nil); r != retries {
				t.Errorf("%v retries after the ejections", r-retries)
			}
			// Round-robin reaches every healthy endpoint (not evenly: the
			// endpoint after the ejected ones takes their turns).
			if policy == "round-robin" && (served["good1"] == 0 || served["good2"] == 0) {
				t.Errorf("round-robin over the healthy endpoints served %v", served)
			}
		})
	}
}

// TestClientErrorsNeverEject: 4xx answers (the client's mistakes, or an
// overloaded engine's 429) are not the endpoint's failures. With a
// threshold that ejects a 500 at once, endpoints answering 400, 404, 422
// and 429 stay in; and a 4xx between two 5xx breaks the run of
// consecutive failures.
func TestClientErrorsNeverEject(t *testing.T) {
	// ejectsAt checks the control: under threshold failures, a backend
	// answering only 500 is ejected.
	ejectsAt := func(t *testing.T, failures int) {
		t.Helper()
		five, _ := namedBackend(t, "five", 500)
		ok, _ := namedBackend(t, "ok", 200)
		h := startFleetProxy(t, "round-robin", Limits{Retries: 0},
			discovery.PassiveConfig{Failures: failures, Cooldown: time.Hour, MaxCooldown: time.Hour, MaxEjectedShare: 1},
			five.URL, ok.URL)
		for i := 0; h.endpoint(t, five.URL).Routable(); i++ {
			if i == 20 {
				t.Fatalf("500s did not eject with a threshold of %d failures", failures)
			}
			completion(t, h.url, i)
		}
	}

	t.Run("4xx answers", func(t *testing.T) {
		ejectsAt(t, 1)
		var urls []string
		for _, code := range []int{400, 404, 422, 429} {
			s, _ := namedBackend(t, fmt.Sprint(code), code)
			urls = append(urls, s.URL)
		}
		good, _ := namedBackend(t, "good", 200)
		h := startFleetProxy(t, "round-robin", Limits{Retries: 2},
			discovery.PassiveConfig{Failures: 1, Cooldown: time.Hour, MaxCooldown: time.Hour, MaxEjectedShare: 1},
			append(urls, good.URL)...)
		statuses := map[int]int{}
		for i := range 60 {
			code, _ := completion(t, h.url, i)
			statuses[code]++
		}
		for _, code := range []int{400, 404, 422} {
			if statuses[code] == 0 {
				t.Errorf("no %d passed through: %v", code, statuses)
			}
		}
		for _, u := range urls {
			if e := h.endpoint(t, u); !e.Routable() || e.Failures.Load() != 0 {
				t.Errorf("%s: %v with %d failures after 4xx answers", u, e.State(), e.Failures.Load())
			}
		}
		if n := counterValue(t, h.reg, "kvroute_discovery_ejections_total", nil); n != 0 {
			t.Errorf("ejections counted %v, want 0", n)
		}
	})

	t.Run("a 4xx breaks the run of failures", func(t *testing.T) {
		ejectsAt(t, 2)
		// Answers 500, 404, 500, 404, ...
		var n atomic.Int64
		alternating := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method != http.MethodPost { // discovery's GET /v1/models
				http.NotFound(w, r)
				return
			}
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("X-Backend", "alternating")
			code := 404
			if n.Add(1)%2 == 1 {
				code = 500
			}
			w.WriteHeader(code)
			fmt.Fprintf(w, `{"error":{"message":"x","type":"x","param":null,"code":%d}}`, code)
		}))
		t.Cleanup(alternating.Close)
		good, _ := namedBackend(t, "good", 200)
		h := startFleetProxy(t, "round-robin", Limits{Retries: 0},
			discovery.PassiveConfig{Failures: 2, Cooldown: time.Hour, MaxCooldown: time.Hour, MaxEjectedShare: 1},
			alternating.URL, good.URL)
		for i := range 40 {
			completion(t, h.url, i)
		}
		e := h.endpoint(t, alternating.URL)
		if n.Load() < 10 || e.Failures.Load() != uint64(n.Load()+1)/2 {
			t.Fatalf("the alternating backend answered %d requests, %d failures counted", n.Load(), e.Failures.Load())
		}
		if !e.Routable() {
			t.Errorf("ejected (%v) though no two failures were consecutive", e.State())
		}
	})
}
