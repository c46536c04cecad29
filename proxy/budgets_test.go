package proxy

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
	"github.com/valyala/fastjson"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

func keySum(key string) string {
	s := sha256.Sum256([]byte(key))
	return hex.EncodeToString(s[:])
}

// budgetsFor compiles a budgets file or fails the test.
func budgetsFor(t *testing.T, file string) *Budgets {
	t.Helper()
	b, err := ParseBudgets([]byte(file))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A budgets file is checked whole: every mistake is an error naming the
// tenant and the field, never a budget silently dropped.
func TestParseBudgets(t *testing.T) {
	srv := &Server{}
	srv.tenants.max = 32
	a := srv.tenantOf(bearer("key-a"))
	b := budgetsFor(t, `{"tenants": {
		"team-a": {"key_sha256": "`+keySum("key-a")+`", "weight": 2, "max_concurrency": 4, "tokens_per_minute": 1000, "max_class": "default"},
		"batch":  {"id": "`+srv.tenantLabel(srv.tenantOf(bearer("key-b")))+`", "max_class": "flex"},
		"anon":   {"id": "default", "requests_per_minute": 10}},
		"others": {"max_concurrency": 2}}`)
	if x := b.of(a); x == nil || x.name != "team-a" || x.weight != 2 || x.maxConc != 4 || x.tpm != 1000 || !x.capped || x.maxClass != classDefault {
		t.Errorf("team-a: %+v", x)
	}
	if x := b.of(srv.tenantOf(bearer("key-b"))); x == nil || x.name != "batch" || x.maxClass != classFlex || x.limits() {
		t.Errorf("batch, by its metric label: %+v", x)
	}
	if x := b.of(0); x == nil || x.name != "anon" || x.rpm != 10 {
		t.Errorf("the default tenant: %+v", x)
	}
	if x := b.of(srv.tenantOf(bearer("key-c"))); x == nil || x.name != "" || x.maxConc != 2 || x.weight != 1 {
		t.Errorf("others: %+v", x)
	}
	if x := budgetsFor(t, `{"tenants": {}}`).of(a); x != nil {
		t.Errorf("no others: %+v", x)
	}

	for file, want := range map[string]string{
		`{"tenants": {"a": {"key_sha256": "abc"}}}`:                                         `"a": key_sha256`,
		`{"tenants": {"a": {"id": "t-12"}}}`:                                                `"a": id "t-12"`,
		`{"tenants": {"a": {"id": "t-0123456789ab", "key_sha256": "` + keySum("x") + `"}}}`: "exactly one",
		`{"tenants": {"a": {}}}`:                                                            "exactly one",
		`{"tenants": {"a": {"id": "default", "weight": -1}}}`:                               `"a": weight -1`,
		`{"tenants": {"a": {"id": "default", "max_concurrency": -1}}}`:                      "max_concurrency",
		`{"tenants": {"a": {"id": "default", "tokens_per_minute": -5}}}`:                    "tokens_per_minute",
		`{"tenants": {"a": {"id": "default", "max_class": "urgent"}}}`:                      "max_class",
		`{"tenants": {"a": {"id": "default", "max_concurency": 3}}}`:                        "unknown field",
		`{"tenants": {"other": {"id": "default"}}}`:                                         `"other"`,
		`{"tenants": {"a b": {"id": "default"}}}`:                                           `"a b"`,
		`{"tenants": {"a": {"id": "default"}, "b": {"id": "default"}}}`:                     "the same tenant",
		`{"others": {"weight": 0.5}} {"others": {}}`:                                        "more than one",
		`{"tenants": [1]}`:            "cannot unmarshal",
		`{"others": {"weight": 1e9}}`: `"others": weight`,
	} {
		if _, err := ParseBudgets([]byte(file)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: error %v, want one saying %q", file, err, want)
		}
	}
}

// bearer is a request header with an API key.
func bearer(key string) *fasthttp.RequestHeader {
	var h fasthttp.RequestHeader
	h.Set("Authorization", "Bearer "+key)
	return &h
}

// heldEngine is an engine that holds each request until the test
// releases one, and records, per API key, the most it held at once and
// the bodies it was sent.
type heldEngine struct {
	url     string
	release chan struct{}
	mu      sync.Mutex
	running map[string]int
	most    map[string]int
	bodies  []string
	started atomic.Int64
}

func newHeldEngine(t *testing.T) *heldEngine {
	e := &heldEngine{release: make(chan struct{}, 100), running: map[string]int{}, most: map[string]int{}}
	e.url = instantHandler(t, func(ctx *fasthttp.RequestCtx) {
		key := string(ctx.Request.Header.Peek("Authorization"))
		e.mu.Lock()
		e.running[key]++
		e.most[key] = max(e.most[key], e.running[key])
		e.bodies = append(e.bodies, string(ctx.PostBody()))
		e.mu.Unlock()
		e.started.Add(1)
		select {
		case <-e.release:
		case <-time.After(guard):
		}
		e.mu.Lock()
		e.running[key]--
		e.mu.Unlock()
		ctx.SetContentType("application/json")
		ctx.SetBodyString(completionResponse)
	})
	return e
}

func (e *heldEngine) mostOf(key string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.most["Bearer "+key]
}

// waitStarted waits until the engine has started n requests.
func (e *heldEngine) waitStarted(t *testing.T, n int64) {
	t.Helper()
	for deadline := time.Now().Add(guard); e.started.Load() < n; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the engine started %d requests, want %d", e.started.Load(), n)
		}
	}
}

