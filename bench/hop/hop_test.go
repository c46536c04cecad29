package hop

import (
	"context"
	"net"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute/app"
)

const wrkOutput = `Running 5s test @ http://127.0.0.1:8000
  2 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   612.34us  301.12us  12.50ms   91.00%
    Req/Sec    24.10k     1.20k   26.00k    70.00%
  Latency Distribution
     50%  576.00us
     75%  701.00us
     90%  880.00us
     99%    1.50ms
  240123 requests in 5.00s, 90.12MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 3
Requests/sec:  48024.60
Transfer/sec:     18.02MB
`

func TestParseWrk(t *testing.T) {
	m, err := parseWrk(wrkOutput)
	if err != nil {
		t.Fatal(err)
	}
	if m.RPS != 48024.60 || m.P50us != 576 || m.P99us != 1500 || m.Errs != 6 {
		t.Errorf("parsed %+v", m)
	}
	if _, err := parseWrk("garbage"); err == nil {
		t.Error("garbage parsed")
	}
}

func TestMarkdownRatiosToNginx(t *testing.T) {
	r := &Report{Rounds: 1, Duration: "1s", Events: 100, Targets: Targets, Rows: []Row{{Case: Case{Name: "stream-1KiB", Conns: 1, Stream: true},
		Targets: map[string]Measure{"direct": {RPS: 100, P50us: 100}, "kvroute": {RPS: 50, P50us: 300},
			"nginx": {RPS: 100, P50us: 200}, "haproxy": {RPS: 200, P50us: 150}}}}}
	md := r.Markdown()
	for _, want := range []string{"| stream-1KiB | 1 | kvroute | 50 (5k events/s) | 0.50× | 300 µs | +200 µs (+2.0 µs/event)", "| haproxy | 200 (20k events/s) | 2.00×"} {
		if !strings.Contains(md, want) {
			t.Errorf("table lacks %q:\n%s", want, md)
		}
	}
}

// Without nginx or direct in the run, the ratio and the added latency
// are dashes, not infinities.
func TestMarkdownWithoutAnchors(t *testing.T) {
	r := &Report{Rounds: 1, Duration: "1s", Targets: []string{"kvroute", EventsTarget}, Rows: []Row{{Case: Case{Name: "completion-1KiB", Conns: 1},
		Targets: map[string]Measure{"kvroute": {RPS: 100, P50us: 300}, EventsTarget: {RPS: 90, P50us: 310}}}}}
	md := r.Markdown()
	if want := "| completion-1KiB | 1 | kvroute+events | 90 | – | 310 µs | – | 0 µs | – | – | 0 |"; !strings.Contains(md, want) || strings.Contains(md, "Inf") {
		t.Errorf("table lacks %q or has an infinity:\n%s", want, md)
	}
}

func TestCasesHaveTheirSizes(t *testing.T) {
	for _, c := range Cases() {
		n := len(c.body)
		want := 1 << 10
		if strings.HasPrefix(c.Name, "chat-128KiB") {
			want = 128 << 10
		}
		if n < want*9/10 || n > want*11/10 {
			t.Errorf("%s: %d bytes", c.Name, n)
		}
	}
}

func TestRSSOfThisProcess(t *testing.T) {
	if _, err := os.Stat("/proc/self/status"); err != nil {
		t.Skip("no /proc")
	}
	if kib, err := rssKiB(os.Getpid()); err != nil || kib <= 0 {
		t.Fatalf("rss %d KiB, %v", kib, err)
	}
}

// A held stream answers its first event at once and ends on release.
func TestHoldBackend(t *testing.T) {
	be, err := startHoldBackend(1)
	if err != nil {
		t.Fatal(err)
	}
	defer be.close()
	conns, err := openConns(context.Background(), be.addrs[0], 3, httpPost("/v1/completions", `{"stream":true}`), []byte("data: "))
	if err != nil {
		t.Fatal(err)
	}
	closeAll(conns)
}

// The bare proxy passes a whole answer and a stream through unchanged.
func TestServeBare(t *testing.T) {
	be, err := startBackend(3, false)
	if err != nil {
		t.Fatal(err)
	}
	defer be.close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- ServeBare(ln, be.addr) }()
	defer func() {
		ln.Close()
		<-done
	}()
	for _, c := range []struct {
		body string
		want []byte
	}{{`{"model":"m","prompt":"x"}`, be.full}, {`{"model":"m","prompt":"x","stream":true}`, []byte(strings.Repeat(string(be.event), 3) + "data: [DONE]\n\n")}} {
		req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
		req.SetRequestURI("http://" + ln.Addr().String() + "/v1/completions")
		req.Header.SetMethod("POST")
		req.SetBodyString(c.body)
		if err := fasthttp.DoTimeout(req, resp, 5*time.Second); err != nil || resp.StatusCode() != 200 || string(resp.Body()) != string(c.want) {
			t.Errorf("%s: %v %d %q", c.body, err, resp.StatusCode(), resp.Body())
		}
		fasthttp.ReleaseRequest(req)
		fasthttp.ReleaseResponse(resp)
	}
}

// The kvroute+events target's backend is one kvroute's engine truth
// understands: its batches decode, its /tokenize links the chat case's
// prompt, and the prompt's stores confirm it in the index (the
// target's events reach the router's request path, not only its
// subscriber).
func TestEventsBackendFeedsEngineTruth(t *testing.T) {
	be, err := startBackend(1, true)
	if err != nil {
		t.Fatal(err)
	}
	defer be.close()
	cfg := app.DefaultConfig()
	cfg.Backends = []string{"http://" + be.addr}
	cfg.KVEventsPort = be.kv.port
	rt, err := app.New(cfg, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	api, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	admin, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rt.Run(ctx, api, admin, time.Second) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	body := chatBody(128 << 10)
	metric := regexp.MustCompile(`(?m)^kvroute_kv_truth_confirmed_total (\d+)`)
	deadline := time.Now().Add(15 * time.Second)
	for {
		req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
		req.SetRequestURI("http://" + api.Addr().String() + "/v1/chat/completions")
		req.Header.SetMethod("POST")
		req.Header.SetContentType("application/json")
		req.SetBody(body)
		err := fasthttp.DoTimeout(req, resp, 5*time.Second)
		if err != nil || resp.StatusCode() != 200 {
			t.Fatalf("completion: %v %d %s", err, resp.StatusCode(), resp.Body())
		}
		fasthttp.ReleaseRequest(req)
		fasthttp.ReleaseResponse(resp)
		_, m, err := fasthttp.Get(nil, "http://"+admin.Addr().String()+"/metrics")
		if err != nil {
			t.Fatal(err)
		}
		if c := metric.FindSubmatch(m); c != nil && string(c[1]) != "0" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no block confirmed by the backend's events in 15 s; metrics:\n%s", grepLines(m, "kvroute_kv_", "kvroute_tokenize"))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// grepLines returns b's lines that start with any of prefixes.
func grepLines(b []byte, prefixes ...string) string {
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		for _, p := range prefixes {
			if strings.HasPrefix(l, p) {
				out = append(out, l)
				break
			}
		}
	}
	return strings.Join(out, "\n")
}
