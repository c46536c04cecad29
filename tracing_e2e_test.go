package main

import (
	"bytes"
	"compress/gzip"
	"encoding/hex"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/kvroute/kvroute/bench/proc"
	"github.com/kvroute/kvroute/bench/sim"
)

// otlpReceiver is an OTLP/HTTP trace receiver on loopback: it decodes
// every export request (protobuf, gzip or not) and keeps the spans.
type otlpReceiver struct {
	srv   *http.Server
	url   string
	mu    sync.Mutex
	spans []*tracepb.Span
	bad   []string
}

func startOTLPReceiver(t *testing.T) *otlpReceiver {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &otlpReceiver{url: "http://" + ln.Addr().String()}
	r.srv = &http.Server{Handler: http.HandlerFunc(r.handle)}
	go func() { _ = r.srv.Serve(ln) }()
	t.Cleanup(func() { _ = r.srv.Close() })
	return r
}

func (r *otlpReceiver) handle(w http.ResponseWriter, req *http.Request) {
	body, err := r.read(req)
	var msg coltracepb.ExportTraceServiceRequest
	if err == nil {
		err = proto.Unmarshal(body, &msg)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if req.URL.Path != "/v1/traces" || req.Header.Get("Content-Type") != "application/x-protobuf" || err != nil {
		r.bad = append(r.bad, req.URL.Path+" "+req.Header.Get("Content-Type")+" "+fmtErr(err))
		http.Error(w, "bad export", http.StatusBadRequest)
		return
	}
	for _, rs := range msg.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			r.spans = append(r.spans, ss.GetSpans()...)
		}
	}
	out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

func (r *otlpReceiver) read(req *http.Request) ([]byte, error) {
	var rd io.Reader = req.Body
	if req.Header.Get("Content-Encoding") == "gzip" {
		z, err := gzip.NewReader(req.Body)
		if err != nil {
			return nil, err
		}
		rd = z
	}
	return io.ReadAll(rd)
}

