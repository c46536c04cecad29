package proxy

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvroute/kvroute/routing"
)

// guard bounds every wait of these tests: a deadlock guard, not a speed
// assertion.
const guard = 10 * time.Second

// rawRequest sends raw bytes to addr and returns what came back until the
// connection closed or guard passed.
func rawRequest(t testing.TB, addr string, req []byte) []byte {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(guard))
	if _, err := c.Write(req); err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(c)
	return out
}

func hostport(url string) string { return strings.TrimPrefix(url, "http://") }

// A prompt of millions of token ids, inside the body limit, is refused
// with vLLM's context-length error before the parser allocates a value
// for each id: the router's allocations stay a small multiple of the body.
// (It took ≈ 4 GB of RSS before.)
func TestHugeTokenPromptIsRefusedCheaply(t *testing.T) {
	be, hits := echoBackend(t, "a")
	h := startProxy(t, nil, Options{Limits: Limits{MaxBodyBytes: 64 << 20, MaxPromptTokens: 4096}}, be.URL)
	var b bytes.Buffer
	b.WriteString(`{"model":"m","prompt":[`)
	for i := range 4 << 20 { // 4M ids, 8 MiB
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteByte('1')
	}
	b.WriteString(`]}`)
	body := b.String()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	resp := post(t, h.url+"/v1/completions", body)
	runtime.ReadMemStats(&after)
	out := readAll(t, resp)
	if resp.StatusCode != 400 || !strings.Contains(out, "maximum context length is 4096 tokens") {
		t.Fatalf("status %d: %s", resp.StatusCode, out)
	}
	// The client's own copy, fasthttp's body buffer and the scan: a few
	// bodies, where a parse would allocate ≈ 40 bytes per byte.
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 8*uint64(len(body)) {
		t.Errorf("refusing an %d-byte body allocated %d bytes", len(body), alloc)
	}
	// Just over the limit, exactly counted.
	ids := strings.TrimSuffix(strings.Repeat("7,", 4097), ",")
	resp = post(t, h.url+"/v1/completions", `{"model":"m","prompt":[`+ids+`]}`)
	if out := readAll(t, resp); resp.StatusCode != 400 || !strings.Contains(out, "you requested 4097 tokens") {
		t.Fatalf("4097 ids: %d %s", resp.StatusCode, out)
	}
	if hits.Load() != 0 {
		t.Fatal("a refused prompt reached the engine")
	}
	ids = strings.TrimSuffix(strings.Repeat("7,", 4096), ",")
	if resp := post(t, h.url+"/v1/completions", `{"model":"m","prompt":[`+ids+`]}`); resp.StatusCode != 200 {
		t.Fatalf("4096 ids: %d", resp.StatusCode)
	}
}

// Client mistakes never count against a pod: kvroute sets the upstream
// Host itself, whatever the client sent or omitted, and a Connection
// header naming Host removes nothing.
func TestClientHeadersNeverEjectAPod(t *testing.T) {
	be, _ := echoBackend(t, "a")
	h := startProxy(t, nil, Options{}, be.URL)
	ep := h.pool.Load().Endpoints[0]
	addr := hostport(h.url)
	body := `{"model":"m","prompt":"hi"}`
	for i := range 8 {
		var req string
		if i%2 == 0 {
			req = "POST /v1/completions HTTP/1.1\r\nHost: kvroute\r\nConnection: close, Host, Content-Length\r\nContent-Type: application/json\r\nContent-Length: " +
				strconv.Itoa(len(body)) + "\r\n\r\n" + body
		} else {
			req = "POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: " +
				strconv.Itoa(len(body)) + "\r\n\r\n" + body
		}
		out := string(rawRequest(t, addr, []byte(req)))
		if !strings.Contains(out, " 200 OK") || !strings.Contains(out, `"host":"`+ep.Addr+`"`) {
			t.Fatalf("request %d: %s", i, out)
		}
	}
	if f := ep.Failures.Load(); f != 0 || !ep.Routable() {
		t.Fatalf("a healthy pod took %d failures (routable %v)", f, ep.Routable())
	}
}