// A tenant at its max_concurrency waits in kvroute's queue for its own
// requests to end, while another tenant's request goes to the fleet at
// once: the fleet has room, and only the capped tenant is held.
func TestBudgetMaxConcurrency(t *testing.T) {
	e := newHeldEngine(t)
	h := startProxy(t, nil, Options{Limits: Limits{QueueTimeout: guard, MaxQueue: 100},
		Budgets: budgetsFor(t, `{"tenants": {"batch": {"key_sha256": "`+keySum("batch")+`", "max_concurrency": 2}}}`)}, e.url)
	var wg sync.WaitGroup
	codes := make(chan int, 10)
	send := func(key string) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			codes <- postAs(t, h.url, key, "")
		}()
	}
	for range 5 {
		send("batch")
	}
	e.waitStarted(t, 2)
	// The other three wait in kvroute for the tenant's places.
	for deadline := time.Now().Add(guard); h.srv.QueueStatus().Waiting < 3; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d waiting, want the 3 beyond the budget", h.srv.QueueStatus().Waiting)
		}
	}
	if e.started.Load() != 2 {
		t.Fatalf("the engine runs %d of the capped tenant's requests, want 2", e.started.Load())
	}
	if b := h.srv.QueueStatus().Budgets; len(b) != 1 || b[0].Tenant != "batch" || b[0].InFlight != 2 || b[0].MaxConcurrency != 2 {
		t.Errorf("/debug/queue's budgets: %+v", b)
	}
	send("interactive") // not held up by the capped tenant's waiters
	e.waitStarted(t, 3)
	for range 6 {
		e.release <- struct{}{}
	}
	wg.Wait()
	close(codes)
	for c := range codes {
		if c != http.StatusOK {
			t.Fatalf("status %d", c)
		}
	}
	if m := e.mostOf("batch"); m != 2 {
		t.Errorf("the engine ran at most %d of the capped tenant's requests at once, want 2", m)
	}
	if g := counterValue(t, h.reg, "kvroute_tenant_in_flight_requests", map[string]string{"tenant": "batch"}); g != 0 {
		t.Errorf("in flight after the end: %v", g)
	}
	if a := counterValue(t, h.reg, "kvroute_tenant_admitted_requests_total", map[string]string{"tenant": "batch"}); a != 5 {
		t.Errorf("admitted %v of the named tenant's requests, want 5 under its name", a)
	}
}

