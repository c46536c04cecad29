package proxy

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/kvroute/kvroute/bench/sim"
)

// Every access line is written, queued or not, stamped with the request's
// end, and close writes what is queued.
func TestAccessLogWritesEveryLine(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	a := accessLog{log: zap.New(core).Named("proxy")}
	end := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	a.add(accessLine{at: end, reqID: "before-start", status: 200}) // written in place
	a.start()
	for range accessQueue + 100 { // more than the queue holds
		a.add(accessLine{at: end, reqID: "queued", status: 200, endpoint: "http://10.0.0.1:8000", prefix: true, prefixKey: 255})
	}
	a.close()
	a.add(accessLine{at: end, reqID: "after-close", status: 499})
	got := logs.TakeAll()
	if len(got) != accessQueue+102 {
		t.Fatalf("%d lines, want %d", len(got), accessQueue+102)
	}
	for _, e := range got {
		if !e.Time.Equal(end) || e.Message != "request" || e.LoggerName != "proxy" {
			t.Fatalf("line %+v", e.Entry)
		}
	}
	if f := got[1].ContextMap(); f["endpoint"] != "http://10.0.0.1:8000" || f["prefix_key"] != "ff" {
		t.Errorf("fields %v", f)
	}
	if got[len(got)-1].ContextMap()["request_id"] != "after-close" {
		t.Error("a line after close was lost")
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
			core, logs := observer.New(zapcore.InfoLevel)
			h := startProxy(t, nil, Options{Logger: zap.New(core), AccessLog: true, AccessLogSkip: tc.skip}, fleet.URL(0))
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
			_ = h.srv.Shutdown(ctx) // writes the queued lines
			var got []int
			for _, e := range logs.FilterMessage("request").All() {
				f := e.ContextMap()
				got = append(got, int(f["status"].(int64)))
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
