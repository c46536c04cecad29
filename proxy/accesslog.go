package proxy

import (
	"io"
	"strconv"
	"sync"
	"time"
	"unicode/utf8"
)

// The access log is one line per request, in the layout of kvroute's other
// log lines (zap's production encoder: JSON, or console with --log-format
// console), and costs a request no more than encoding its line. A
// fixed-layout encoder appends the line, at the request's end, straight
// into a buffer shared by all requests (no field list, no copy of the
// request's values, no allocation), and one goroutine writes the buffer
// in batches: every accessFlushEvery, or at once when accessBatch bytes
// wait. A request never waits for the log's output: when more than
// accessMaxPending bytes wait (the output is blocked or slower than the
// traffic), lines are dropped and counted
// (kvroute_access_log_dropped_lines_total). Before make bench-proxy
// measured it, zap's encoder on a writer goroutine fed by a channel took
// a tenth of kvroute's CPU for a small completion.
const (
	accessFlushEvery = 100 * time.Millisecond
	accessBatch      = 64 << 10
	accessMaxPending = 4 << 20
)

// accessLog writes access lines to w between start and close; before
// start and after close, at once. Safe for concurrent use.
type accessLog struct {
	w       io.Writer
	console bool      // zap's console layout rather than JSON
	dropped func(int) // counts dropped lines

	mu      sync.Mutex
	buf     []byte // lines waiting
	running bool
	clock   isoClock

	wmu   sync.Mutex // serializes writes to w
	spare []byte     // the buffer being written (under wmu)

	kick chan struct{}
	stop chan struct{}
	done chan struct{}
}

// start runs the writer.
func (a *accessLog) start() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.running || a.w == nil {
		return
	}
	a.running = true
	a.kick, a.stop, a.done = make(chan struct{}, 1), make(chan struct{}), make(chan struct{})
	go func(kick, stop <-chan struct{}, done chan<- struct{}) {
		defer close(done)
		t := time.NewTicker(accessFlushEvery)
		defer t.Stop()
		for {
			select {
			case <-t.C:
			case <-kick:
			case <-stop:
				a.flush()
				return
			}
			a.flush()
		}
	}(a.kick, a.stop, a.done)
}

// close writes the lines waiting and stops the writer.
func (a *accessLog) close() {
	a.mu.Lock()
	running := a.running
	a.running = false
	a.mu.Unlock()
	if running {
		close(a.stop)
		<-a.done
	}
}

// add appends r's line (its request took d) for the writer, or writes it
// at once when the writer is not running.
func (a *accessLog) add(r *record, d time.Duration) {
	a.mu.Lock()
	if len(a.buf) >= accessMaxPending {
		a.mu.Unlock()
		a.dropped(1)
		return
	}
	before := len(a.buf)
	a.buf = appendAccessLine(a.buf, &a.clock, a.console, r, d)
	n, running := len(a.buf), a.running
	a.mu.Unlock()
	switch {
	case !running:
		a.flush()
	case n >= accessBatch && before < accessBatch:
		select {
		case a.kick <- struct{}{}:
		default:
		}
	}
}

// flush writes the lines waiting.
func (a *accessLog) flush() {
	a.wmu.Lock()
	defer a.wmu.Unlock()
	a.mu.Lock()
	b := a.buf
	a.buf = a.spare[:0]
	a.mu.Unlock()
	if len(b) > 0 {
		_, _ = a.w.Write(b)
	}
	if cap(b) > 2*accessBatch { // a burst's buffer is not kept
		b = nil
	}
	a.spare = b
}

// iso8601 is zap's ISO8601TimeEncoder layout, which kvroute's logger uses.
const iso8601 = "2006-01-02T15:04:05.000Z0700"

// isoClock formats times in the iso8601 layout, the whole second (date,
// time, zone) once per second: time.AppendFormat, which looks the zone up
// and interprets the layout, took twice as long as the rest of a line.
// Not safe for concurrent use.
type isoClock struct {
	sec  int64 // the Unix second formatted (with loc), when n > 0
	loc  *time.Location
	text [40]byte // that second in the layout; its milliseconds at [20:23]
	n    int
}

func (c *isoClock) append(b []byte, t time.Time) []byte {
	if sec := t.Unix(); c.n == 0 || sec != c.sec || t.Location() != c.loc {
		c.n = len(t.Truncate(time.Second).AppendFormat(c.text[:0], iso8601))
		c.sec, c.loc = sec, t.Location()
		if c.n < 24 || c.text[19] != '.' { // a year of other than four digits
			c.n = 0
			return t.AppendFormat(b, iso8601)
		}
	}
	ms := t.Nanosecond() / 1e6
	b = append(b, c.text[:20]...)
	b = append(b, byte('0'+ms/100), byte('0'+ms/10%10), byte('0'+ms%10))
	return append(b, c.text[23:c.n]...)
}

