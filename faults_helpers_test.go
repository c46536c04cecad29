package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/kvroute/kvroute/app"
	"github.com/kvroute/kvroute/bench/sim"
)

// The fault suite's harness: simulated pods (bench/sim), a real kvroute
// (app.New, Router.Run on loopback listeners), net/http clients, the
// admin /metrics, a TCP relay that counts and can freeze a pod's bytes, and
// the checks every fault test ends with.

// faultGuard bounds every wait of the suite: a deadlock guard, far above
// what any step takes on a loaded machine.
const faultGuard = 20 * time.Second

// faultDrain is the drain timeout the suite's routers run with.
const faultDrain = 10 * time.Second

// faultSimConfig is a small, fast pod: Llama-3.1-8B's cost model five times
// faster than real time, so a 16-token answer takes about 25 ms and a
// 600-token one about a second.
func faultSimConfig() sim.Config {
	c := sim.DefaultConfig()
	c.TimeScale = 5
	c.Seed = 12
	return c
}

// faultLeakCheck registers, before anything else of the test, a check that
// the goroutines the test started are gone once its cleanups (routers, pods,
// servers) ran. Goroutines already running when the test started are
// ignored, and so are fasthttp's process-wide background goroutines (the
// same list as TestMain's).
func faultLeakCheck(t *testing.T) {
	t.Helper()
	opts := []goleak.Option{
		goleak.IgnoreCurrent(),
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
		goleak.IgnoreTopFunction("github.com/valyala/fasthttp.(*TCPDialer).tcpAddrsClean"),
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*workerPool).Start.func2"),
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*HostClient).connsCleaner"),
	}
	t.Cleanup(func() {
		if err := goleak.Find(opts...); err != nil {
			t.Errorf("goroutines leaked: %v", err)
		}
	})
}