// stallingBackend accepts connections and, per request, writes prefix and
// then stalls until the test ends; it counts the requests it received.
func stallingBackend(t testing.TB, prefix string) (url string, requests *atomic.Int64) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	requests = new(atomic.Int64)
	done := make(chan struct{})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				if _, err := http.ReadRequest(br); err != nil {
					return
				}
				requests.Add(1)
				_, _ = c.Write([]byte(prefix))
				select {
				case <-done:
				case <-time.After(guard):
				}
			}()
		}
	}()
	t.Cleanup(func() { close(done); ln.Close() })
	return "http://" + ln.Addr().String(), requests
}

// A pod that sends part of its header and stalls is timed out like one
// that sends nothing: 504 at the response-header timeout, and a request
// that may have started is never re-sent (three stalling pods: one ran
// it).
func TestPartialHeaderStallTimesOutWithoutResending(t *testing.T) {
	for _, prefix := range []string{"", "HTTP/1.1 200 OK\r\nContent-Type: app"} {
		var urls []string
		var counts []*atomic.Int64
		for range 3 {
			u, n := stallingBackend(t, prefix)
			urls, counts = append(urls, u), append(counts, n)
		}
		h := startProxy(t, nil, Options{Limits: Limits{Retries: 2, ResponseHeaderTimeout: 300 * time.Millisecond}}, urls...)
		resp := post(t, h.url+"/v1/completions", `{"model":"m","prompt":"hi"}`)
		assertOpenAIError(t, resp, http.StatusGatewayTimeout)
		var total int64
		for _, n := range counts {
			total += n.Load()
		}
		if total != 1 {
			t.Fatalf("prefix %q: %d pods ran the request", prefix, total)
		}
		h.waitIdle(t)
	}
}

// A retryable answer's body is read only a little, under a deadline: a
// huge or stalling 503 body neither holds the request nor fills memory;
// the request goes to the next pod.
func TestRetryableBodyIsNotDrainedWhole(t *testing.T) {
	huge := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(300<<20))
		w.WriteHeader(503)
		chunk := make([]byte, 64<<10)
		for range 300 << 4 { // 300 MiB, unless the reader leaves
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	}))
	defer huge.Close()
	stall, _ := stallingBackend(t, "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 100\r\n\r\nx")
	good, _ := echoBackend(t, "good")
	for _, bad := range []string{huge.URL, stall} {
		h := startProxy(t, fixedOrder{}, Options{Limits: Limits{Retries: 1}}, bad, good.URL)
		start := time.Now()
		resp := post(t, h.url+"/v1/completions", `{"model":"m","prompt":"hi"}`)
		if e := decodeEcho(t, resp); e.Backend != "good" {
			t.Fatalf("served by %q", e.Backend)
		}
		if d := time.Since(start); d > guard/2 {
			t.Fatalf("the retry waited %s for the bad body", d)
		}
		h.waitIdle(t)
	}
}

// Defaults a production proxy has: a stream that stalls is closed, a
// client's header and body must keep coming.
func TestDefaultTimeouts(t *testing.T) {
	d := DefaultLimits()
	if d.StreamIdleTimeout <= 0 || d.StreamIdleTimeout > 5*time.Minute || d.ClientHeaderTimeout <= 0 ||
		d.ClientHeaderTimeout > time.Minute || d.ClientBodyTimeout <= 0 || d.MaxHeaderBytes < 8<<10 {
		t.Fatalf("defaults: stream idle %s, client header %s, client body %s, header bytes %d",
			d.StreamIdleTimeout, d.ClientHeaderTimeout, d.ClientBodyTimeout, d.MaxHeaderBytes)
	}
}

