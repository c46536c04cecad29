package proxy

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/metrics"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// harness is a kvroute proxy on 127.0.0.1:0 in front of the given backends.
type harness struct {
	url  string
	srv  *Server
	pool *discovery.Pool
	reg  *prometheus.Registry
}

// startSimFleet starts n simulated vLLM pods configured by cfg and stops
// them when the test ends.
func startSimFleet(t testing.TB, n int, cfg sim.Config) *sim.Fleet {
	t.Helper()
	fleet, err := sim.StartFleet(n, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fleet.Close() })
	return fleet
}

func startProxy(t testing.TB, p Picker, opt Options, backends ...string) *harness {
	t.Helper()
	pool := &discovery.Pool{}
	var eps []*discovery.Endpoint
	for _, b := range backends {
		ep, err := discovery.NewEndpoint(b, discovery.RoleMixed)
		if err != nil {
			t.Fatal(err)
		}
		eps = append(eps, ep)
	}
	pool.Publish(eps)
	reg := prometheus.NewRegistry()
	if p == nil {
		p = routing.NewRoundRobin()
	}
	opt.Picker, opt.Pool = p, pool
	opt.Metrics = metrics.New(reg, Classes, nil)
	if opt.MaxBodyBytes == 0 {
		opt.MaxBodyBytes = 1 << 20
	}
	if opt.Logger == nil {
		opt.Logger = zap.NewNop()
	}
	srv := New(opt)
	return &harness{url: serveLoopback(t, srv), srv: srv, pool: pool, reg: reg}
}

// serveLoopback serves srv on 127.0.0.1:0 until the test ends and returns
// its base URL.
func serveLoopback(t testing.TB, srv *Server) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	})
	return "http://" + ln.Addr().String()
}

// inFlight sums the in-flight counters of every endpoint.
func (h *harness) inFlight() int64 {
	var n int64
	for _, e := range h.pool.Load().Endpoints {
		n += e.InFlight()
	}
	return n
}

// waitIdle waits until every in-flight counter is zero (streams close
// asynchronously after the client saw the end), failing after 10 s.
func (h *harness) waitIdle(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for h.inFlight() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("in-flight stuck at %d", h.inFlight())
		}
		time.Sleep(time.Millisecond)
	}
}

var testClient = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}, Timeout: 30 * time.Second}

func post(t testing.TB, url, body string, hdr ...string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := testClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func readAll(t testing.TB, resp *http.Response) string {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// echoBackend answers every request with a JSON description of what it got.
func echoBackend(t testing.TB, name string) (*httptest.Server, *atomic.Int64) {
	var hits atomic.Int64
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		body, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Keep-Alive", "timeout=5")
		w.Header().Set("X-Backend", name)
		_ = json.NewEncoder(w).Encode(map[string]any{
			"backend": name, "method": r.Method, "uri": r.RequestURI, "body": string(body),
			"headers": r.Header, "host": r.Host,
		})
	}))
	t.Cleanup(s.Close)
	return s, &hits
}

type echoed struct {
	Backend string              `json:"backend"`
	Method  string              `json:"method"`
	URI     string              `json:"uri"`
	Body    string              `json:"body"`
	Headers map[string][]string `json:"headers"`
}

func decodeEcho(t testing.TB, resp *http.Response) echoed {
	t.Helper()
	var e echoed
	if err := json.Unmarshal([]byte(readAll(t, resp)), &e); err != nil {
		t.Fatal(err)
	}
	return e
}

