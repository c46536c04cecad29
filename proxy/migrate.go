package proxy

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"strconv"
	"time"

	"github.com/valyala/fasthttp"
	"github.com/valyala/fastjson"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

// Mid-stream failover (migration). When the endpoint of a streamed
// /v1/completions or /v1/chat/completions answer fails after its first
// byte (the connection reset or closed early, the stream-idle timeout, an
// error event from the engine, the endpoint leaving discovery:
// drainGone), another endpoint picked by the policy
// continues the generation, and the client reads one stream:
//
//   - completions: the original prompt followed by exactly the text already
//     sent; chat: the messages followed by the partial assistant message,
//     with vLLM's continue_final_message and add_generation_prompt false;
//     max_tokens (max_completion_tokens, min_tokens) less the tokens already
//     generated; every other parameter unchanged;
//   - the continuation's events carry the first leg's id, created and model;
//     its role-only first chat event is dropped; its usage chunk reports the
//     original prompt's tokens and the completion tokens of both legs.
//
// streamTrack follows the answer event by event to make that possible. It
// reads each event the client receives with two anchored searches (the
// text, the end), so the first leg costs a stream little; only a
// continuation's events are parsed and rewritten. An event is written only
// once it is complete, so the client never holds half an event when the
// leg fails.
type streamTrack struct {
	on   bool // the answer may be continued (continuable), and tracking holds
	chat bool
	// text is the text the client has received, as the JSON string
	// content the engine wrote (escaped as it escaped it); tokens counts
	// the answer's events, one token each as vLLM streams by default.
	text   []byte
	tokens int
	given  int // of them, those the current continuation was given
	// The first leg's id, created and model (raw JSON values), from its
	// first event.
	id, created, model []byte
	last               []byte // the last event's data
	legs               int    // continuations so far
	failed             bool   // the engine sent an error event: the leg failed
	done               bool   // [DONE] went by
	// A continuation's state: its events are rewritten into out (the
	// role-only first event of a chat continuation dropped, its usage
	// corrected by given), with the first leg's values in leg1.
	rewrite   bool
	out       []byte
	legParser fastjson.Parser // leg1's values (a migrated stream's)
	arena     fastjson.Arena
	leg1      []*fastjson.Value // id, created, model
	// When the last migration began (for the gap until its first event).
	migratedAt time.Time
}

func (t *streamTrack) reset(on, chat bool) {
	t.on, t.chat = on, chat
	if cap(t.text) > keptTrackBytes || cap(t.out) > keptTrackBytes { // a long answer's buffers are not pooled
		t.text, t.out = nil, nil
	}
	t.text, t.tokens, t.given = t.text[:0], 0, 0
	t.id, t.created, t.model = t.id[:0], t.created[:0], t.model[:0]
	t.legs, t.failed, t.done, t.rewrite, t.leg1, t.migratedAt = 0, false, false, false, nil, time.Time{}
	t.arena.Reset()
	t.last = t.last[:0]
}

// keptTrackBytes is the largest text or output buffer a pooled body keeps.
const keptTrackBytes = 64 << 10

// eventEnd returns the length of p's first complete event (through its
// blank line: "\n\n", or "\r\n\r\n"), or -1.
func eventEnd(p []byte) int {
	for i := 0; ; {
		j := bytes.IndexByte(p[i:], '\n')
		if j < 0 {
			return -1
		}
		k := i + j + 1
		switch {
		case k < len(p) && p[k] == '\n':
			return k + 1
		case k+1 < len(p) && p[k] == '\r' && p[k+1] == '\n':
			return k + 2
		}
		i = k
	}
}

// The keys follow looks for. A search for a pattern that starts with a
// quote tests nearly every byte of JSON (bytes.Index looks for the first
// byte, then compares); these start with a byte that is rare in an
// answer chunk ('x' of "text", '{' before vLLM's delta content), and the
// bytes before the match are checked: keyBefore.
var (
	anchorText      = []byte(`xt":"`)        // "text":"
	anchorDelta     = []byte(`{"content":"`) // vLLM's "delta":{"content":"
	anchorContent   = []byte(`"content":"`)  // any other layout
	anchorRole      = []byte(`"role":"assistant"`)
	anchorToolCalls = []byte(`"tool_calls":[`)
	anchorReasoning = []byte(`"reasoning_content":"`)
	anchorFinish    = []byte(`"finish_reason":"`)
	anchorUsageOnly = []byte(`"choices":[]`)
	eventDone       = []byte("data: [DONE]")
	eventData       = []byte("data: ")
	chunkStart      = []byte(`{"id"`)
)