// A client that sends its header a byte at a time, stops mid-header, or
// stops sending its body is disconnected at the timeouts.
func TestSlowClientsAreDisconnected(t *testing.T) {
	be, hits := echoBackend(t, "a")
	h := startProxy(t, nil, Options{Limits: Limits{ClientHeaderTimeout: 400 * time.Millisecond,
		ClientBodyTimeout: 400 * time.Millisecond, ClientIdleTimeout: time.Minute}}, be.URL)
	addr := hostport(h.url)
	cases := map[string]func(c net.Conn){
		"header a byte at a time": func(c net.Conn) {
			for _, b := range []byte("POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + strings.Repeat("a", 100)) {
				if _, err := c.Write([]byte{b}); err != nil {
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
		},
		"stops mid-header": func(c net.Conn) { _, _ = c.Write([]byte("POST /v1/completions HTTP/1.1\r\nHost: x\r\n")) },
		"stops mid-body": func(c net.Conn) {
			_, _ = c.Write([]byte("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\""))
		},
	}
	for name, send := range cases {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		go send(c)
		_ = c.SetReadDeadline(time.Now().Add(guard))
		_, _ = io.ReadAll(c) // until kvroute closes
		if d := time.Since(start); d >= guard {
			t.Errorf("%s: still connected after %s", name, d)
		}
		c.Close()
	}
	if hits.Load() != 0 {
		t.Fatal("an incomplete request reached the engine")
	}
}

// Headers of 8–16 KiB are accepted (bearer tokens, cookies); larger ones
// get 431, and no error ever echoes a header.
func TestLargeHeaders(t *testing.T) {
	be, _ := echoBackend(t, "a")
	h := startProxy(t, nil, Options{}, be.URL)
	const secret = "sk-SECRET-TOKEN-"
	for _, n := range []int{4200, 12 << 10} {
		resp := post(t, h.url+"/v1/completions", `{"model":"m","prompt":"hi"}`, "Authorization", "Bearer "+secret+strings.Repeat("x", n))
		if resp.StatusCode != 200 {
			t.Fatalf("a %d-byte Authorization header: %d", n, resp.StatusCode)
		}
		readAll(t, resp)
	}
	req := "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + secret + strings.Repeat("x", 20<<10) + "\r\nContent-Length: 2\r\n\r\n{}"
	out := string(rawRequest(t, hostport(h.url), []byte(req)))
	if !strings.HasPrefix(out, "HTTP/1.1 431 ") || strings.Contains(out, secret) || !strings.Contains(out, `"code":"header_too_large"`) ||
		!strings.Contains(out, "X-Request-Id: ") {
		t.Fatalf("a 20 KiB header: %.300s", out)
	}
	for _, bad := range []string{"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + secret + "\r\nX-No-Colon\r\n\r\n",
		"GARBAGE " + secret + "\r\n\r\n"} {
		out := string(rawRequest(t, hostport(h.url), []byte(bad)))
		if !strings.HasPrefix(out, "HTTP/1.1 400 ") || strings.Contains(out, secret) {
			t.Fatalf("malformed request answered %.300s", out)
		}
	}
}

// heldBackend holds every request open until the client (kvroute) goes
// away, and reports each disconnect.
func heldBackend(t testing.TB, stream bool) (*httptest.Server, chan struct{}) {
	gone := make(chan struct{}, 16)
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if stream {
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(200)
			w.(http.Flusher).Flush() // headers now; the first token never comes
		}
		select {
		case <-r.Context().Done():
			gone <- struct{}{}
		case <-time.After(guard):
		}
	}))
	t.Cleanup(s.Close)
	return s, gone
}

// A client that abandons a request is noticed within about a second, and
// the upstream request is cancelled (the engine stops generating), before
// the first byte too; the pod is not blamed.
func TestAbandonedRequestIsCancelledUpstream(t *testing.T) {
	for _, stream := range []bool{false, true} {
		be, gone := heldBackend(t, stream)
		h := startProxy(t, nil, Options{}, be.URL)
		c, err := net.Dial("tcp", hostport(h.url))
		if err != nil {
			t.Fatal(err)
		}
		body := fmt.Sprintf(`{"model":"m","prompt":"hi","max_tokens":30000,"stream":%v}`, stream)
		fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		deadline := time.Now().Add(guard)
		for h.inFlight() == 0 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		c.Close()
		select {
		case <-gone:
		case <-time.After(guard):
			t.Fatalf("stream %v: the engine kept generating for an abandoned request", stream)
		}
		h.waitIdle(t)
		if f := h.pool.Load().Endpoints[0].Failures.Load(); f != 0 {
			t.Fatalf("stream %v: the pod was blamed for a client leaving (%d failures)", stream, f)
		}
		if n := counterValue(t, h.reg, "kvroute_upstream_cancellations_total", nil); n < 1 && !stream {
			t.Fatalf("cancellations counted: %v", n)
		}
	}
}

