package proxy

import (
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
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