func TestForwardsEveryMethodAndPath(t *testing.T) {
	be, _ := echoBackend(t, "a")
	h := startProxy(t, nil, Options{}, be.URL)
	tests := []struct {
		method, path, body string
	}{
		{method: "GET", path: "/v1/models"},
		{method: "GET", path: "/health"},
		{method: "GET", path: "/metrics"},
		{method: "POST", path: "/tokenize", body: `{"model":"m","prompt":"hi"}`},
		{method: "POST", path: "/v1/completions?x=1&y=%20z", body: `{"model":"m","prompt":"hi"}`},
		{method: "DELETE", path: "/v1/unload_lora_adapter", body: `{"lora_name":"a"}`},
		{method: "PUT", path: "/some/future/path"},
	}
	for _, tc := range tests {
		t.Run(tc.method+" "+tc.path, func(t *testing.T) {
			req, _ := http.NewRequest(tc.method, h.url+tc.path, strings.NewReader(tc.body))
			resp, err := testClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			if resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
			e := decodeEcho(t, resp)
			if e.Method != tc.method || e.URI != tc.path || e.Body != tc.body {
				t.Fatalf("backend got %s %s %q", e.Method, e.URI, e.Body)
			}
		})
	}
	t.Run("chunked request body", func(t *testing.T) {
		pr, pw := io.Pipe()
		go func() {
			_, _ = pw.Write([]byte(`{"model":"m",`))
			_, _ = pw.Write([]byte(`"prompt":"chunked"}`))
			_ = pw.Close()
		}()
		req, _ := http.NewRequest("POST", h.url+"/v1/completions", pr) // unknown length: chunked
		resp, err := testClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if e := decodeEcho(t, resp); e.Body != `{"model":"m","prompt":"chunked"}` {
			t.Fatalf("body %q", e.Body)
		}
	})
	t.Run("base path", func(t *testing.T) {
		h2 := startProxy(t, nil, Options{}, be.URL+"/engine-a")
		resp, err := testClient.Get(h2.url + "/v1/models?q=1")
		if err != nil {
			t.Fatal(err)
		}
		if e := decodeEcho(t, resp); e.URI != "/engine-a/v1/models?q=1" {
			t.Fatalf("uri %q", e.URI)
		}
	})
}

