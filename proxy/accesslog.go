package proxy

import (
	"strconv"
	"sync"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// The access log is written off the request path: a request's end (its
// body's close, which fasthttp calls before it flushes a small response to
// the client) only copies the line's values into a queue, and one
// goroutine encodes and writes them, stamped with the request's end. A
// full queue writes the line in place, so no line is lost. Encoding a line
// in place held every small response back by tens of microseconds
// (make bench-proxy).

// accessLine is one access-log line, copied out of the request's pooled
// state.
type accessLine struct {
	at                           time.Time
	reqID, traceID, method, path string
	model                        string
	status, attempts             int
	endpoint, reason             string
	uncached                     int
	bytes                        int64
	pd, prefillEndpoint          string
	prefill, decode, ttfb        time.Duration
	duration                     time.Duration
	prefix, home, usage          bool
	matched, prompt, cached      int
	prefixKey                    uint64
}

// accessQueue is how many lines may wait for the writer.
const accessQueue = 4096

// accessLog writes access lines on its own goroutine between start and
// close; before start and after close, in place. Safe for concurrent use.
type accessLog struct {
	log  *zap.Logger
	mu   sync.RWMutex
	ch   chan accessLine // nil unless running
	done chan struct{}
}

// start runs the writer.
func (a *accessLog) start() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.ch != nil {
		return
	}
	a.ch, a.done = make(chan accessLine, accessQueue), make(chan struct{})
	go func(ch <-chan accessLine, done chan<- struct{}) {
		defer close(done)
		for l := range ch {
			a.write(&l)
		}
	}(a.ch, a.done)
}

// close writes the lines queued and stops the writer.
func (a *accessLog) close() {
	a.mu.Lock()
	ch, done := a.ch, a.done
	a.ch = nil
	a.mu.Unlock()
	if ch != nil {
		close(ch)
		<-done
	}
}

// add queues l, or writes it now when the writer is not running or is
// behind.
func (a *accessLog) add(l accessLine) {
	a.mu.RLock()
	if a.ch != nil {
		select {
		case a.ch <- l:
			a.mu.RUnlock()
			return
		default:
		}
	}
	a.mu.RUnlock()
	a.write(&l)
}

// write encodes and writes l.
func (a *accessLog) write(l *accessLine) {
	ent := zapcore.Entry{Level: zapcore.InfoLevel, Time: l.at, LoggerName: a.log.Name(), Message: "request"}
	ce := a.log.Core().Check(ent, nil)
	if ce == nil {
		return
	}
	fields := append(make([]zap.Field, 0, 24),
		zap.String("request_id", l.reqID), zap.String("trace_id", l.traceID), zap.String("method", l.method),
		zap.String("path", l.path))
	if l.model != "" {
		fields = append(fields, zap.String("model", l.model))
	}
	fields = append(fields, zap.Int("status", l.status), zap.Int("attempts", l.attempts))
	if l.endpoint != "" {
		fields = append(fields, zap.String("endpoint", l.endpoint), zap.String("reason", l.reason),
			zap.Int("uncached_tokens", l.uncached), zap.Int64("bytes", l.bytes))
	}
	if l.pd != "" {
		fields = append(fields, zap.String("pd", l.pd))
		if l.prefillEndpoint != "" {
			fields = append(fields, zap.String("prefill_endpoint", l.prefillEndpoint))
		}
		if l.prefill > 0 {
			fields = append(fields, zap.Duration("prefill", l.prefill))
		}
		if l.decode > 0 {
			fields = append(fields, zap.Duration("decode", l.decode))
		}
	}
	if l.ttfb > 0 {
		fields = append(fields, zap.Duration("ttfb", l.ttfb))
	}
	fields = append(fields, zap.Duration("duration", l.duration))
	if l.prefix {
		fields = append(fields, zap.Bool("home", l.home), zap.Int("matched_blocks", l.matched),
			zap.String("prefix_key", strconv.FormatUint(l.prefixKey, 16)))
		if l.usage {
			fields = append(fields, zap.Int("prompt_tokens", l.prompt), zap.Int("cached_tokens", l.cached))
		}
	}
	ce.Write(fields...)
}