// jsonStringEnd returns the index of the quote that ends the JSON string
// content starting at p[0], or -1.
func jsonStringEnd(p []byte) int {
	for i := 0; i < len(p); i++ {
		switch p[i] {
		case '\\':
			i++
		case '"':
			return i
		}
	}
	return -1
}

// textAt returns the offset in data of the answer's text in this event
// (the JSON string content after "text": or the delta's "content":), or
// -1 when the event has none.
func (t *streamTrack) textAt(data []byte) int {
	if !t.chat {
		for off := 0; ; {
			i := bytes.Index(data[off:], anchorText)
			if i < 0 {
				return -1
			}
			if i += off; i >= 3 && string(data[i-3:i]) == `"te` {
				return i + len(anchorText)
			}
			off = i + 1
		}
	}
	if i := bytes.Index(data, anchorDelta); i >= 0 {
		return i + len(anchorDelta)
	}
	// Another key first in the delta (the role of the first event, or
	// another engine's layout).
	i := bytes.Index(data, anchorContent)
	if i < 0 || bytes.Contains(data, anchorRole) {
		return -1 // no text, or the role-only first event
	}
	return i + len(anchorContent)
}

// follow reads one complete event the client is about to receive: its
// text and its token. It returns false for an error event, which the
// client must not receive (the leg failed).
func (t *streamTrack) follow(ev []byte) bool {
	data, ok := bytes.CutPrefix(ev, eventData)
	if !ok {
		return true // a comment or another field: nothing of the answer
	}
	if !bytes.HasPrefix(data, chunkStart) {
		if bytes.HasPrefix(data, eventDone[len(eventData):]) {
			t.done = true
			return true
		}
		if t.isErrorEvent(data) {
			t.failed = true
			return false
		}
	}
	if len(t.id) == 0 {
		t.firstEvent(data)
	}
	t.last = append(t.last[:0], data...)
	i := t.textAt(data)
	if i < 0 {
		if t.chat && (bytes.Contains(data, anchorToolCalls) || bytes.Contains(data, anchorReasoning)) {
			t.on = false // a tool call or reasoning half streamed cannot be continued
		}
		return true
	}
	j := jsonStringEnd(data[i:])
	if j < 0 {
		t.on = false
		return true
	}
	t.text = append(t.text, data[i:i+j]...)
	t.tokens++
	return true
}

// ended reports whether the answer's end went by: [DONE], a finish
// reason, or the usage chunk that follows it, in the last event.
func (t *streamTrack) ended() bool {
	return t.done || bytes.Contains(t.last, anchorFinish) || bytes.Contains(t.last, anchorUsageOnly)
}

// isErrorEvent reports whether an event's data is an engine's error
// object (vLLM's nested {"error": {...}} or its older flat envelope).
func (t *streamTrack) isErrorEvent(data []byte) bool {
	p := parsers.Get()
	defer parsers.Put(p)
	v, err := p.ParseBytes(bytes.TrimSpace(data))
	if err != nil || v.Type() != fastjson.TypeObject {
		return false
	}
	return v.Get("error") != nil || string(v.GetStringBytes("object")) == "error"
}

// parsers parse the few events tracking reads whole, so that a stream
// keeps no parser's memory.
var parsers fastjson.ParserPool

// firstEvent keeps the first leg's id, created and model.
func (t *streamTrack) firstEvent(data []byte) {
	p := parsers.Get()
	defer parsers.Put(p)
	v, err := p.ParseBytes(bytes.TrimSpace(data))
	if err != nil {
		return
	}
	for _, f := range []struct {
		dst *[]byte
		key string
	}{{&t.id, "id"}, {&t.created, "created"}, {&t.model, "model"}} {
		if x := v.Get(f.key); x != nil {
			*f.dst = appendJSON((*f.dst)[:0], x)
		}
	}
	if len(t.id) == 0 {
		t.on = false // not an answer chunk kvroute can rewrite a continuation after
	}
}

