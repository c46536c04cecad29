package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

// lineBuffer is a writer safe for concurrent use that keeps what it got.
type lineBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *lineBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

// lines returns the lines written so far, each decoded from JSON.
func (w *lineBuffer) lines(t *testing.T) []map[string]any {
	t.Helper()
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []map[string]any
	for _, l := range strings.Split(strings.TrimSuffix(w.b.String(), "\n"), "\n") {
		if l == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("an access line is not JSON: %v: %q", err, l)
		}
		out = append(out, m)
	}
	return out
}

func (w *lineBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// zapLine is the line zap's production encoder (kvroute's logger) writes
// for r's fields: the reference appendAccessLine must match byte for byte.
func zapLine(t *testing.T, console bool, r *record, d time.Duration) string {
	t.Helper()
	cfg := zap.NewProductionEncoderConfig()
	cfg.EncodeTime = zapcore.ISO8601TimeEncoder
	enc := zapcore.NewJSONEncoder(cfg)
	if console {
		enc = zapcore.NewConsoleEncoder(cfg)
	}
	f := []zap.Field{zap.ByteString("request_id", r.reqID), zap.ByteString("trace_id", r.traceID[:]),
		zap.ByteString("method", r.method), zap.ByteString("path", r.path)}
	if len(r.model) > 0 {
		f = append(f, zap.ByteString("model", r.model))
	}
	f = append(f, zap.Int("status", r.status), zap.Int("attempts", r.attempts))
	if len(r.fails) > 0 {
		f = append(f, zap.ByteString("failed_attempts", r.fails))
	}
	if r.ep != nil {
		f = append(f, zap.String("endpoint", r.ep.URL), zap.String("reason", r.decision.Reason),
			zap.Int("uncached_tokens", r.decision.Prefill), zap.Int64("bytes", r.bytes))
	}
	if r.pdDecision != "" {
		f = append(f, zap.String("pd", r.pdDecision))
		if r.prefill != nil {
			f = append(f, zap.String("prefill_endpoint", r.prefill.URL))
		}
		if p := r.prefilled.Sub(r.start); !r.prefilled.IsZero() && p > 0 {
			f = append(f, zap.Duration("prefill", p))
		}
		if dec := d - r.sent.Sub(r.start); !r.sent.IsZero() && dec > 0 {
			f = append(f, zap.Duration("decode", dec))
		}
	}
	if r.migrations > 0 {
		f = append(f, zap.Int("migrations", r.migrations))
	}
	if r.ttfb > 0 {
		f = append(f, zap.Duration("ttfb", r.ttfb))
	}
	f = append(f, zap.Duration("duration", d))
	if r.prefix {
		f = append(f, zap.Bool("home", r.decision.Home), zap.Int("matched_blocks", r.decision.MatchedBlocks),
			zap.String("prefix_key", strconv.FormatUint(r.decision.PrefixKey, 16)))
		if r.usage {
			f = append(f, zap.Int("prompt_tokens", r.promptTokens), zap.Int("cached_tokens", r.cachedTokens))
		}
	}
	buf, err := enc.EncodeEntry(zapcore.Entry{Level: zapcore.InfoLevel, Time: r.start.Add(d), Message: "request"}, f)
	if err != nil {
		t.Fatal(err)
	}
	return buf.String()
}

// The fixed-layout encoder writes what zap writes, in both layouts, for
// every branch of the line and for strings that need escaping.
func TestAccessLineMatchesZap(t *testing.T) {
	start := time.Date(2026, 12, 2, 9, 30, 1, 123456789, time.UTC)
	ep := &discovery.Endpoint{URL: "http://10.0.0.1:8000"}
	pf := &discovery.Endpoint{URL: "http://10.0.0.2:8000"}
	var trace [32]byte
	copy(trace[:], "4bf92f3577b34da6a3ce929d0e0e4736")
	records := []record{
		{status: 404, attempts: 0, start: start, reqID: []byte("r-1"), method: []byte("POST"), path: []byte("/v1/completions"), traceID: trace},
		{status: 200, attempts: 1, start: start, reqID: []byte("r-2"), method: []byte("POST"), path: []byte("/v1/chat/completions"),
			model: []byte("meta-llama/Llama-3.1-8B-Instruct"), traceID: trace, ttfb: 41 * time.Millisecond, ep: ep, bytes: 12345,
			decision: routing.Decision{Reason: "warm", Prefill: 77, Home: true, MatchedBlocks: 12, PrefixKey: 0xdeadbeef},
			prefix:   true, usage: true, promptTokens: 2048, cachedTokens: 1984},
		{status: 200, attempts: 2, fails: []byte("connect"), start: start, reqID: []byte("r-3"), method: []byte("POST"), path: []byte("/v1/completions"),
			model: []byte("m"), traceID: trace, ttfb: 3 * time.Millisecond, ep: ep, decision: routing.Decision{Reason: "cold"},
			pdDecision: "disaggregated", prefill: pf, prefilled: start.Add(90 * time.Millisecond), sent: start.Add(91 * time.Millisecond), prefix: true,
			migrations: 2},
		{status: 502, attempts: 3, fails: []byte("full,status,connect"), start: start, reqID: []byte("q\"uo\\te\n\r\t\x01\x7f é \xff\xfe 日本"), method: []byte("GET"),
			path: []byte("/v1/<script>&%00"), model: []byte("\u2028x"), traceID: trace, pdDecision: "local"},
	}
	for i := range records {
		for _, d := range []time.Duration{0, 1, 999 * time.Microsecond, 1234567891 * time.Nanosecond, 3 * time.Hour} {
			for _, console := range []bool{false, true} {
				r := &records[i]
				got := string(appendAccessLine(nil, &isoClock{}, console, r, d))
				if want := zapLine(t, console, r, d); got != want {
					t.Fatalf("record %d, %v, console %v:\n got %s\nwant %s", i, d, console, got, want)
				}
			}
		}
	}
}

// Every access line is written, stamped with the request's end: before
// start and after close at once, in between in batches, the last of them
// by close.
func TestAccessLogWritesEveryLine(t *testing.T) {
	var out lineBuffer
	a := accessLog{w: &out, dropped: func(int) { t.Error("a line was dropped") }}
	end := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	line := func(id string) *record {
		return &record{start: end, reqID: []byte(id), status: 200, ep: &discovery.Endpoint{URL: "http://10.0.0.1:8000"},
			prefix: true, decision: routing.Decision{PrefixKey: 255}}
	}
	a.add(line("before-start"), 0)
	if n := len(out.lines(t)); n != 1 {
		t.Fatalf("%d lines before start, want 1 written at once", n)
	}
	a.start()
	const n = 3000 // more than one batch
	for range n {
		a.add(line("batched"), 0)
	}
	a.close()
	a.add(line("after-close"), 0)
	got := out.lines(t)
	if len(got) != n+2 {
		t.Fatalf("%d lines, want %d", len(got), n+2)
	}
	for _, l := range got {
		if l["ts"] != "2026-11-30T12:00:00.000Z" || l["msg"] != "request" || l["level"] != "info" {
			t.Fatalf("line %v", l)
		}
	}
	if l := got[1]; l["endpoint"] != "http://10.0.0.1:8000" || l["prefix_key"] != "ff" {
		t.Errorf("fields %v", l)
	}
	if got[len(got)-1]["request_id"] != "after-close" {
		t.Error("a line after close was lost")
	}
}

// blockedWriter blocks every write until release is closed, and counts
// the lines written.
type blockedWriter struct {
	release chan struct{}
	wrote   chan struct{}
	once    sync.Once
	lines   atomic.Int64
}

func (w *blockedWriter) Write(p []byte) (int, error) {
	w.once.Do(func() { close(w.wrote) })
	<-w.release
	w.lines.Add(int64(bytes.Count(p, []byte("\n"))))
	return len(p), nil
}

// A log whose output is stuck costs requests nothing: past the bound of
// lines waiting, lines are dropped and counted, and add never waits.
func TestAccessLogDropsWhenBehind(t *testing.T) {
	w := &blockedWriter{release: make(chan struct{}), wrote: make(chan struct{})}
	var mu sync.Mutex
	dropped := 0
	a := accessLog{w: w, dropped: func(n int) { mu.Lock(); dropped += n; mu.Unlock() }}
	a.start()
	r := &record{start: time.Now(), reqID: []byte("stuck"), status: 200, method: []byte("POST"), path: []byte("/v1/completions")}
	lineLen := len(appendAccessLine(nil, &isoClock{}, false, r, time.Millisecond))
	first, second := 2*accessBatch/lineLen, 2*accessMaxPending/lineLen+10
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range first { // the writer takes (some of) these and blocks
			a.add(r, time.Millisecond)
		}
		<-w.wrote
		for range second { // then twice what may wait
			a.add(r, time.Millisecond)
		}
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("add waited for a stuck output")
	}
	mu.Lock()
	got := dropped
	mu.Unlock()
	if got < second/2 || got > second/2+first+10 { // what may wait is about half; phase one may have left some
		t.Errorf("%d lines dropped of %d, want about half", got, second)
	}
	close(w.release)
	a.close()
	if n := w.lines.Load(); n != int64(first+second-got) {
		t.Errorf("%d lines written, want the %d not dropped", n, first+second-got)
	}
}