// A spent requests or tokens budget is a 429 of kvroute's own, with the
// Retry-After that refills it; a request that never reached an engine is
// refunded; another tenant is not limited.
func TestBudgetRates(t *testing.T) {
	h := startProxy(t, nil, Options{Limits: Limits{QueueTimeout: guard, MaxQueue: 100},
		Budgets: budgetsFor(t, `{"tenants": {"slow": {"key_sha256": "`+keySum("slow")+`", "requests_per_minute": 2}},
			"others": {"tokens_per_minute": 300}}`)}, instantBackend(t))
	// A request whose model nobody serves is answered by kvroute: refunded.
	h.pool.Load().Endpoints[0].SetModels([]discovery.Model{{ID: "m"}})
	for range 3 {
		resp := post(t, h.url+"/v1/completions", `{"model":"nope","prompt":"x"}`, "Authorization", "Bearer slow")
		assertOpenAIError(t, resp, http.StatusNotFound)
	}
	for i := range 2 {
		if c := postAs(t, h.url, "slow", ""); c != http.StatusOK {
			t.Fatalf("request %d within the budget: status %d", i, c)
		}
	}
	resp := post(t, h.url+"/v1/completions", `{"model":"m","prompt":"x"}`, "Authorization", "Bearer slow")
	body := readAll(t, resp)
	if resp.StatusCode != http.StatusTooManyRequests || !strings.Contains(body, `"rate_limit_exceeded"`) || !strings.Contains(body, "2 requests per minute") {
		t.Fatalf("past the budget: %d %s", resp.StatusCode, body)
	}
	if ra, err := strconv.Atoi(resp.Header.Get("Retry-After")); err != nil || ra < 25 || ra > 31 {
		t.Errorf("Retry-After %q, want the half minute that refills one request", resp.Header.Get("Retry-After"))
	}
	if n := counterValue(t, h.reg, "kvroute_tenant_shed_requests_total", map[string]string{"tenant": "slow", "reason": "rate_limit"}); n != 1 {
		t.Errorf("rate_limit sheds %v, want 1", n)
	}
	// Others: 300 tokens a minute. The first request is charged its
	// prompt and 256 output tokens, then settled to the engine's usage
	// (260 tokens); the second finds tokens left and runs; the third
	// finds none.
	for i, want := range []int{http.StatusOK, http.StatusOK, http.StatusTooManyRequests} {
		if c := postAs(t, h.url, "other", ""); c != want {
			t.Fatalf("tokens budget, request %d: status %d, want %d", i, c, want)
		}
	}
}

// A tenant capped at a class is served at it; with --engine-priority the
// class reaches the engine as vLLM's priority field, and a client's own
// priority field does not get past it.
func TestBudgetMaxClassAndEnginePriority(t *testing.T) {
	e := newHeldEngine(t)
	for range 10 {
		e.release <- struct{}{}
	}
	h := startProxy(t, nil, Options{Limits: Limits{QueueTimeout: guard, MaxQueue: 100},
		Tenants: TenantOptions{EnginePriority: true},
		Budgets: budgetsFor(t, `{"tenants": {"batch": {"key_sha256": "`+keySum("batch")+`", "max_class": "flex"}}}`)}, e.url)
	for _, c := range []struct{ key, body string }{
		{"batch", `{"model":"m","prompt":"a","service_tier":"priority"}`},
		{"user", `{"model":"m","prompt":"b","service_tier":"priority"}`},
		{"user", `{"model":"m","prompt":"c","priority":-100}`},
		{"user", `{"model":"m","prompt":"d","service_tier":"flex"}`},
	} {
		resp := post(t, h.url+"/v1/completions", c.body, "Authorization", "Bearer "+c.key)
		if body := readAll(t, resp); resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d %s", c.body, resp.StatusCode, body)
		}
	}
	want := map[string]string{"a": "1", "b": "-1", "c": "none", "d": "1"}
	for _, body := range e.bodies {
		v := fastjson.MustParse(body)
		p := string(v.GetStringBytes("prompt"))
		got := "none"
		if x := v.Get("priority"); x != nil {
			got = x.String()
		}
		if got != want[p] {
			t.Errorf("prompt %s: the engine got priority %s, want %s (%s)", p, got, want[p], body)
		}
	}
	if n := counterValue(t, h.reg, "kvroute_tenant_admitted_requests_total", map[string]string{"tenant": "batch", "class": "flex"}); n != 1 {
		t.Errorf("the capped tenant's request admitted as flex %v times, want 1", n)
	}
}