func TestHeaderHygiene(t *testing.T) {
	be, _ := echoBackend(t, "a")
	h := startProxy(t, nil, Options{}, be.URL)

	req, _ := http.NewRequest("POST", h.url+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"hi"}`))
	req.Header.Set("Connection", "X-Secret, keep-alive")
	req.Header.Set("X-Secret", "hop")
	req.Header.Set("Proxy-Authorization", "Basic abc")
	req.Header.Set("Keep-Alive", "timeout=9")
	req.Header.Set("Te", "trailers")
	req.Header.Set("Upgrade", "h2c")
	req.Header.Set("X-Forwarded-For", "203.0.113.9")
	req.Header.Set("Authorization", "Bearer token")
	resp, err := testClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	id := resp.Header.Get("X-Request-Id")
	if resp.Header.Get("Keep-Alive") != "" {
		t.Errorf("response kept hop-by-hop Keep-Alive")
	}
	if resp.Header.Get("X-Backend") != "a" {
		t.Errorf("end-to-end response header lost")
	}
	e := decodeEcho(t, resp)
	for _, hop := range []string{"X-Secret", "Proxy-Authorization", "Keep-Alive", "Te", "Upgrade"} {
		if v, ok := e.Headers[hop]; ok {
			t.Errorf("backend got hop-by-hop %s: %v", hop, v)
		}
	}
	if got := e.Headers["Authorization"]; len(got) != 1 || got[0] != "Bearer token" {
		t.Errorf("Authorization = %v", got)
	}
	if got := e.Headers["X-Forwarded-For"]; len(got) != 1 || got[0] != "203.0.113.9, 127.0.0.1" {
		t.Errorf("X-Forwarded-For = %v", got)
	}
	if got := e.Headers["X-Forwarded-Proto"]; len(got) != 1 || got[0] != "http" {
		t.Errorf("X-Forwarded-Proto = %v", got)
	}
	if id == "" || len(e.Headers["X-Request-Id"]) != 1 || e.Headers["X-Request-Id"][0] != id {
		t.Errorf("generated request id %q, backend saw %v", id, e.Headers["X-Request-Id"])
	}

	resp = post(t, h.url+"/v1/completions", `{"model":"m","prompt":"hi"}`, "X-Request-Id", "client-id-7")
	if got := resp.Header.Get("X-Request-Id"); got != "client-id-7" {
		t.Errorf("echoed id %q", got)
	}
	if e := decodeEcho(t, resp); e.Headers["X-Request-Id"][0] != "client-id-7" {
		t.Errorf("backend id %v", e.Headers["X-Request-Id"])
	}
	resp = post(t, h.url+"/v1/completions", `{"model":"m","prompt":"hi"}`)
	if id2 := resp.Header.Get("X-Request-Id"); id2 == "" || id2 == id {
		t.Errorf("second generated id %q after %q", id2, id)
	}
	readAll(t, resp)
}

// sseBackend streams SSE events; each event after the first waits for a
// value on next (closed next: no more waiting). It reports on canceled when
// the request's context ends before the stream does.
type sseBackend struct {
	*httptest.Server
	next     chan struct{}
	canceled chan struct{}
}

func newSSEBackend(t testing.TB, events int, pace time.Duration) *sseBackend {
	b := &sseBackend{next: make(chan struct{}), canceled: make(chan struct{}, 16)}
	b.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		fl := w.(http.Flusher)
		for i := 0; i < events; i++ {
			if i > 0 {
				var tick <-chan time.Time
				if pace > 0 {
					tick = time.After(pace)
				}
				select {
				case <-b.next:
				case <-tick:
				case <-r.Context().Done():
					b.canceled <- struct{}{}
					return
				}
			}
			if _, err := fmt.Fprintf(w, "data: {\"i\":%d}\n\n", i); err != nil {
				b.canceled <- struct{}{}
				return
			}
			fl.Flush()
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}))
	t.Cleanup(b.Server.Close)
	return b
}

func TestStreamingFlushesEachEvent(t *testing.T) {
	be := newSSEBackend(t, 3, 0)
	h := startProxy(t, nil, Options{}, be.URL)
	resp := post(t, h.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`)
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("content type %q", ct)
	}
	br := bufio.NewReader(resp.Body)
	for i := 0; i < 3; i++ {
		// The backend sends event i only after we received event i-1: if
		// kvroute buffered, this would deadlock (and time out).
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if want := fmt.Sprintf("data: {\"i\":%d}\n", i); line != want {
			t.Fatalf("got %q want %q", line, want)
		}
		_, _ = br.ReadString('\n')
		if i < 2 {
			be.next <- struct{}{}
		}
	}
	rest, _ := io.ReadAll(br)
	if string(rest) != "data: [DONE]\n\n" {
		t.Fatalf("tail %q", rest)
	}
	h.waitIdle(t)
}

func TestClientDisconnectStopsUpstream(t *testing.T) {
	be := newSSEBackend(t, 1_000_000, 2*time.Millisecond)
	h := startProxy(t, nil, Options{}, be.URL)
	resp := post(t, h.url+"/v1/completions", `{"model":"m","prompt":"hi","stream":true}`)
	br := bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	if h.inFlight() != 1 {
		t.Fatalf("in-flight %d during the stream", h.inFlight())
	}
	resp.Body.Close() // the client goes away
	select {
	case <-be.canceled:
	case <-time.After(10 * time.Second):
		t.Fatal("the backend never saw the disconnect")
	}
	h.waitIdle(t)
	if n := counterValue(t, h.reg, "kvroute_requests_total", map[string]string{"code": "499"}); n != 1 {
		t.Fatalf("499s counted: %v", n)
	}
}