// A request's access line carries what an operator needs to follow it:
// ids, model, endpoint, decision, uncached tokens, time to first byte and
// duration. With --access-log-sample 0, only failed requests are logged.
func TestAccessLogFieldsAndSampling(t *testing.T) {
	fleet := startSimFleet(t, 1, sim.Config{TimeScale: 100, Model: "m"})
	for _, tc := range []struct {
		name string
		skip float64
		want []int // the statuses logged, in order
	}{{"every request", 0, []int{200, 404}}, {"errors only", 1, []int{404}}} {
		t.Run(tc.name, func(t *testing.T) {
			var out lineBuffer
			h := startProxy(t, nil, Options{AccessLog: &out, AccessLogSkip: tc.skip}, fleet.URL(0))
			const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
			for _, model := range []string{"m", "unknown"} {
				req, _ := http.NewRequest("POST", h.url+"/v1/completions", strings.NewReader(`{"model":"`+model+`","prompt":"hello","max_tokens":2}`))
				req.Header.Set("traceparent", tp)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = h.srv.Shutdown(ctx) // writes the lines waiting
			var got []int
			for _, f := range out.lines(t) {
				got = append(got, int(f["status"].(float64)))
				if f["trace_id"] != "4bf92f3577b34da6a3ce929d0e0e4736" || f["endpoint"] != fleet.URL(0) || f["request_id"] == "" {
					t.Errorf("line %v", f)
				}
				for _, k := range []string{"model", "reason", "uncached_tokens", "ttfb", "duration", "bytes", "attempts"} {
					if _, ok := f[k]; !ok {
						t.Errorf("line without %s: %v", k, f)
					}
				}
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Errorf("logged statuses %v, want %v", got, tc.want)
			}
		})
	}
}

// The clock's cached second gives what time.AppendFormat gives, across
// milliseconds, seconds, zones and years of other than four digits.
func TestISOClock(t *testing.T) {
	var c isoClock
	base := time.Date(2026, 12, 2, 9, 30, 59, 0, time.UTC)
	paris := time.FixedZone("CET", 3600)
	var times []time.Time
	for _, d := range []time.Duration{0, 1, time.Millisecond, 999999999, time.Second, time.Second + 5*time.Millisecond, time.Hour} {
		times = append(times, base.Add(d), base.Add(d).In(paris), base.Add(d).Local())
	}
	times = append(times, time.Date(999, 1, 1, 0, 0, 0, 7e6, time.UTC), time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC), base)
	for _, at := range times {
		if got, want := string(c.append(nil, at)), at.Format(iso8601); got != want {
			t.Errorf("%v: %s, want %s", at, got, want)
		}
	}
}

// BenchmarkAccessLine is one access line's encoding (go test -bench AccessLine ./proxy).
func BenchmarkAccessLine(b *testing.B) {
	var trace [32]byte
	copy(trace[:], "4bf92f3577b34da6a3ce929d0e0e4736")
	r := &record{status: 200, attempts: 1, start: time.Now(), reqID: []byte("3f2a9c1e-00000000000004d2"), method: []byte("POST"),
		path: []byte("/v1/chat/completions"), model: []byte("meta-llama/Llama-3.1-8B-Instruct"), traceID: trace, ttfb: 41 * time.Millisecond,
		ep: &discovery.Endpoint{URL: "http://10.0.0.1:8000"}, bytes: 12345, prefix: true, usage: true, promptTokens: 2048, cachedTokens: 1984,
		decision: routing.Decision{Reason: "warm", Prefill: 77, Home: true, MatchedBlocks: 12, PrefixKey: 0xdeadbeef}}
	var clock isoClock
	buf := make([]byte, 0, 1024)
	b.ReportAllocs()
	for b.Loop() {
		buf = appendAccessLine(buf[:0], &clock, false, r, 52*time.Millisecond)
	}
}