// rewriteEvent appends a continuation's complete event ev to t.out as
// the client must see it, and follows it. It returns false for an error
// event.
func (t *streamTrack) rewriteEvent(ev []byte) bool {
	data, ok := bytes.CutPrefix(ev, eventData)
	if !ok || bytes.HasPrefix(data, eventDone[len(eventData):]) {
		t.out = append(t.out, ev...)
		t.follow(ev)
		return true
	}
	if !bytes.HasPrefix(data, chunkStart) && t.isErrorEvent(data) {
		t.failed = true
		return false
	}
	p := parsers.Get()
	defer parsers.Put(p)
	v, err := p.ParseBytes(bytes.TrimSpace(data))
	if err != nil || v.Type() != fastjson.TypeObject {
		t.out = append(t.out, ev...) // not JSON: as it came
		return true
	}
	if t.chat {
		if d := v.Get("choices", "0", "delta"); d != nil && d.Get("role") != nil && len(d.GetStringBytes("content")) == 0 &&
			d.Get("tool_calls") == nil && len(v.GetStringBytes("choices", "0", "finish_reason")) == 0 {
			return true // the continuation's role-only first event
		}
	}
	for i, k := range [...]string{"id", "created", "model"} {
		if i < len(t.leg1) {
			v.Set(k, t.leg1[i])
		}
	}
	if u := v.Get("usage"); u != nil && u.Type() == fastjson.TypeObject {
		t.fixUsage(u)
	}
	start := len(t.out)
	t.out = append(appendJSON(append(t.out, eventData...), v), "\n\n"...)
	t.follow(t.out[start:])
	return true
}

// fixUsage makes a continuation's usage the answer's: the prompt's tokens
// are the continuation's less the first legs' text (what it was given),
// the completion tokens those of every leg.
func (t *streamTrack) fixUsage(u *fastjson.Value) {
	prompt, completion := u.GetInt("prompt_tokens"), u.GetInt("completion_tokens")
	prompt = max(0, prompt-t.given)
	completion += t.given
	u.Set("prompt_tokens", t.arena.NewNumberInt(prompt))
	u.Set("completion_tokens", t.arena.NewNumberInt(completion))
	u.Set("total_tokens", t.arena.NewNumberInt(prompt+completion))
}

// continuable reports whether st's answer, if it streams, could be
// continued by another endpoint: a streamed completion of one string
// prompt or a chat, one choice, no log probabilities, no echo, no
// continuation of the client's own, no disaggregation.
func (s *Server) continuable(st *reqState) bool {
	r, v := &st.req, st.root
	if s.opt.MaxMigrations <= 0 || s.pd != nil || !r.Stream || st.n > 1 || v == nil || st.clientKV {
		return false
	}
	for _, k := range [...]string{"logprobs", "top_logprobs", "prompt_logprobs", "echo", "best_of", "suffix", "continue_final_message"} {
		if x := v.Get(k); x != nil && x.Type() != fastjson.TypeNull && x.Type() != fastjson.TypeFalse && !(k == "best_of" && x.GetInt() <= 1) {
			return false
		}
	}
	switch r.Kind {
	case routing.KindCompletions:
		p := v.Get("prompt")
		return p != nil && p.Type() == fastjson.TypeString
	case routing.KindChat:
		m := v.Get("messages")
		return m != nil && m.Type() == fastjson.TypeArray
	}
	return false
}

// continuation returns the body of the request that continues body's
// answer after text (JSON string content) and tokens generated tokens.
func continuation(body []byte, chat bool, text []byte, tokens int) ([]byte, error) {
	var p fastjson.Parser
	v, err := p.ParseBytes(body)
	if err != nil {
		return nil, err
	}
	o, err := v.Object()
	if err != nil {
		return nil, err
	}
	out := make([]byte, 0, len(body)+len(text)+128)
	out = append(out, '{')
	field := func(k string) {
		if len(out) > 1 {
			out = append(out, ',')
		}
		out = append(appendJSONString(out, k), ':')
	}
	o.Visit(func(kb []byte, x *fastjson.Value) {
		k := string(kb)
		switch k {
		case "continue_final_message", "add_generation_prompt":
			return // set below
		case "max_tokens", "max_completion_tokens", "min_tokens":
			if x.Type() == fastjson.TypeNumber {
				n := max(x.GetInt()-tokens, 1)
				if k == "min_tokens" {
					n = max(x.GetInt()-tokens, 0)
				}
				field(k)
				out = strconv.AppendInt(out, int64(n), 10)
				return
			}
		case "prompt":
			if !chat && x.Type() == fastjson.TypeString {
				field(k)
				q := appendJSON(nil, x)
				out = append(append(append(out, q[:len(q)-1]...), text...), '"')
				return
			}
		case "messages":
			if chat && x.Type() == fastjson.TypeArray {
				field(k)
				q := appendJSON(nil, x)
				q = q[:len(q)-1] // without its closing bracket
				out = append(out, q...)
				if len(q) > 1 {
					out = append(out, ',')
				}
				out = append(append(append(out, `{"role":"assistant","content":"`...), text...), `"}]`...)
				return
			}
		}
		field(k)
		out = appendJSON(out, x)
	})
	if chat {
		field("continue_final_message")
		out = append(out, "true"...)
		field("add_generation_prompt")
		out = append(out, "false"...)
	}
	return append(out, '}'), nil
}