// An HTTP/1.0 client cannot read chunked encoding: a stream reaches it
// close-delimited.
func TestHTTP10StreamIsCloseDelimited(t *testing.T) {
	be := newSSEBackend(t, 5, time.Millisecond)
	h := startProxy(t, nil, Options{}, be.URL)
	body := `{"model":"m","prompt":"hi","stream":true}`
	out := string(rawRequest(t, hostport(h.url), []byte("POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: "+
		strconv.Itoa(len(body))+"\r\n\r\n"+body)))
	head, payload, ok := strings.Cut(out, "\r\n\r\n")
	if !ok || !strings.Contains(head, " 200 ") || strings.Contains(strings.ToLower(head), "transfer-encoding") ||
		strings.Count(payload, "data: ") != 6 || !strings.HasSuffix(payload, "data: [DONE]\n\n") {
		t.Fatalf("HTTP/1.0 stream:\n%s", out)
	}
	h.waitIdle(t)
}

// An endpoint out of connections is busy, not broken: the request goes to
// another, nothing is ejected; with no other, the request waits for the
// queue timeout and gets 429 with Retry-After.
func TestBusyEndpointIsNotBroken(t *testing.T) {
	held, _ := heldBackend(t, false)
	free, freeHits := echoBackend(t, "free")
	h := startProxy(t, fixedOrder{}, Options{Limits: Limits{MaxConnsPerEndpoint: 1, Retries: 2, QueueTimeout: 200 * time.Millisecond, MaxQueue: 4}},
		held.URL, free.URL)
	c, err := net.Dial("tcp", hostport(h.url))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	body := `{"model":"m","prompt":"hi"}`
	fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	ep := h.pool.Load().Endpoints[0]
	for deadline := time.Now().Add(guard); ep.InFlight() == 0 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	for range 3 {
		if e := decodeEcho(t, post(t, h.url+"/v1/completions", body)); e.Backend != "free" {
			t.Fatalf("served by %q", e.Backend)
		}
	}
	if ep.Failures.Load() != 0 || !ep.Routable() || freeHits.Load() != 3 {
		t.Fatalf("busy endpoint: %d failures, routable %v; free served %d", ep.Failures.Load(), ep.Routable(), freeHits.Load())
	}

	one := startProxy(t, nil, Options{Limits: Limits{MaxConnsPerEndpoint: 1, QueueTimeout: 200 * time.Millisecond, MaxQueue: 4}}, held.URL)
	c2, err := net.Dial("tcp", hostport(one.url))
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	fmt.Fprintf(c2, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	for deadline := time.Now().Add(guard); one.inFlight() == 0 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	resp := post(t, one.url+"/v1/completions", body)
	if resp.Header.Get("Retry-After") == "" {
		t.Error("429 without Retry-After")
	}
	assertOpenAIError(t, resp, http.StatusTooManyRequests)
	if e := one.pool.Load().Endpoints[0]; e.Failures.Load() != 0 {
		t.Fatalf("the busy endpoint took %d failures", e.Failures.Load())
	}
}

// An endpoint at --max-in-flight-per-endpoint is saturated: policies skip
// it, and a request waits for room rather than queueing behind it.
func TestInFlightCapQueuesInKvroute(t *testing.T) {
	be, hits := echoBackend(t, "a")
	h := startProxy(t, routing.NewLeastRequest(nil), Options{Limits: Limits{MaxInFlightPerEndpoint: 1, QueueTimeout: guard, MaxQueue: 4}}, be.URL)
	ep := h.pool.Load().Endpoints[0]
	l := ep.Acquire(0) // one request in flight: the endpoint is at its cap
	done := make(chan *http.Response, 1)
	go func() { done <- post(t, h.url+"/v1/completions", `{"model":"m","prompt":"hi"}`) }()
	time.Sleep(100 * time.Millisecond)
	if hits.Load() != 0 {
		t.Fatal("a saturated endpoint got a request")
	}
	l.Release()
	select {
	case resp := <-done:
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		readAll(t, resp)
	case <-time.After(guard):
		t.Fatal("the queued request never left the queue")
	}
}

// Retries stay within the budget: a fleet answering 503 gets at most the
// budget's share of extra requests, not a multiple.
func TestRetryBudget(t *testing.T) {
	var urls []string
	for range 4 {
		s, _ := statusBackend(t, 503)
		urls = append(urls, s.URL)
	}
	h := startProxy(t, nil, Options{Limits: Limits{Retries: 3, RetryBudget: 0.2, MinRetries: 2}}, urls...)
	for range 50 {
		readAll(t, post(t, h.url+"/v1/completions", `{"model":"m","prompt":"hi"}`))
	}
	retries := counterValue(t, h.reg, "kvroute_retries_total", nil)
	if retries > 12 || retries < 2 {
		t.Fatalf("%v retries for 50 requests under a 20%% budget", retries)
	}
	if counterValue(t, h.reg, "kvroute_retries_budget_exhausted_total", nil) == 0 {
		t.Fatal("the budget never ran out")
	}
}

// Every error kvroute answers itself carries the request id: the client's,
// or one it generated — 400s included.
func TestErrorsCarryRequestID(t *testing.T) {
	h := startProxy(t, nil, Options{}, closedAddr(t))
	resp := post(t, h.url+"/v1/completions", `{"model":`, "X-Request-Id", "client-id-1")
	if resp.Header.Get("X-Request-Id") != "client-id-1" {
		t.Fatalf("400 without the client's id: %v", resp.Header)
	}
	assertOpenAIError(t, resp, 400)
	resp = post(t, h.url+"/v1/completions", `{"model":"m","prompt":"hi"}`)
	if resp.Header.Get("X-Request-Id") == "" {
		t.Fatal("502 without a request id")
	}
	assertOpenAIError(t, resp, 502)
}

// Every upstream attempt carries a W3C traceparent: the client's trace id
// and flags with a parent id of its own (so engine-side traces join), or a
// new trace; tracestate passes untouched.
func TestTraceparentOnEveryAttempt(t *testing.T) {
	be, _ := echoBackend(t, "a")
	h := startProxy(t, nil, Options{}, be.URL)
	const client = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	e := decodeEcho(t, post(t, h.url+"/v1/completions", `{"model":"m","prompt":"hi"}`, "traceparent", client, "tracestate", "vendor=x"))
	got := e.Headers["Traceparent"]
	if len(got) != 1 || len(got[0]) != 55 || got[0][:36] != client[:36] || got[0][52:] != "-01" || got[0][36:52] == client[36:52] ||
		e.Headers["Tracestate"][0] != "vendor=x" {
		t.Fatalf("upstream traceparent %v, tracestate %v (client's %s)", got, e.Headers["Tracestate"], client)
	}
	for _, bad := range []string{"", "01-zz", "00-00000000000000000000000000000000-00f067aa0ba902b7-01"} {
		e := decodeEcho(t, post(t, h.url+"/v1/completions", `{"model":"m","prompt":"hi"}`, "traceparent", bad))
		tp := e.Headers["Traceparent"]
		if len(tp) != 1 || len(tp[0]) != 55 || !strings.HasPrefix(tp[0], "00-") || strings.HasPrefix(tp[0], "00-0000") || !strings.HasSuffix(tp[0], "-00") {
			t.Fatalf("client traceparent %q: upstream %v, want a new trace", bad, tp)
		}
	}
}

// An endpoint's response header block is bounded by the upstream read
// buffer: one that fits passes, a larger one is a 502 that says so and
// quotes nothing the endpoint sent.
func TestEndpointHeaderBound(t *testing.T) {
	for _, tc := range []struct {
		size   int
		status int
	}{{upstreamHeaderBytes - 1024, 200}, {upstreamHeaderBytes + 1024, 502}} {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		s := &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
			ctx.Response.Header.Set("X-Big", strings.Repeat("s", tc.size))
			ctx.SetBodyString(`{"ok":1}`)
		}}
		go func() { _ = s.Serve(ln) }()
		t.Cleanup(func() { _ = s.Shutdown() })
		h := startProxy(t, nil, Options{}, "http://"+ln.Addr().String())
		resp, err := http.Post(h.url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"x"}`))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.status {
			t.Fatalf("header of %d bytes: %d %s", tc.size, resp.StatusCode, b)
		}
		if tc.status == 502 && (!strings.Contains(string(b), "response header block is larger than 8 KiB") || strings.Contains(string(b), "sss")) {
			t.Errorf("502 body %s", b)
		}
	}
}
