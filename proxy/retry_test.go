package proxy

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

// TestRealPoliciesRetry: under the real least-request and prefix policies
// (not a test picker), a request whose first endpoint refuses the
// connection, answers 503, or reads it and closes or resets the connection
// before any answer (or within its header) is re-sent to the other
// endpoint and succeeds there; a request whose endpoint answered 200 is
// never re-sent, even when its body then breaks. The endpoints are on a
// bare Pool (no ejection), so the failing one keeps being picked.
func TestRealPoliciesRetry(t *testing.T) {
	for _, policy := range []string{"least-request", "prefix"} {
		t.Run(policy, func(t *testing.T) {
			t.Run("connection refused", func(t *testing.T) {
				good, goodHits := namedBackend(t, "good", 200)
				bad := closedAddr(t)
				h := startProxy(t, policyByName(t, policy), Options{Limits: Limits{Retries: 2}}, bad, good.URL)
				n := retryUntilTried(t, h, h.pool.Load().Endpoints[0])
				if goodHits.Load() != int64(n) {
					t.Errorf("good backend answered %d of %d requests", goodHits.Load(), n)
				}
			})
			t.Run("503", func(t *testing.T) {
				good, goodHits := namedBackend(t, "good", 200)
				bad, badHits := namedBackend(t, "busy", 503)
				h := startProxy(t, policyByName(t, policy), Options{Limits: Limits{Retries: 2}}, bad.URL, good.URL)
				n := retryUntilTried(t, h, h.pool.Load().Endpoints[0])
				if goodHits.Load() != int64(n) || badHits.Load() != int64(h.pool.Load().Endpoints[0].Requests()) {
					t.Errorf("good backend answered %d of %d requests; busy one %d", goodHits.Load(), n, badHits.Load())
				}
			})
			for name, drop := range map[string]func(net.Conn){"closed unanswered": func(c net.Conn) { _ = c.Close() }, "reset unanswered": reset,
				"closed in its header": func(c net.Conn) { _, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-"); _ = c.Close() }} {
				t.Run(name, func(t *testing.T) {
					good, goodHits := namedBackend(t, "good", 200)
					bad := droppingBackend(t, drop)
					h := startProxy(t, policyByName(t, policy), Options{Limits: Limits{Retries: 2}}, bad.url, good.URL)
					n := retryUntilTried(t, h, h.pool.Load().Endpoints[0])
					if read := len(bad.received()); goodHits.Load() != int64(n) || read != int(h.pool.Load().Endpoints[0].Requests()) {
						t.Errorf("good backend answered %d of %d requests; the dropping one read %d", goodHits.Load(), n, read)
					}
				})
			}
			t.Run("200 is final", func(t *testing.T) {
				a, aHits := namedBackend(t, "a", 200)
				b, bHits := namedBackend(t, "b", 200)
				h := startProxy(t, policyByName(t, policy), Options{Limits: Limits{Retries: 2}}, a.URL, b.URL)
				const n = 30
				for i := range n {
					if code, from := completion(t, h.url, i); code != 200 || from == "" {
						t.Fatalf("status %d from %q", code, from)
					}
				}
				if got := aHits.Load() + bHits.Load(); got != n {
					t.Errorf("%d upstream requests for %d client requests", got, n)
				}
				if r := counterValue(t, h.reg, "kvroute_retries_total", nil); r != 0 {
					t.Errorf("%v retries after 200s", r)
				}
			})
			t.Run("200 whose stream breaks is final", func(t *testing.T) {
				var hits atomic.Int64
				broken := func() string {
					s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
						hits.Add(1)
						_, _ = io.Copy(io.Discard, r.Body)
						w.Header().Set("Content-Type", "text/event-stream")
						_, _ = io.WriteString(w, "data: {\"i\":0}\n\n")
						w.(http.Flusher).Flush()
						panic(http.ErrAbortHandler) // drop the connection mid-stream
					}))
					t.Cleanup(s.Close)
					return s.URL
				}
				h := startProxy(t, policyByName(t, policy), Options{Limits: Limits{Retries: 2}}, broken(), broken())
				const n = 10
				for i := range n {
					resp := post(t, h.url+"/v1/completions",
						fmt.Sprintf(`{"model":"m","prompt":"request %d","stream":true}`, i))
					got, err := io.ReadAll(resp.Body)
					resp.Body.Close()
					if resp.StatusCode != 200 || !strings.HasPrefix(string(got), "data: {\"i\":0}") || err != nil ||
						!strings.Contains(string(got), `"code":"upstream_stream_cut"`) {
						t.Fatalf("status %d body %q err %v: want the first event, then the cut event", resp.StatusCode, got, err)
					}
				}
				h.waitIdle(t)
				if hits.Load() != n {
					t.Errorf("%d upstream requests for %d client requests", hits.Load(), n)
				}
				if r := counterValue(t, h.reg, "kvroute_retries_total", nil); r != 0 {
					t.Errorf("%v retries after 200s", r)
				}
			})
		})
	}
}