// counterValue sums the samples of a metric family whose labels include want.
func counterValue(t testing.TB, g prometheus.Gatherer, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for k, v := range want {
				found := false
				for _, lp := range m.GetLabel() {
					if lp.GetName() == k && lp.GetValue() == v {
						found = true
					}
				}
				if !found {
					continue next
				}
			}
			switch {
			case m.Counter != nil:
				sum += m.GetCounter().GetValue()
			case m.Gauge != nil:
				sum += m.GetGauge().GetValue()
			case m.Histogram != nil:
				sum += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return sum
}

// closedAddr returns a loopback URL nothing listens on.
func closedAddr(t testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return "http://" + addr
}

// statusBackend answers every request with code and a small JSON body.
func statusBackend(t testing.TB, code int) (*httptest.Server, *atomic.Int64) {
	var hits atomic.Int64
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		fmt.Fprintf(w, `{"error":{"message":"status %d","type":"x","param":null,"code":%d}}`, code, code)
	}))
	t.Cleanup(s.Close)
	return s, &hits
}

// fixedOrder picks the first endpoint not yet tried, in Set order.
type fixedOrder struct{}

func (fixedOrder) Pick(r *routing.Request, set *discovery.Set) routing.Decision {
	for _, e := range set.Endpoints {
		tried := false
		for _, x := range r.Tried {
			tried = tried || x == e
		}
		if !tried {
			return routing.Decision{Endpoint: e, Reason: "fixed"}
		}
	}
	return routing.Decision{}
}

func TestRetries(t *testing.T) {
	const body = `{"model":"m","prompt":"hi"}`
	t.Run("connection refused goes to another endpoint", func(t *testing.T) {
		good, hits := echoBackend(t, "good")
		h := startProxy(t, fixedOrder{}, Options{Limits: Limits{Retries: 2}}, closedAddr(t), good.URL)
		resp := post(t, h.url+"/v1/completions", body)
		if e := decodeEcho(t, resp); resp.StatusCode != 200 || e.Backend != "good" || e.Body != body {
			t.Fatalf("status %d from %q", resp.StatusCode, e.Backend)
		}
		if hits.Load() != 1 || counterValue(t, h.reg, "kvroute_retries_total", nil) != 1 {
			t.Fatal("expected one retry")
		}
	})
	for _, code := range []int{429, 503} { // refused: the engine started nothing
		t.Run(fmt.Sprintf("%d goes to another endpoint", code), func(t *testing.T) {
			bad, badHits := statusBackend(t, code)
			good, _ := echoBackend(t, "good")
			h := startProxy(t, fixedOrder{}, Options{Limits: Limits{Retries: 1}}, bad.URL, good.URL)
			resp := post(t, h.url+"/v1/completions", body)
			if e := decodeEcho(t, resp); e.Backend != "good" || badHits.Load() != 1 {
				t.Fatalf("served by %q after %d bad hits", e.Backend, badHits.Load())
			}
			h.waitIdle(t)
		})
	}
	// 502 and 504 may come from a sidecar whose engine started the request.
	for _, code := range []int{400, 404, 422, 500, 502, 504} {
		t.Run(fmt.Sprintf("%d is not retried", code), func(t *testing.T) {
			bad, _ := statusBackend(t, code)
			good, goodHits := echoBackend(t, "good")
			h := startProxy(t, fixedOrder{}, Options{Limits: Limits{Retries: 2}}, bad.URL, good.URL)
			resp := post(t, h.url+"/v1/completions", body)
			if got := readAll(t, resp); resp.StatusCode != code || !strings.Contains(got, "status") {
				t.Fatalf("status %d body %q", resp.StatusCode, got)
			}
			if goodHits.Load() != 0 {
				t.Fatal("retried a non-retryable status")
			}
		})
	}
	t.Run("last attempt's status is passed through", func(t *testing.T) {
		a, _ := statusBackend(t, 503)
		b, _ := statusBackend(t, 503)
		h := startProxy(t, fixedOrder{}, Options{Limits: Limits{Retries: 1}}, a.URL, b.URL)
		resp := post(t, h.url+"/v1/completions", body)
		if readAll(t, resp); resp.StatusCode != 503 {
			t.Fatalf("status %d", resp.StatusCode)
		}
	})
	t.Run("all endpoints refuse: 502 JSON", func(t *testing.T) {
		h := startProxy(t, fixedOrder{}, Options{Limits: Limits{Retries: 3}}, closedAddr(t), closedAddr(t))
		resp := post(t, h.url+"/v1/completions", body)
		assertOpenAIError(t, resp, 502)
		if h.inFlight() != 0 {
			t.Fatal("in-flight leaked")
		}
	})
	t.Run("no endpoint: 503 JSON", func(t *testing.T) {
		h := startProxy(t, nil, Options{})
		resp := post(t, h.url+"/v1/completions", body)
		assertOpenAIError(t, resp, 503)
	})
	t.Run("no retry after the first byte", func(t *testing.T) {
		broken := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "data: {\"i\":0}\n\n")
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler) // drop the connection mid-stream
		}))
		t.Cleanup(broken.Close)
		good, goodHits := echoBackend(t, "good")
		h := startProxy(t, fixedOrder{}, Options{Limits: Limits{Retries: 2}}, broken.URL, good.URL)
		resp := post(t, h.url+"/v1/completions", `{"model":"m","prompt":"hi","stream":true}`)
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.HasPrefix(string(got), "data: {\"i\":0}") || err != nil ||
			!strings.Contains(string(got), `"code":"upstream_stream_cut"`) {
			t.Fatalf("status %d body %q err %v: want the first event, then the cut event", resp.StatusCode, got, err)
		}
		if goodHits.Load() != 0 {
			t.Fatal("retried after the first byte")
		}
		h.waitIdle(t)
	})
	t.Run("response header timeout: 504", func(t *testing.T) {
		release := make(chan struct{})
		slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			select {
			case <-release:
			case <-r.Context().Done(): // kvroute gave up and closed the connection
			}
		}))
		t.Cleanup(func() { close(release); slow.Close() })
		h := startProxy(t, nil, Options{Limits: Limits{ResponseHeaderTimeout: 50 * time.Millisecond}}, slow.URL)
		resp := post(t, h.url+"/v1/completions", body)
		assertOpenAIError(t, resp, 504)
	})
}