// startFaultFleet starts n pods of cfg on 127.0.0.1 and closes them when the
// test ends.
func startFaultFleet(t *testing.T, n int, cfg sim.Config) *sim.Fleet {
	t.Helper()
	f, err := sim.StartFleet(n, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return f
}

// faultRig is one kvroute running in the test process, with the client the
// test talks to it with.
type faultRig struct {
	t      *testing.T
	rt     *app.Router
	cfg    app.Config
	api    string // host:port of the API listener
	admin  string // host:port of the admin listener
	model  string
	tr     *http.Transport
	hc     *http.Client
	logs   *observer.ObservedLogs // kvroute's Warn and Error lines
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
	runErr error
}

// startFaultRig starts kvroute (DefaultConfig, no access log, static
// backends, then adjust) on 127.0.0.1:0 and waits until /readyz says ready.
// It is stopped (drained) when the test ends, before the pods close.
func startFaultRig(t *testing.T, backends []string, model string, adjust func(*app.Config)) *faultRig {
	t.Helper()
	cfg := app.DefaultConfig()
	cfg.Backends = backends
	cfg.AccessLog = false
	if adjust != nil {
		adjust(&cfg)
	}
	core, logs := observer.New(zap.WarnLevel)
	rt, err := app.New(cfg, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	api, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	admin, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		api.Close()
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	tr := &http.Transport{MaxIdleConnsPerHost: 64, ResponseHeaderTimeout: faultGuard}
	r := &faultRig{t: t, rt: rt, cfg: cfg, api: api.Addr().String(), admin: admin.Addr().String(), model: model,
		tr: tr, hc: &http.Client{Transport: tr}, logs: logs, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- rt.Run(ctx, api, admin, faultDrain) }()
	t.Cleanup(func() {
		if err := r.stop(); err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	r.waitFor("kvroute ready", func() bool {
		resp, err := r.hc.Get("http://" + r.admin + "/readyz")
		if err != nil {
			return false
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return r
}

// stop cancels Run's context (SIGTERM), waits for Run to return (bounded)
// and closes the client's idle connections. Idempotent; it returns Run's
// error.
func (r *faultRig) stop() error {
	r.once.Do(func() {
		r.cancel()
		select {
		case r.runErr = <-r.done:
		case <-time.After(faultDrain + faultGuard):
			r.runErr = errors.New("Run did not return after the drain timeout")
		}
		r.tr.CloseIdleConnections()
	})
	return r.runErr
}

// waitFor polls cond every 5 ms until it holds, failing the test after
// faultGuard.
func (r *faultRig) waitFor(what string, cond func() bool) {
	r.t.Helper()
	faultWait(r.t, what, cond)
}

func faultWait(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(faultGuard)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// faultResult is what a client got for one request.
type faultResult struct {
	Stream bool
	Status int    // 0: no response at all
	Body   []byte // the whole body as read (for a stream, what arrived)
	Events int    // SSE data events other than [DONE]
	Done   bool   // data: [DONE] arrived
	Err    error  // the request or the body's reading failed
	// CutEvent: the stream ended with kvroute's error event for a stream
	// its pod cut (then [DONE]).
	CutEvent bool
}

// completed reports a whole answer: 200 and, for a stream, [DONE] after a
// body read to its end; otherwise a completion object with choices.
func (f faultResult) completed() bool {
	if f.Status != http.StatusOK || f.Err != nil {
		return false
	}
	if f.Stream {
		return f.Done && f.Events > 0 && !f.CutEvent
	}
	var v struct {
		Choices []json.RawMessage `json:"choices"`
	}
	return json.Unmarshal(f.Body, &v) == nil && len(v.Choices) > 0
}

// jsonError reports a status ≥ 400 with an OpenAI-style error body
// {"error":{"message":...,"type":...}}.
func (f faultResult) jsonError() bool {
	if f.Status < 400 || f.Err != nil {
		return false
	}
	var v struct {
		Error *struct {
			Message string `json:"message"`
			Type    string `json:"type"`
		} `json:"error"`
	}
	return json.Unmarshal(f.Body, &v) == nil && v.Error != nil && v.Error.Message != "" && v.Error.Type != ""
}

// cut reports a stream that began (200) and was cut: it ended with
// kvroute's error event for a cut stream, or (a client that left, a router
// that died) without [DONE], the client seeing the truncation as a read
// error.
func (f faultResult) cut() bool {
	return f.Stream && f.Status == http.StatusOK && (f.CutEvent || !f.Done && f.Err != nil)
}

// clear reports an outcome a client can act on: a whole answer, an
// OpenAI-style error, or a stream visibly cut.
func (f faultResult) clear() bool { return f.completed() || f.jsonError() || f.cut() }

func (f faultResult) String() string {
	body := f.Body
	if len(body) > 160 {
		body = body[:160]
	}
	return fmt.Sprintf("stream=%v status=%d events=%d done=%v err=%v body=%q", f.Stream, f.Status, f.Events, f.Done, f.Err, body)
}

// faultBody is a completion request's JSON body.
func faultBody(model, prompt string, maxTokens int, stream bool) string {
	return fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":%d,"stream":%v}`, model, prompt, maxTokens, stream)
}

// faultCall is a request in progress: its response has arrived (headers),
// its body is read with event and finish.
type faultCall struct {
	res  faultResult
	resp *http.Response
	br   *bufio.Reader
	buf  bytes.Buffer
}

// open sends a completion request and returns once its response headers
// have arrived (or the request failed: then res holds the error).
func (r *faultRig) open(ctx context.Context, body string, stream bool) *faultCall {
	return r.openWith(r.hc, ctx, body, stream)
}

// openWith is open with the client hc.
func (r *faultRig) openWith(hc *http.Client, ctx context.Context, body string, stream bool) *faultCall {
	c := &faultCall{res: faultResult{Stream: stream}}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+r.api+"/v1/completions", strings.NewReader(body))
	if err != nil {
		c.res.Err = err
		return c
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		c.res.Err = err
		return c
	}
	c.resp, c.res.Status = resp, resp.StatusCode
	c.br = bufio.NewReader(io.TeeReader(resp.Body, &c.buf))
	return c
}

// event reads the stream's next SSE data event; false at its end or on an
// error (recorded).
func (c *faultCall) event() bool {
	if c.resp == nil || c.res.Err != nil || c.res.Done {
		return false
	}
	for {
		line, err := c.br.ReadString('\n')
		if strings.HasPrefix(line, "data: ") && strings.HasSuffix(line, "\n") {
			if strings.TrimSpace(line) == "data: [DONE]" {
				c.res.Done = true
				return false
			}
			if strings.Contains(line, `"code":"upstream_stream_cut"`) {
				c.res.CutEvent = true
				continue
			}
			c.res.Events++
			return true
		}
		if err != nil {
			if err != io.EOF {
				c.res.Err = err
			}
			return false
		}
	}
}

// finish reads the rest of the body and closes it.
func (c *faultCall) finish() faultResult {
	if c.resp == nil {
		return c.res
	}
	if c.res.Stream && c.res.Status == http.StatusOK {
		for c.event() {
		}
		if c.res.Err == nil {
			if _, err := io.Copy(io.Discard, c.br); err != nil {
				c.res.Err = err
			}
		}
	} else if _, err := io.Copy(io.Discard, c.br); err != nil {
		c.res.Err = err
	}
	c.resp.Body.Close()
	c.res.Body = c.buf.Bytes()
	return c.res
}

// do sends one completion request and reads its whole answer.
func (r *faultRig) do(prompt string, maxTokens int, stream bool) faultResult {
	ctx, cancel := context.WithTimeout(context.Background(), faultGuard)
	defer cancel()
	return r.open(ctx, faultBody(r.model, prompt, maxTokens, stream), stream).finish()
}

// metrics reads kvroute's admin /metrics.
func (r *faultRig) metrics() map[string]*dto.MetricFamily {
	r.t.Helper()
	resp, err := r.hc.Get("http://" + r.admin + "/metrics")
	if err != nil {
		r.t.Fatalf("admin /metrics: %v", err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		r.t.Fatalf("admin /metrics: %v", err)
	}
	return mfs
}

// metric sums the samples of the named counter or gauge of kvroute's
// admin /metrics whose labels include labels ("name=value" pairs).
func (r *faultRig) metric(name string, labels ...string) float64 {
	r.t.Helper()
	return faultSum(r.metrics()[name], labels...)
}

func faultSum(mf *dto.MetricFamily, labels ...string) float64 {
	if mf == nil {
		return 0
	}
	var sum float64
metrics:
	for _, m := range mf.GetMetric() {
		for _, want := range labels {
			k, v, _ := strings.Cut(want, "=")
			found := false
			for _, lp := range m.GetLabel() {
				if lp.GetName() == k && lp.GetValue() == v {
					found = true
				}
			}
			if !found {
				continue metrics
			}
		}
		switch {
		case m.Counter != nil:
			sum += m.GetCounter().GetValue()
		case m.Gauge != nil:
			sum += m.GetGauge().GetValue()
		case m.Untyped != nil:
			sum += m.GetUntyped().GetValue()
		}
	}
	return sum
}

// checkIdle waits until kvroute has nothing in flight: every endpoint's
// in-flight counter (Pool, draining endpoints included), and on /metrics
// kvroute_in_flight_requests and every kvroute_endpoint_in_flight_requests.
func (r *faultRig) checkIdle() {
	r.t.Helper()
	r.waitFor("kvroute's in-flight counters to return to 0", func() bool {
		if r.poolInFlight() != 0 {
			return false
		}
		mfs := r.metrics()
		if faultSum(mfs["kvroute_in_flight_requests"]) != 0 {
			return false
		}
		for _, m := range mfs["kvroute_endpoint_in_flight_requests"].GetMetric() {
			if m.GetGauge().GetValue() != 0 {
				return false
			}
		}
		return true
	})
}

// poolInFlight sums the in-flight counters of the Pool's endpoints,
// draining ones included.
func (r *faultRig) poolInFlight() int64 {
	var n int64
	for _, e := range r.rt.Pool.Load().Endpoints {
		n += e.InFlight()
	}
	for _, e := range r.rt.Pool.Draining() {
		n += e.InFlight()
	}
	return n
}

// endpointState returns the state (up, down, ejected, draining) of the
// endpoint with base URL u, or "" when the Pool does not hold it.
func (r *faultRig) endpointState(u string) string {
	for _, e := range r.rt.Pool.Load().Endpoints {
		if e.URL == u {
			return e.State().String()
		}
	}
	return ""
}

// podCounter sums a counter of a pod's own registry (what its /metrics
// serves) over the samples whose labels include labels.
func podCounter(t *testing.T, p *sim.Pod, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := p.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return faultSum(mf, labels...)
		}
	}
	return 0
}

// podAborted is the pod's vllm:request_success_total{finished_reason="abort"}:
// the requests it stopped because their client (kvroute) went away.
func podAborted(t *testing.T, p *sim.Pod) float64 {
	return podCounter(t, p, "vllm:request_success_total", "finished_reason=abort")
}

// podFinished is the pod's requests finished by length or stop (not aborted).
func podFinished(t *testing.T, p *sim.Pod) float64 {
	return podCounter(t, p, "vllm:request_success_total") - podAborted(t, p)
}

// faultRelay is a TCP relay in front of a pod: it counts the bytes the pod
// sent, and can freeze them (stop forwarding the pod's bytes while keeping
// both connections open) to play a pod that hangs mid-answer.
type faultRelay struct {
	ln     net.Listener
	target string
	// buffer, when positive, is the kernel's receive and send buffer size
	// of the relay's sockets (else the kernel's autotuned ones).
	buffer   int
	fromPod  atomic.Int64 // bytes forwarded from the pod
	frozen   atomic.Bool
	closing  chan struct{}
	mu       sync.Mutex
	conns    map[net.Conn]bool
	wg       sync.WaitGroup
	once     sync.Once
	accepted atomic.Int64
}

// startFaultRelay relays 127.0.0.1:0 to target until the test ends; buffer,
// when positive, sizes its sockets' kernel buffers.
func startFaultRelay(t *testing.T, target string, buffer int) *faultRelay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &faultRelay{ln: ln, target: target, buffer: buffer, closing: make(chan struct{}), conns: map[net.Conn]bool{}}
	r.wg.Add(1)
	go r.accept()
	t.Cleanup(r.close)
	return r
}

// URL is the relay's base URL.
func (r *faultRelay) URL() string { return "http://" + r.ln.Addr().String() }

func (r *faultRelay) track(c net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	select {
	case <-r.closing:
		c.Close()
		return false
	default:
	}
	r.conns[c] = true
	return true
}

func (r *faultRelay) accept() {
	defer r.wg.Done()
	for {
		c, err := r.ln.Accept()
		if err != nil {
			return
		}
		r.accepted.Add(1)
		p, err := net.Dial("tcp", r.target)
		if err != nil {
			c.Close()
			continue
		}
		if r.buffer > 0 {
			for _, s := range []net.Conn{c, p} {
				_ = s.(*net.TCPConn).SetReadBuffer(r.buffer)
				_ = s.(*net.TCPConn).SetWriteBuffer(r.buffer)
			}
		}
		if !r.track(c) || !r.track(p) {
			c.Close()
			p.Close()
			return
		}
		done := make(chan struct{})
		var once sync.Once
		end := func() {
			once.Do(func() {
				close(done)
				c.Close()
				p.Close()
			})
		}
		r.wg.Add(2)
		go func() { // client → pod
			defer r.wg.Done()
			defer end()
			_, _ = io.Copy(p, c)
		}()
		go func() { // pod → client, counted, frozen on demand
			defer r.wg.Done()
			defer end()
			buf := make([]byte, 4096)
			for {
				n, err := p.Read(buf)
				if n > 0 {
					for r.frozen.Load() {
						select {
						case <-done:
							return
						case <-time.After(5 * time.Millisecond):
						}
					}
					r.fromPod.Add(int64(n))
					if _, werr := c.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil {
					return
				}
			}
		}()
	}
}

// crash stops the relay like a pod's node dying: its port refuses
// connections and its connections are reset (RST), in both directions.
func (r *faultRelay) crash() { r.stop(true) }

// close stops the relay, closing every connection, and waits for its
// goroutines.
func (r *faultRelay) close() { r.stop(false) }

func (r *faultRelay) stop(reset bool) {
	r.once.Do(func() {
		r.mu.Lock()
		close(r.closing)
		for c := range r.conns {
			if reset {
				_ = c.(*net.TCPConn).SetLinger(0)
			}
			c.Close()
		}
		r.mu.Unlock()
		r.ln.Close()
		r.wg.Wait()
	})
}

// faultLiveHeap returns the live heap, in bytes, allocated by stacks
// without a frame of a function whose name contains one of exclude
// (another component's memory), from the runtime's heap profile after
// three collections (the profile lags up to two; a sync.Pool's contents
// survive one). With runtime.MemProfileRate 1, every allocation made
// since it was set is counted exactly.
func faultLiveHeap(exclude ...string) int64 {
	for range 3 {
		runtime.GC()
	}
	n, _ := runtime.MemProfile(nil, false)
	var recs []runtime.MemProfileRecord
	for {
		recs = make([]runtime.MemProfileRecord, n+64)
		var ok bool
		if n, ok = runtime.MemProfile(recs, false); ok {
			recs = recs[:n]
			break
		}
	}
	var sum int64
records:
	for i := range recs {
		rec := &recs[i]
		if rec.InUseBytes() == 0 {
			continue
		}
		frames := runtime.CallersFrames(rec.Stack())
		for {
			f, more := frames.Next()
			for _, e := range exclude {
				if strings.Contains(f.Function, e) {
					continue records
				}
			}
			if !more {
				break
			}
		}
		sum += rec.InUseBytes()
	}
	return sum
}