// A changed budgets file is put in force; a bad one is refused with an
// error counted, and the budgets in force stay.
func TestWatchBudgets(t *testing.T) {
	h := startProxy(t, nil, Options{}, instantBackend(t))
	path := filepath.Join(t.TempDir(), "budgets.json")
	write := func(s string) {
		t.Helper()
		// A new file renamed into place, as a ConfigMap update does.
		tmp := path + ".new"
		if err := os.WriteFile(tmp, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
	}
	write(`{"others": {"weight": 1}}`)
	b, data, err := LoadBudgets(path)
	if err != nil {
		t.Fatal(err)
	}
	h.srv.SetBudgets(b)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); h.srv.WatchBudgets(ctx, path, 5*time.Millisecond, data) }()
	defer func() { cancel(); <-done }()
	id := h.srv.tenantOf(bearer("k"))
	eventually := func(what string, ok func() bool) {
		t.Helper()
		for deadline := time.Now().Add(guard); !ok(); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("never: %s", what)
			}
		}
	}
	write(`{"tenants": {"k": {"key_sha256": "` + keySum("k") + `", "weight": 3}}}`)
	eventually("the new file in force", func() bool { return h.srv.weightOf(id) == 3 })
	if l := h.srv.tenantLabel(id); l != "k" {
		t.Errorf("label %q, want the budget's name", l)
	}
	write(`{"tenants": {"k": {"key_sha256": "` + keySum("k") + `", "weight": 0.5, "max_concurency": 3}}}`)
	eventually("the bad file counted", func() bool {
		return counterValue(t, h.reg, "kvroute_tenant_budgets_reloads_total", map[string]string{"result": "error"}) == 1
	})
	if w := h.srv.weightOf(id); w != 3 {
		t.Errorf("weight %v after a bad file, want the 3 in force", w)
	}
	if n := counterValue(t, h.reg, "kvroute_tenant_budgets_reloads_total", map[string]string{"result": "ok"}); n != 1 {
		t.Errorf("%v reloads, want 1", n)
	}
}

// Weights share a saturated fleet: a tenant of weight 3 gets three places
// for each one of a tenant of weight 1 while both wait.
func TestFairQueueWeights(t *testing.T) {
	tq := newTestQueue(t, 100, 100)
	granted := make(chan *waiter, 16)
	for range 8 {
		for _, id := range []uint64{1, 2} {
			w := &waiter{req: &routing.Request{}, cost: 100, ready: make(chan struct{}, 1)}
			if shed := tq.q.enter(w, id, "", float64(2*id-1), false); shed != "" { // weights 1 and 3
				t.Fatal(shed)
			}
			go func() {
				<-w.ready
				tq.places.Add(-1) // the grantee takes its place
				tq.q.handedOff()
				granted <- w
			}()
		}
	}
	// Hand out 8 places one at a time and see who gets them.
	var got []uint64
	n3 := 0
	for range 8 {
		tq.places.Store(1)
		tq.q.wake()
		w := <-granted
		got = append(got, w.tenant.id)
		if w.tenant.id == 2 {
			n3++
		}
	}
	if n3 != 6 {
		t.Errorf("grants %v: the tenant of weight 3 got %d of 8, want 6", got, n3)
	}
}