func assertOpenAIError(t testing.TB, resp *http.Response, status int) {
	t.Helper()
	body := readAll(t, resp)
	if resp.StatusCode != status {
		t.Fatalf("status %d, want %d (%s)", resp.StatusCode, status, body)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Fatalf("content type %q", ct)
	}
	var e struct {
		Error *struct {
			Message *string `json:"message"`
			Type    *string `json:"type"`
			Code    *string `json:"code"`
		} `json:"error"`
	}
	if err := json.Unmarshal([]byte(body), &e); err != nil || e.Error == nil ||
		e.Error.Message == nil || e.Error.Type == nil || e.Error.Code == nil || *e.Error.Message == "" {
		t.Fatalf("not an OpenAI error body: %s", body)
	}
}

func TestBadRequests(t *testing.T) {
	be, hits := echoBackend(t, "a")
	h := startProxy(t, nil, Options{Limits: Limits{MaxBodyBytes: 4096}}, be.URL)
	tests := []struct {
		name, path, body string
		status           int
	}{
		{name: "malformed JSON", path: "/v1/completions", body: `{"model":`, status: 400},
		{name: "wrong type", path: "/v1/chat/completions", body: `{"model":"m","messages":"hi"}`, status: 400},
		{name: "bad token id", path: "/v1/completions", body: `{"model":"m","prompt":[1,2,-3]}`, status: 400},
		{name: "oversized", path: "/v1/completions", body: `{"model":"m","prompt":"` + strings.Repeat("x", 8192) + `"}`, status: 413},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			assertOpenAIError(t, post(t, h.url+tc.path, tc.body), tc.status)
		})
	}
	if hits.Load() != 0 {
		t.Fatal("a bad request reached the backend")
	}
	// Non-inference paths are forwarded unparsed: the engine judges them.
	resp := post(t, h.url+"/tokenize", `{not json`)
	if readAll(t, resp); resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
}