// appendJSON appends v as JSON. fastjson's MarshalTo escapes a string
// with a control byte or invalid UTF-8 as Go does (\x01), which is not
// JSON; strings are escaped here as the access log escapes them.
func appendJSON(b []byte, v *fastjson.Value) []byte {
	switch v.Type() {
	case fastjson.TypeString:
		return appendJSONString(b, v.GetStringBytes())
	case fastjson.TypeObject:
		o, _ := v.Object()
		b = append(b, '{')
		first := true
		o.Visit(func(k []byte, x *fastjson.Value) {
			if !first {
				b = append(b, ',')
			}
			first = false
			b = appendJSON(append(appendJSONString(b, k), ':'), x)
		})
		return append(b, '}')
	case fastjson.TypeArray:
		b = append(b, '[')
		for i, x := range v.GetArray() {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendJSON(b, x)
		}
		return append(b, ']')
	}
	return v.MarshalTo(b) // numbers as written, true, false, null
}

// Causes of a migration (kvroute_migrations_total's cause label).
const (
	migrateCut     = "cut"       // the connection failed or closed before the end
	migrateTimeout = "timeout"   // the stream-idle timeout
	migrateError   = "error"     // the engine sent an error event
	migrateDrained = "drained"   // the endpoint left discovery or drains
	migrateCutFor  = "preempted" // the queue took its place back for another request (preempt.go)
)

// migrate continues the answer on another endpoint after its leg failed
// for cause, and reports whether the body now streams from it. ctx is
// the client's request, valid while fasthttp writes the body.
func (b *upstreamBody) migrate(cause string) bool {
	s, t := b.s, &b.track
	if !t.on || t.ended() || b.ctx == nil || t.legs >= s.opt.MaxMigrations || b.att.clientGone() {
		if t.on || cause == migrateError {
			s.opt.Metrics.Migration(cause, "not_continued")
		}
		return false
	}
	cut := cause == migrateCutFor
	if !cut && !s.budget.allow() {
		s.opt.Metrics.RetryDenied()
		s.opt.Metrics.Migration(cause, "not_continued")
		return false
	}
	start := time.Now()
	ctx := b.ctx
	body, err := continuation(ctx.PostBody(), t.chat, t.text, t.tokens)
	if err != nil {
		s.opt.Metrics.Migration(cause, "failed")
		return false
	}
	failedEP, failedAtt, legErr := b.rec.ep, b.att, b.readErr
	if legErr == nil {
		legErr = errEngineError
	}
	b.endLeg()
	b.readErr = legErr // until the continuation streams
	if cut {
		// Its place is free; its flow runs one fewer until it restarts.
		s.queue.runs.ended(failedAtt.flow)
		s.queue.freed()
	}

	st := s.states.Get().(*reqState)
	st.reset()
	defer s.release(st)
	defer st.lease.Release()
	b.continuing(st, cut, failedAtt)
	ctx.Request.SetBody(body)
	if err := st.parse(st.req.Kind, ctx.PostBody(), s.opt.BlockSize, s.opt.MaxBlocks); err != nil {
		s.opt.Metrics.Migration(cause, "failed")
		return false
	}
	tried := 0 // the continuation's attempts beyond the endpoints it avoids
	if !cut {  // a cut endpoint did not fail: it may continue the answer
		st.req.Tried = append(st.req.Tried, failedEP)
		tried = 1
	}
	resp, d, err := s.forward(ctx, st)
	if err == nil && (resp.StatusCode() != fasthttp.StatusOK || !isEventStream(resp) || resp.BodyStream() == nil) {
		s.discard(resp, st.att)
		s.attempts.end(st.att)
		fasthttp.ReleaseResponse(resp)
		err = &statusError{endpoint: d.Endpoint.URL, code: resp.StatusCode()}
	}
	if err != nil {
		if cut && !st.admitted {
			s.queue.runs.restarted(failedAtt.flow) // its end counts it out
		}
		s.opt.Logger.Warn("stream migration failed", zap.ByteString("request_id", b.rec.reqID), zap.String("cause", cause), zap.Error(err))
		s.opt.Metrics.Migration(cause, "failed")
		return false
	}
	// The body streams from the continuation now.
	b.legFailed(failedEP, failedAtt, legErr)
	b.resp, b.rd, b.att = resp, resp.BodyStream(), st.att
	b.lease = st.lease.Take()
	b.rec.ep, b.rec.decision, b.rec.attempts = d.Endpoint, d, b.rec.attempts+len(st.req.Tried)-tried
	b.rec.migrations++
	b.readErr, b.observe, b.legFirst = nil, false, false
	b.usage, b.promptBytes = usageScanner{}, st.req.PromptBytes
	t.legs++
	t.keepFirstLeg()
	t.migratedAt, t.given = start, t.tokens
	b.hook()
	if t.on {
		b.att.setMovable()
		s.offer(st, b.att) // a cut one may be cut again, as old as it was
	}
	s.opt.Metrics.Migration(cause, "continued")
	log := s.opt.Logger.Info
	if cut {
		log = s.opt.Logger.Debug // the queue's doing, not a failure
	}
	log("stream migrated", zap.ByteString("request_id", b.rec.reqID), zap.String("cause", cause),
		zap.String("from", failedEP.URL), zap.String("to", d.Endpoint.URL), zap.Int("tokens", t.tokens),
		zap.Duration("took", time.Since(start)))
	return true
}