// droppingBackend reads each request whole, then ends its connection with
// drop, unanswered.
func droppingBackend(t *testing.T, drop func(net.Conn)) *rawEndpoint {
	return startRawEndpoint(t, func(c net.Conn, _ []byte) { drop(c) })
}

// retryUntilTried sends distinct requests through h until the policy has
// sent at least three of them to bad first (the policies choose at
// random or by hashing, so which requests do is not known in advance),
// checks every one was answered 200 by the good backend, that each
// attempt on bad was followed by one retry and nothing else was retried,
// and returns the number of requests sent.
func retryUntilTried(t *testing.T, h *harness, bad *discovery.Endpoint) int {
	t.Helper()
	n := 0
	for ; bad.Requests() < 3; n++ {
		if n == 300 {
			t.Fatalf("the policy tried the failing endpoint %d times in %d requests", bad.Requests(), n)
		}
		if code, from := completion(t, h.url, n); code != 200 || from != "good" {
			t.Fatalf("request %d: status %d from %q, want 200 from the good backend", n, code, from)
		}
	}
	if r := counterValue(t, h.reg, "kvroute_retries_total", nil); r != float64(bad.Requests()) {
		t.Errorf("%v retries for %d attempts on the failing endpoint", r, bad.Requests())
	}
	h.waitIdle(t)
	return n
}

// A pod that answers 429 to everything sheds load: after its first 429 it
// takes no new requests for a while (doubling while the storm lasts), so
// it cannot absorb the fleet's traffic; every request succeeds elsewhere.
func TestShedding429Storm(t *testing.T) {
	var hits atomic.Int64
	storm := instantHandler(t, func(ctx *fasthttp.RequestCtx) {
		hits.Add(1)
		ctx.SetStatusCode(fasthttp.StatusTooManyRequests)
		ctx.SetBodyString(`{"error":{"message":"busy","type":"RateLimitError","param":null,"code":429}}`)
	})
	h := startProxy(t, routing.NewRoundRobin(), Options{Limits: Limits{Retries: 2}}, storm, instantBackend(t), instantBackend(t))
	const n = 90
	for i := range n {
		resp, err := http.Post(h.url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"x"}`))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: %d", i, resp.StatusCode)
		}
	}
	// Without shedding the pod got 44 of the 90 in a run.
	if v := hits.Load(); v > 3 {
		t.Errorf("the 429 pod got %d of %d requests", v, n)
	}
}

// The access line of a request says why each of its failed attempts
// failed (failed_attempts, the kinds of kvroute_upstream_errors_total):
// an endpoint that reset the connection unanswered, then one that answered
// 503, before the one that answered; and one that reset it after a whole
// answer's header, before its body (body, not dropped).
func TestAccessLogNamesFailedAttempts(t *testing.T) {
	headerOnly := func(c net.Conn) {
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
		reset(c)
	}
	for _, tc := range []struct {
		first []func(net.Conn)
		want  string
	}{{[]func(net.Conn){reset, nil}, failDropped + "," + failStatus}, {[]func(net.Conn){headerOnly}, failBody}} {
		var urls []string
		for _, drop := range tc.first {
			if drop == nil {
				busy, _ := statusBackend(t, 503)
				urls = append(urls, busy.URL)
				continue
			}
			urls = append(urls, droppingBackend(t, drop).url)
		}
		good, _ := namedBackend(t, "good", 200)
		var out lineBuffer
		h := startProxy(t, fixedOrder{}, Options{AccessLog: &out, Limits: Limits{Retries: 2}}, append(urls, good.URL)...)
		if code, from := completion(t, h.url, 0); code != 200 || from != "good" {
			t.Fatalf("%s: status %d from %q", tc.want, code, from)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = h.srv.Shutdown(ctx) // writes the lines waiting
		cancel()
		lines := out.lines(t)
		if len(lines) != 1 || lines[0]["attempts"] != float64(len(urls)+1) || lines[0]["failed_attempts"] != tc.want {
			t.Errorf("access lines %v: want one, of %d attempts, failed_attempts %q", lines, len(urls)+1, tc.want)
		}
	}
}