// panicOnRetry picks the first endpoint, and panics when asked again.
type panicOnRetry struct{}

func (panicOnRetry) Pick(r *routing.Request, set *discovery.Set) routing.Decision {
	if len(r.Tried) > 0 {
		panic("picker bug")
	}
	return routing.Decision{Endpoint: set.Endpoints[0]}
}

func TestPanicReleasesInFlight(t *testing.T) {
	bad, _ := statusBackend(t, 503)
	h := startProxy(t, panicOnRetry{}, Options{Limits: Limits{Retries: 1}}, bad.URL)
	resp := post(t, h.url+"/v1/completions", `{"model":"m","prompt":"hi"}`)
	assertOpenAIError(t, resp, 500)
	if h.inFlight() != 0 {
		t.Fatalf("in-flight %d after a panic", h.inFlight())
	}
}

// Every in-flight counter ends at zero after many requests with random
// client aborts, upstream failures, and streams of every length.
func TestInFlightAlwaysReleased(t *testing.T) {
	n := 10_000
	if testing.Short() {
		n = 1000
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		switch rand.IntN(6) {
		case 0:
			w.WriteHeader(503)
		case 1:
			panic(http.ErrAbortHandler)
		case 2:
			w.Header().Set("Content-Type", "text/event-stream")
			for i := 0; i < 5; i++ {
				fmt.Fprintf(w, "data: %d\n\n", i)
				w.(http.Flusher).Flush()
			}
			panic(http.ErrAbortHandler)
		default:
			w.Header().Set("Content-Type", "text/event-stream")
			for i := 0; i < 20; i++ {
				fmt.Fprintf(w, "data: %d\n\n", i)
				w.(http.Flusher).Flush()
			}
		}
	})
	var backends []string
	for i := 0; i < 3; i++ {
		s := httptest.NewServer(mux)
		t.Cleanup(s.Close)
		backends = append(backends, s.URL)
	}
	backends = append(backends, closedAddr(t))
	policy := routing.NewPrefix(prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: 1000}), 1024, routing.DefaultPrefixParams())
	h := startProxy(t, policy, Options{Limits: Limits{Retries: 1}}, backends...)
	prompts := make([]string, 8)
	for i := range prompts {
		prompts[i] = strings.Repeat(fmt.Sprintf("shared system prompt %d. ", i), 200)
	}

	var wg sync.WaitGroup
	work := make(chan int)
	for w := 0; w < 32; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range work {
				ctx, cancel := context.WithCancel(context.Background())
				body := fmt.Sprintf(`{"model":"m","prompt":"%s question %d","stream":true}`, prompts[rand.IntN(len(prompts))], rand.IntN(1000))
				req, _ := http.NewRequestWithContext(ctx, "POST", h.url+"/v1/completions", strings.NewReader(body))
				resp, err := testClient.Do(req)
				if err == nil {
					if rand.IntN(3) == 0 { // the client aborts mid-stream
						buf := make([]byte, 1+rand.IntN(20))
						_, _ = resp.Body.Read(buf)
						cancel()
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
				cancel()
			}
		}()
	}
	for i := 0; i < n; i++ {
		work <- i
	}
	close(work)
	wg.Wait()
	h.waitIdle(t)
	for _, e := range h.pool.Load().Endpoints {
		if e.InFlight() != 0 || e.PendingPrefill() != 0 {
			t.Errorf("%s in-flight %d requests, %d prefill tokens", e, e.InFlight(), e.PendingPrefill())
		}
	}
	if g := counterValue(t, h.reg, "kvroute_in_flight_requests", nil); g != 0 {
		t.Errorf("in-flight gauge %v", g)
	}
	if total := counterValue(t, h.reg, "kvroute_requests_total", nil); total != float64(n) {
		t.Errorf("requests counted %v, want %d", total, n)
	}
}