// continuing readies st, a fresh state, for the continuation of b's
// answer after the leg of attempt att failed, or was cut for another
// request (cut: it then waits for a place as its flow's next request).
func (b *upstreamBody) continuing(st *reqState, cut bool, att *attempt) {
	st.req.Kind, st.migrating, st.legs = routing.Kind(b.rec.class), true, b.track.legs+1
	if cut {
		st.offered = att.offered
		st.tenant, st.class, st.resumed, st.resumeSeq = b.rec.tenant, b.rec.tier, true, att.seq
	}
	st.traceID, st.flags = b.rec.traceID, b.flags
	if b.rec.span != nil { // the continuation's pick and attempt are spans of the request
		st.span, st.tctx = b.rec.span, trace.ContextWithSpan(context.Background(), b.rec.span)
	}
	st.uri = append(st.uri[:0], b.uri...) // the request's now carries the failed endpoint's base path
}

// keepFirstLeg makes the continuations' events carry the first leg's id,
// created and model, from the first continuation on.
func (t *streamTrack) keepFirstLeg() {
	if t.rewrite {
		return
	}
	t.rewrite = true
	raw := append(append(append(append(append(append(t.out[:0], '['), t.id...), ','), t.created...), ','), t.model...)
	t.leg1 = nil
	if v, err := t.legParser.ParseBytes(append(raw, ']')); err == nil && len(t.created) > 0 && len(t.model) > 0 {
		t.leg1 = v.GetArray()
	}
}

// endLeg ends the failed leg: its connection (closed, unless drained),
// attempt and lease. b.resp is nil from then on: the leg cannot be read.
func (b *upstreamBody) endLeg() {
	b.unhook()
	b.s.attempts.end(b.att)
	_ = b.resp.CloseBodyStream()
	fasthttp.ReleaseResponse(b.resp)
	b.lease.Release()
	b.resp, b.rd = nil, nil
}

// legFailed counts a failed answer body (a stream's leg) against its
// endpoint (unless kvroute cut it), in kvroute_upstream_errors_total and
// the log.
func (b *upstreamBody) legFailed(ep *discovery.Endpoint, a *attempt, err error) {
	if a.wasCut() {
		return // the queue took its place back: nothing failed
	}
	if !a.wasAborted() {
		ep.ReportFailure()
	}
	b.s.opt.Metrics.UpstreamError(failBody)
	b.s.opt.Logger.Warn("upstream body failed", zap.ByteString("request_id", b.rec.reqID),
		zap.String("endpoint", ep.URL), zap.Error(err))
}

// errEngineError: the engine ended its answer with an error event.
var errEngineError = errors.New("proxy: the engine sent an error event mid-stream")

// causeOf names the cause of a leg's read failure err on attempt a.
func causeOf(a *attempt, err error) string {
	if a.wasDrained() {
		return migrateDrained
	}
	if a.wasCut() {
		return migrateCutFor
	}
	var ne net.Error
	if errors.Is(err, os.ErrDeadlineExceeded) || errors.As(err, &ne) && ne.Timeout() {
		return migrateTimeout
	}
	return migrateCut
}