// appendAccessLine appends r's access line, as zap's production encoder
// (ISO 8601 times, durations in seconds, no logger name or caller) would
// write an Info entry "request" with these fields, in this order; the
// test compares the two byte for byte.
func appendAccessLine(b []byte, clock *isoClock, console bool, r *record, d time.Duration) []byte {
	at := r.start.Add(d)
	if console {
		b = clock.append(b, at)
		b = append(b, "\tinfo\trequest\t{"...)
	} else {
		b = append(b, `{"level":"info","ts":"`...)
		b = clock.append(b, at)
		b = append(b, `","msg":"request",`...)
	}
	b = appendJSONString(appendKey(b, console, "", "request_id"), r.reqID)
	b = appendJSONString(appendKey(b, console, ",", "trace_id"), r.traceID[:])
	b = appendJSONString(appendKey(b, console, ",", "method"), r.method)
	b = appendJSONString(appendKey(b, console, ",", "path"), r.path)
	if len(r.model) > 0 {
		b = appendJSONString(appendKey(b, console, ",", "model"), r.model)
	}
	b = strconv.AppendInt(appendKey(b, console, ",", "status"), int64(r.status), 10)
	b = strconv.AppendInt(appendKey(b, console, ",", "attempts"), int64(r.attempts), 10)
	if len(r.fails) > 0 {
		b = appendJSONString(appendKey(b, console, ",", "failed_attempts"), r.fails)
	}
	if r.tenant != 0 {
		b = append(appendKey(b, console, ",", "tenant"), '"')
		b = append(strconv.AppendUint(b, r.tenant, 16), '"')
	}
	if r.tier != classDefault {
		b = appendJSONString(appendKey(b, console, ",", "class"), []byte(r.tier.String()))
	}
	if r.held > 0 {
		b = appendSeconds(appendKey(b, console, ",", "held"), r.held)
	}
	if r.queued > 0 {
		b = appendSeconds(appendKey(b, console, ",", "queued"), r.queued)
	}
	if r.ep != nil {
		b = appendJSONString(appendKey(b, console, ",", "endpoint"), r.ep.URL)
		b = appendJSONString(appendKey(b, console, ",", "reason"), r.decision.Reason)
		b = strconv.AppendInt(appendKey(b, console, ",", "uncached_tokens"), int64(r.decision.Prefill), 10)
		b = strconv.AppendInt(appendKey(b, console, ",", "bytes"), r.bytes, 10)
	}
	if r.pdDecision != "" {
		b = appendJSONString(appendKey(b, console, ",", "pd"), r.pdDecision)
		if r.prefill != nil {
			b = appendJSONString(appendKey(b, console, ",", "prefill_endpoint"), r.prefill.URL)
		}
		if !r.prefilled.IsZero() {
			if p := r.prefilled.Sub(r.start); p > 0 {
				b = appendSeconds(appendKey(b, console, ",", "prefill"), p)
			}
		}
		if !r.sent.IsZero() {
			if dec := d - r.sent.Sub(r.start); dec > 0 {
				b = appendSeconds(appendKey(b, console, ",", "decode"), dec)
			}
		}
	}
	if r.migrations > 0 {
		b = strconv.AppendInt(appendKey(b, console, ",", "migrations"), int64(r.migrations), 10)
	}
	if r.ttfb > 0 {
		b = appendSeconds(appendKey(b, console, ",", "ttfb"), r.ttfb)
	}
	b = appendSeconds(appendKey(b, console, ",", "duration"), d)
	if r.prefix {
		b = strconv.AppendBool(appendKey(b, console, ",", "home"), r.decision.Home)
		b = strconv.AppendInt(appendKey(b, console, ",", "matched_blocks"), int64(r.decision.MatchedBlocks), 10)
		b = append(appendKey(b, console, ",", "prefix_key"), '"')
		b = append(strconv.AppendUint(b, r.decision.PrefixKey, 16), '"')
		if r.usage {
			b = strconv.AppendInt(appendKey(b, console, ",", "prompt_tokens"), int64(r.promptTokens), 10)
			b = strconv.AppendInt(appendKey(b, console, ",", "cached_tokens"), int64(r.cachedTokens), 10)
		}
	}
	return append(b, "}\n"...)
}

// appendKey appends a field's key: the separator sep, then the quoted
// name and a colon; zap's console layout follows both by a space.
func appendKey(b []byte, console bool, sep, name string) []byte {
	b = append(b, sep...)
	if console && sep != "" {
		b = append(b, ' ')
	}
	b = append(append(append(b, '"'), name...), '"', ':')
	if console {
		b = append(b, ' ')
	}
	return b
}

// appendSeconds appends d in seconds, as zap's SecondsDurationEncoder.
func appendSeconds(b []byte, d time.Duration) []byte {
	return strconv.AppendFloat(b, float64(d)/float64(time.Second), 'f', -1, 64)
}

// appendJSONString appends s as a JSON string escaped as zap escapes it:
// quotes, backslashes and control bytes escaped, invalid UTF-8 replaced
// by U+FFFD, everything else as is.
func appendJSONString[S []byte | string](b []byte, s S) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	last := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c >= utf8.RuneSelf {
			r, size := utf8.DecodeRuneInString(string(s[i:min(len(s), i+utf8.UTFMax)]))
			if r != utf8.RuneError || size != 1 {
				i += size
				continue
			}
			b = append(append(b, s[last:i]...), `\ufffd`...)
			i++
			last = i
			continue
		}
		if c >= 0x20 && c != '\\' && c != '"' {
			i++
			continue
		}
		b = append(b, s[last:i]...)
		switch c {
		case '\\', '"':
			b = append(b, '\\', c)
		case '\n':
			b = append(b, `\n`...)
		case '\r':
			b = append(b, `\r`...)
		case '\t':
			b = append(b, `\t`...)
		default:
			b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		}
		i++
		last = i
	}
	return append(append(b, s[last:]...), '"')
}