func fmtErr(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// headerRecorder is a reverse proxy in front of a pod that records the
// traceparent of every request it forwards.
type headerRecorder struct {
	mu  sync.Mutex
	tps []string
}

func startHeaderRecorder(t *testing.T, target string) (*headerRecorder, string) {
	t.Helper()
	u, _ := url.Parse(target)
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.FlushInterval = -1
	whole := proc.WholeBody(rp)
	h := &headerRecorder{}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && strings.HasPrefix(r.URL.Path, "/v1/") {
			h.mu.Lock()
			h.tps = append(h.tps, r.Header.Get("traceparent"))
			h.mu.Unlock()
		}
		whole.ServeHTTP(w, r)
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return h, "http://" + ln.Addr().String()
}

// TestTracingOTLP: a disaggregated request with the client's sampled
// traceparent becomes a kvroute.request span under the client's span, with
// pick spans and a span per leg; each leg's traceparent names its own span
// as the parent; the spans reach an OTLP/HTTP receiver, decoded there.
func TestTracingOTLP(t *testing.T) {
	for _, protocol := range []string{"vllm", "sglang"} {
		t.Run(protocol, func(t *testing.T) { testTracingOTLP(t, protocol) })
	}
}

func testTracingOTLP(t *testing.T, protocol string) {
	fleet, err := sim.StartFleetOf(sim.Config{TimeScale: 100, Role: sim.RolePrefill, Model: "m"},
		sim.Config{TimeScale: 100, Role: sim.RoleDecode, Model: "m", Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fleet.Close() })
	prefillRec, prefillURL := startHeaderRecorder(t, fleet.URL(0))
	decodeRec, decodeURL := startHeaderRecorder(t, fleet.URL(1))
	if protocol == "sglang" { // the decode pod pulls from the prefill pod's bootstrap server
		a := fleet.Pod(0).SideChannelAddr()
		prefillURL += "#bootstrap=" + a[strings.LastIndexByte(a, ':')+1:]
	}
	recv := startOTLPReceiver(t)
	addrs, stop := startKvroute(t, "--prefill-backends", prefillURL, "--decode-backends", decodeURL,
		"--otlp-endpoint", recv.url, "--pd-protocol", protocol)

	const clientTrace, clientSpan = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	req, _ := http.NewRequest("POST", "http://"+addrs.API+"/v1/completions", strings.NewReader(
		`{"model":"m","max_tokens":4,"prompt":"`+strings.Repeat("a long prompt that no pod has seen ", 300)+`"}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("traceparent", "00-"+clientTrace+"-"+clientSpan+"-01")
	req.Header.Set("tracestate", "vendor=opaque")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	stop() // flushes the spans

	recv.mu.Lock()
	defer recv.mu.Unlock()
	if len(recv.bad) > 0 {
		t.Fatalf("bad exports: %v", recv.bad)
	}
	byName := map[string][]*tracepb.Span{}
	for _, s := range recv.spans {
		if hex.EncodeToString(s.GetTraceId()) != clientTrace {
			continue // the readiness probes' own requests
		}
		byName[s.GetName()] = append(byName[s.GetName()], s)
	}
	root := byName["kvroute.request"]
	if len(root) != 1 {
		t.Fatalf("spans of the client's trace: %v", names(byName))
	}
	if got := hex.EncodeToString(root[0].GetParentSpanId()); got != clientSpan {
		t.Errorf("request span's parent %s, want the client's %s", got, clientSpan)
	}
	if root[0].GetKind() != tracepb.Span_SPAN_KIND_SERVER || root[0].GetTraceState() != "vendor=opaque" {
		t.Errorf("request span kind %v trace state %q", root[0].GetKind(), root[0].GetTraceState())
	}
	rootID := hex.EncodeToString(root[0].GetSpanId())
	for name, want := range map[string]int{"kvroute.pick": 2, "kvroute.prefill": 1, "kvroute.decode": 1} {
		if len(byName[name]) != want {
			t.Errorf("%d %s spans, want %d (all: %v)", len(byName[name]), name, want, names(byName))
		}
		for _, s := range byName[name] {
			if p := hex.EncodeToString(s.GetParentSpanId()); p != rootID {
				t.Errorf("%s's parent %s, want the request span %s", name, p, rootID)
			}
		}
	}
	for name, rec := range map[string]*headerRecorder{"kvroute.prefill": prefillRec, "kvroute.decode": decodeRec} {
		rec.mu.Lock()
		tps := rec.tps
		rec.mu.Unlock()
		if len(byName[name]) != 1 || len(tps) != 1 {
			t.Errorf("%s: %d spans, upstream traceparents %v", name, len(byName[name]), tps)
			continue
		}
		want := "00-" + clientTrace + "-" + hex.EncodeToString(byName[name][0].GetSpanId()) + "-01"
		if tps[0] != want {
			t.Errorf("%s leg's traceparent %s, want %s (its span as the parent)", name, tps[0], want)
		}
		if !bytes.Contains([]byte(attrs(byName[name][0])), []byte("http.response.status_code=200")) {
			t.Errorf("%s span attributes %s", name, attrs(byName[name][0]))
		}
	}
}

func names(m map[string][]*tracepb.Span) map[string]int {
	out := map[string]int{}
	for k, v := range m {
		out[k] = len(v)
	}
	return out
}

func attrs(s *tracepb.Span) string {
	var b strings.Builder
	for _, kv := range s.GetAttributes() {
		b.WriteString(kv.GetKey() + "=")
		v := kv.GetValue()
		switch {
		case v.GetStringValue() != "":
			b.WriteString(v.GetStringValue())
		default:
			b.WriteString(strings.TrimSpace(strings.TrimPrefix(v.String(), "int_value:")))
		}
		b.WriteString(" ")
	}
	return b.String()
}

// A stream continued on other pods (issue #28) is one trace: each leg's
// pick and attempt are spans of the request. Both pods drop every stream
// after 3 tokens, so the answer has three legs (--max-migrations 2).
func TestTracingMigratedStream(t *testing.T) {
	cfg := sim.Config{TimeScale: 100, Model: "m", Faults: sim.Faults{DropAfterTokens: 3}}
	fleet, err := sim.StartFleet(2, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fleet.Close() })
	recv := startOTLPReceiver(t)
	addrs, stop := startKvroute(t, "--backends", fleet.URL(0)+","+fleet.URL(1), "--otlp-endpoint", recv.url)

	const clientTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
	req, _ := http.NewRequest("POST", "http://"+addrs.API+"/v1/completions", strings.NewReader(
		`{"model":"m","max_tokens":20,"ignore_eos":true,"stream":true,"prompt":"a story"}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("traceparent", "00-"+clientTrace+"-00f067aa0ba902b7-01")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !bytes.Contains(body, []byte("upstream_stream_cut")) {
		t.Fatalf("%d %s", resp.StatusCode, body) // three legs of 3 tokens, then the cut
	}
	stop()

	recv.mu.Lock()
	defer recv.mu.Unlock()
	byName := map[string][]*tracepb.Span{}
	for _, s := range recv.spans {
		if hex.EncodeToString(s.GetTraceId()) == clientTrace {
			byName[s.GetName()] = append(byName[s.GetName()], s)
		}
	}
	root := byName["kvroute.request"]
	if len(root) != 1 {
		t.Fatalf("spans of the client's trace: %v", names(byName))
	}
	rootID := hex.EncodeToString(root[0].GetSpanId())
	for name, want := range map[string]int{"kvroute.pick": 3, "kvroute.upstream": 3} {
		if len(byName[name]) != want {
			t.Errorf("%d %s spans, want %d (all: %v)", len(byName[name]), name, want, names(byName))
		}
		for _, s := range byName[name] {
			if p := hex.EncodeToString(s.GetParentSpanId()); p != rootID {
				t.Errorf("%s's parent %s, want the request span %s", name, p, rootID)
			}
		}
	}
}
