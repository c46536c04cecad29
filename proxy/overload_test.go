package proxy

import (
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

// shortQueueEngine is an engine that runs slots requests at once for hold
// each and answers 429 to any beyond them (an engine or gateway with a
// short queue); it records the order requests started in, by their
// Authorization header and service tier.
type shortQueueEngine struct {
	url      string
	running  atomic.Int64
	rejected atomic.Int64
	mu       sync.Mutex
	started  []string
}

func newShortQueueEngine(t *testing.T, slots int64, hold time.Duration) *shortQueueEngine {
	e := &shortQueueEngine{}
	e.url = instantHandler(t, func(ctx *fasthttp.RequestCtx) {
		if e.running.Add(1) > slots {
			e.running.Add(-1)
			e.rejected.Add(1)
			ctx.SetStatusCode(fasthttp.StatusTooManyRequests)
			ctx.SetBodyString(`{"error":{"message":"queue full","type":"RateLimitError","param":null,"code":429}}`)
			return
		}
		e.mu.Lock()
		e.started = append(e.started, string(ctx.Request.Header.Peek("Authorization"))+" "+tierOf(ctx.PostBody()))
		e.mu.Unlock()
		time.Sleep(hold)
		e.running.Add(-1)
		ctx.SetContentType("application/json")
		ctx.SetBodyString(completionResponse)
	})
	return e
}

func tierOf(body []byte) string {
	if strings.Contains(string(body), `"flex"`) {
		return "flex"
	}
	return "default"
}

func (e *shortQueueEngine) order() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.started...)
}

// postAs sends a completion as tenant key with service tier tier ("":
// none) and returns its status.
func postAs(t *testing.T, url, key, tier string) int {
	body := `{"model":"m","prompt":"hello"}`
	if tier != "" {
		body = `{"model":"m","prompt":"hello","service_tier":"` + tier + `"}`
	}
	resp := post(t, url+"/v1/completions", body, "Authorization", "Bearer "+key)
	readAll(t, resp)
	return resp.StatusCode
}

// An engine that answers 429 while it runs others of kvroute's requests
// is full, not failing: requests wait for its room and are all answered,
// with no retry spent, where a doubling backoff left it idle and passed
// 429s on to clients (issue #38).
func TestEngineBackpressureKeepsTheFleetFull(t *testing.T) {
	a, b := newShortQueueEngine(t, 2, 20*time.Millisecond), newShortQueueEngine(t, 2, 20*time.Millisecond)
	h := startProxy(t, routing.NewLeastRequest(nil), Options{Limits: Limits{Retries: 2, QueueTimeout: guard, MaxQueue: 100}}, a.url, b.url)
	const n = 24
	var wg sync.WaitGroup
	codes := make([]int, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			codes[i] = postAs(t, h.url, "k", "")
		}()
	}
	wg.Wait()
	for i, c := range codes {
		if c != http.StatusOK {
			t.Fatalf("request %d: status %d", i, c)
		}
	}
	if a.rejected.Load()+b.rejected.Load() == 0 {
		t.Fatal("the engines never pushed back: the test tests nothing")
	}
	if r := counterValue(t, h.reg, "kvroute_retries_total", nil); r != 0 {
		t.Errorf("%v retries spent on backpressure", r)
	}
	if f := counterValue(t, h.reg, "kvroute_upstream_errors_total", map[string]string{"kind": "full"}); f == 0 {
		t.Error("no backpressure counted")
	}
}

// An engine's 429 or 503 that ends a request's tries is answered as such
// (429 with Retry-After; 503), never as a 502.
func TestEngineRefusalIsNeverA502(t *testing.T) {
	for _, code := range []int{http.StatusTooManyRequests, http.StatusServiceUnavailable} {
		s, _ := statusBackend(t, code)
		h := startProxy(t, fixedOrder{}, Options{Limits: Limits{Retries: 1, QueueTimeout: 50 * time.Millisecond, MaxQueue: 10}}, s.URL)
		resp := post(t, h.url+"/v1/completions", `{"model":"m","prompt":"x"}`)
		assertOpenAIError(t, resp, code)
		if code == http.StatusTooManyRequests && resp.Header.Get("Retry-After") == "" {
			t.Error("429 without Retry-After")
		}
	}
}

// queueLen waits until n requests wait in srv's queue.
func queueLen(t *testing.T, srv *Server, n int) {
	t.Helper()
	deadline := time.Now().Add(guard)
	for srv.QueueStatus().Waiting < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d requests waiting, want %d", srv.QueueStatus().Waiting, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// Through the proxy, on an engine that runs one request at once: a
// tenant's backlog does not hold back another tenant's request, and a
// default request goes before a flex backlog of its own tenant.
func TestQueueOrderThroughTheProxy(t *testing.T) {
	for _, tc := range []struct {
		name                string
		floodKey, floodTier string
		quietKey, quietTier string
		want                string
	}{
		{name: "tenants", floodKey: "noisy", quietKey: "quiet", want: "Bearer quiet default"},
		{name: "classes", floodKey: "team", floodTier: "flex", quietKey: "team", quietTier: "default", want: "Bearer team default"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newShortQueueEngine(t, 1, 10*time.Millisecond)
			h := startProxy(t, routing.NewLeastRequest(nil), Options{Limits: Limits{QueueTimeout: guard, MaxQueue: 100}}, e.url)
			h.pool.Load().Endpoints[0].SetCosts(&discovery.Costs{BatchLimit: 1}) // learned: one at once
			const flood = 8
			var wg sync.WaitGroup
			for range flood {
				wg.Add(1)
				go func() { defer wg.Done(); postAs(t, h.url, tc.floodKey, tc.floodTier) }()
			}
			queueLen(t, h.srv, flood-2) // one running, the rest waiting (one may be on its way)
			// The running one has reached the engine (a grant is on its
			// way to the engine for a moment: counted before, it made one
			// more look like a queue jump).
			for deadline := time.Now().Add(guard); len(e.order()) == 0; time.Sleep(time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatal("no request reached the engine")
				}
			}
			before := len(e.order())
			wg.Add(1)
			go func() { defer wg.Done(); postAs(t, h.url, tc.quietKey, tc.quietTier) }()
			wg.Wait()
			order := e.order()
			at := -1
			for i, s := range order {
				if s == tc.want {
					at = i
				}
			}
			// It goes next, or second if a request was on its way.
			if at < 0 || at > before+1 {
				t.Fatalf("%q started at %d, %d had started before it: %q", tc.want, at, before, order)
			}
		})
	}
}

// A service_tier OpenAI does not define, or a priority header naming no
// class, is a 400.
func TestBadServiceTier(t *testing.T) {
	h := startProxy(t, nil, Options{Tenants: TenantOptions{PriorityHeader: "X-Priority"}}, instantBackend(t))
	resp := post(t, h.url+"/v1/completions", `{"model":"m","prompt":"x","service_tier":"urgent"}`)
	assertOpenAIError(t, resp, http.StatusBadRequest)
	resp = post(t, h.url+"/v1/completions", `{"model":"m","prompt":"x","service_tier":1}`)
	assertOpenAIError(t, resp, http.StatusBadRequest)
	resp = post(t, h.url+"/v1/completions", `{"model":"m","prompt":"x"}`, "X-Priority", "now")
	assertOpenAIError(t, resp, http.StatusBadRequest)
	for _, tier := range []string{"auto", "default", "flex", "scale", "priority"} {
		if code := postAs(t, h.url, "k", tier); code != http.StatusOK {
			t.Errorf("service_tier %q: status %d", tier, code)
		}
	}
}
