package soak

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/valyala/fastjson"

	"github.com/kvroute/kvroute/bench/workload"
)

// Traffic kinds of the mix.
const (
	KindShared = "shared-prefix"
	KindMulti  = "multi-turn"
	KindRandom = "random"
)

// Outcomes of one request. OutcomeOK, the clear failures (an error status,
// an SSE error event) and OutcomeAbandoned are accounted for; the others
// are lost unless the pod cut the stream (see Result.Cut).
const (
	OutcomeOK          = "ok"
	OutcomeStatus      = "error_status" // a non-200 answer
	OutcomeStreamError = "stream_error" // an SSE error event
	OutcomeAbandoned   = "abandoned"    // the client gave up on purpose
	OutcomeInterrupted = "interrupted"  // the run was interrupted
	OutcomeTruncated   = "truncated"    // the body ended or broke before its end
	OutcomeConnection  = "connection"   // no response (refused, reset)
	OutcomeTimeout     = "timeout"      // no end within the request timeout
	OutcomeBadBody     = "bad_body"     // a 200 whose body is not an answer
)

// lostOutcome reports whether an outcome leaves the client without an
// answer or a clear error.
func lostOutcome(o string) bool {
	switch o {
	case OutcomeTruncated, OutcomeConnection, OutcomeTimeout, OutcomeBadBody:
		return true
	}
	return false
}

// Record is one request's outcome. Times are seconds since the load began.
type Record struct {
	ID      string  `json:"id"`
	Kind    string  `json:"kind"`
	Chat    bool    `json:"chat"`
	Stream  bool    `json:"stream"`
	Abandon float64 `json:"abandon_after_s,omitempty"` // planned abandonment delay
	Start   float64 `json:"start_s"`
	End     float64 `json:"end_s"`
	Status  int     `json:"status"`
	Outcome string  `json:"outcome"`
	// Cut is why the pod ended the response early (CutKill, CutDrop),
	// when it did; a lost request with a cut was cut by its pod.
	Cut string `json:"cut,omitempty"`
	// Reached counts the pods that read the request (retries read it
	// more than once).
	Reached int    `json:"reached"`
	Detail  string `json:"detail,omitempty"`
}

var (
	errAbandoned = errors.New("soak: client abandoned the request")
	errTimeout   = errors.New("soak: request timeout")
)

// streamSuffix ends every body workload.AppendBody builds; non-streaming
// requests replace it.
const (
	streamSuffix   = `,"stream":true,"stream_options":{"include_usage":true},"ignore_eos":true}`
	noStreamSuffix = `,"stream":false,"ignore_eos":true}`
)

// Mix is the shape of the traffic: the share of each kind, of streaming
// requests and of requests the client abandons after a random short delay.
type Mix struct {
	Shared, Multi float64 // the rest is random
	Stream        float64
	Abandon       float64
	AbandonMin    time.Duration
	AbandonMax    time.Duration
}

// DefaultMix: 40% shared-prefix, 30% multi-turn turns, 30% random; 70%
// streaming; 8% abandoned after 50 ms–1.5 s.
func DefaultMix() Mix {
	return Mix{Shared: 0.4, Multi: 0.3, Stream: 0.7, Abandon: 0.08,
		AbandonMin: 50 * time.Millisecond, AbandonMax: 1500 * time.Millisecond}
}

// conv is a multi-turn conversation in progress.
type conv struct {
	s       *workload.Session
	turn    int
	answers []string
}

// item is one request to send.
type item struct {
	kind    string
	chat    bool
	stream  bool
	abandon time.Duration
	s       *workload.Session
	turn    int
	c       *conv // multi-turn only
}

// generator sends the mix to kvroute as an open loop (Poisson arrivals)
// and records every outcome.
type generator struct {
	url     string // kvroute base URL
	model   string
	rate    float64
	mix     Mix
	timeout time.Duration
	pods    *podSet
	rng     *rand.Rand // dispatcher goroutine only
	hc      *http.Client
	tr      *http.Transport
	parsers fastjson.ParserPool
	sem     chan struct{}
	wg      sync.WaitGroup
	start   time.Time

	shared, multi, random *workload.Workload
	nShared, nRandom      int // next session
	nConv                 int

	mu      sync.Mutex
	ready   []*conv // conversations whose next turn may go
	records []Record

	seq                          atomic.Uint64
	sent, ok, failed, abandoned  atomic.Int64
	lost, cut, skipped, inFlight atomic.Int64
}

// workloads builds the three generators of the mix, sized for a soak:
// moderate prompts and answers so the fleet and the machine keep up.
func workloads(seed uint64) (shared, multi, random *workload.Workload, err error) {
	if shared, err = (workload.Config{Kind: workload.KindSharedPrefix, Seed: seed, Groups: 8, PromptsPerGroup: 64,
		SystemTokens: 1024, QuestionTokens: 64, OutputTokens: 96}).Build(); err != nil {
		return
	}
	if multi, err = (workload.Config{Kind: workload.KindMultiTurn, Seed: seed + 1, Conversations: 256, PrefixTokens: 200,
		TurnsMin: 3, TurnsMax: 6, UserMin: 60, UserMax: 120, AnswerMin: 40, AnswerMax: 80}).Build(); err != nil {
		return
	}
	random, err = (workload.Config{Kind: workload.KindRandom, Seed: seed + 2, Requests: 4096,
		InputTokens: 512, OutputTokens: 64}).Build()
	return
}

func newGenerator(url, model string, rate float64, mix Mix, maxInFlight int, timeout time.Duration, seed uint64, pods *podSet) (*generator, error) {
	sh, mt, rd, err := workloads(seed)
	if err != nil {
		return nil, err
	}
	// Idle connections expire soon, so kvroute's open FDs follow the load
	// rather than the client pool's high-water mark.
	tr := &http.Transport{MaxIdleConnsPerHost: 16, IdleConnTimeout: 5 * time.Second, DisableCompression: true}
	return &generator{url: url, model: model, rate: rate, mix: mix, timeout: timeout, pods: pods,
		rng: rand.New(rand.NewPCG(seed, 0x736f616b)), hc: &http.Client{Transport: tr}, tr: tr,
		sem: make(chan struct{}, maxInFlight), shared: sh, multi: mt, random: rd}, nil
}

// run sends requests until stop is closed; requests in flight go on. ctx
// ends everything (interrupted requests are recorded as such).
func (g *generator) run(ctx context.Context, stop <-chan struct{}) {
	g.start = time.Now()
	next := g.start
	for {
		next = next.Add(time.Duration(g.rng.ExpFloat64() / g.rate * float64(time.Second)))
		if now := time.Now(); next.Before(now) {
			next = now
		}
		t := time.NewTimer(time.Until(next))
		select {
		case <-t.C:
		case <-stop:
			t.Stop()
			return
		case <-ctx.Done():
			t.Stop()
			return
		}
		select {
		case g.sem <- struct{}{}:
		default:
			g.skipped.Add(1) // the client's cap is reached: kvroute is that slow
			continue
		}
		it := g.pick()
		g.wg.Go(func() {
			defer func() { <-g.sem }()
			g.send(ctx, it)
		})
	}
}

// wait waits for the requests in flight, at most d; it reports whether
// they all ended.
func (g *generator) wait(d time.Duration) bool {
	done := make(chan struct{})
	go func() { g.wg.Wait(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
}

func (g *generator) close() { g.tr.CloseIdleConnections() }

// pick draws the next request of the mix.
func (g *generator) pick() item {
	r := g.rng
	it := item{stream: r.Float64() < g.mix.Stream}
	if r.Float64() < g.mix.Abandon {
		span := g.mix.AbandonMax - g.mix.AbandonMin
		it.abandon = g.mix.AbandonMin + time.Duration(r.Float64()*float64(span))
	}
	switch u := r.Float64(); {
	case u < g.mix.Shared:
		it.kind, it.chat = KindShared, r.IntN(2) == 0
		it.s = &g.shared.Sessions[g.nShared%len(g.shared.Sessions)]
		g.nShared++
	case u < g.mix.Shared+g.mix.Multi:
		it.kind, it.chat = KindMulti, true
		g.mu.Lock()
		if len(g.ready) > 0 {
			it.c = g.ready[0]
			g.ready = g.ready[1:]
		}
		g.mu.Unlock()
		if it.c == nil {
			it.c = &conv{s: &g.multi.Sessions[g.nConv%len(g.multi.Sessions)]}
			g.nConv++
		}
		it.s, it.turn = it.c.s, it.c.turn
	default:
		it.kind = KindRandom
		it.s = &g.random.Sessions[g.nRandom%len(g.random.Sessions)]
		g.nRandom++
	}
	return it
}

// body renders the request body of it.
func (g *generator) body(it item) []byte {
	api := workload.APICompletions
	if it.chat {
		api = workload.APIChat
	}
	var answers []string
	if it.c != nil {
		answers = it.c.answers
	}
	b := workload.AppendBody(make([]byte, 0, 8<<10), api, g.model, it.s, it.turn, answers)
	if !it.stream && bytes.HasSuffix(b, []byte(streamSuffix)) {
		b = append(b[:len(b)-len(streamSuffix)], noStreamSuffix...)
	}
	return b
}

// send sends one request and records its outcome.
func (g *generator) send(ctx context.Context, it item) {
	id := "soak-" + strconv.FormatUint(g.seq.Add(1), 10)
	rec := Record{ID: id, Kind: it.kind, Chat: it.chat, Stream: it.stream, Abandon: it.abandon.Seconds(),
		Start: time.Since(g.start).Seconds()}
	g.sent.Add(1)
	g.inFlight.Add(1)
	answer := g.exchange(ctx, it, id, &rec)
	g.inFlight.Add(-1)
	rec.End = time.Since(g.start).Seconds()
	if lostOutcome(rec.Outcome) {
		rec.Cut = g.pods.cutReason(id)
	}
	rec.Reached = g.pods.reached(id)
	switch {
	case rec.Outcome == OutcomeOK:
		g.ok.Add(1)
	case rec.Outcome == OutcomeStatus || rec.Outcome == OutcomeStreamError:
		g.failed.Add(1)
	case rec.Outcome == OutcomeAbandoned || rec.Outcome == OutcomeInterrupted:
		g.abandoned.Add(1)
	case rec.Cut != "":
		g.cut.Add(1)
	default:
		g.lost.Add(1)
	}
	if it.c != nil {
		g.mu.Lock()
		if rec.Outcome == OutcomeOK && it.c.turn+1 < len(it.c.s.Turns) {
			it.c.answers = append(it.c.answers, answer)
			it.c.turn++
			g.ready = append(g.ready, it.c)
		}
		g.mu.Unlock()
	}
	g.mu.Lock()
	g.records = append(g.records, rec)
	g.mu.Unlock()
}

// exchange performs the HTTP exchange and fills rec's status and outcome;
// it returns the generated text of a successful multi-turn request.
func (g *generator) exchange(ctx context.Context, it item, id string, rec *Record) string {
	rctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	rctx, cancelT := context.WithTimeoutCause(rctx, g.timeout, errTimeout)
	defer cancelT()
	if it.abandon > 0 {
		t := time.AfterFunc(it.abandon, func() { cancel(errAbandoned) })
		defer t.Stop()
	}
	path := "/v1/completions"
	if it.chat {
		path = "/v1/chat/completions"
	}
	req, err := http.NewRequestWithContext(rctx, http.MethodPost, g.url+path, bytes.NewReader(g.body(it)))
	if err != nil {
		rec.Outcome, rec.Detail = OutcomeBadBody, err.Error()
		return ""
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", id)
	fail := func(kind string, err error) string {
		switch cause := context.Cause(rctx); {
		case errors.Is(cause, errAbandoned):
			rec.Outcome = OutcomeAbandoned
		case errors.Is(cause, errTimeout):
			rec.Outcome = OutcomeTimeout
		case ctx.Err() != nil:
			rec.Outcome = OutcomeInterrupted
		default:
			rec.Outcome = kind
		}
		if err != nil && rec.Outcome != OutcomeAbandoned {
			rec.Detail = err.Error()
		}
		return ""
	}
	resp, err := g.hc.Do(req)
	if err != nil {
		return fail(OutcomeConnection, err)
	}
	defer resp.Body.Close()
	rec.Status = resp.StatusCode
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		rec.Outcome = OutcomeStatus
		return ""
	}
	keep := it.c != nil
	p := g.parsers.Get()
	defer g.parsers.Put(p)
	if !it.stream {
		b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
		if err != nil {
			return fail(OutcomeTruncated, err)
		}
		text, ok, errEvent := parseAnswer(p, b)
		switch {
		case errEvent:
			rec.Outcome = OutcomeStreamError
		case !ok:
			rec.Outcome, rec.Detail = OutcomeBadBody, truncate(string(b), 200)
		default:
			rec.Outcome = OutcomeOK
		}
		return text
	}
	answer, done, errEvent, bad, err := readSSE(p, resp.Body, keep)
	switch {
	case errEvent:
		rec.Outcome = OutcomeStreamError
		return ""
	case bad:
		rec.Outcome, rec.Detail = OutcomeBadBody, "unparseable SSE event"
		return ""
	case done:
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // the last chunk
		rec.Outcome = OutcomeOK
		return string(answer)
	}
	if err == nil {
		err = io.ErrUnexpectedEOF // a clean end without data: [DONE]
	}
	return fail(OutcomeTruncated, err)
}

// readSSE reads a streamed completion's events from r until data: [DONE]
// (done) or the end of r (err: the read error, nil at a clean end): the
// answer's text when keep is set, whether an event was an error event
// (errEvent) and whether one did not parse (bad).
func readSSE(p *fastjson.Parser, r io.Reader, keep bool) (answer []byte, done, errEvent, bad bool, err error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 16<<10), 4<<20)
	for sc.Scan() {
		payload, ok := bytes.CutPrefix(sc.Bytes(), []byte("data:"))
		if !ok {
			continue
		}
		payload = bytes.TrimSpace(payload)
		if string(payload) == "[DONE]" {
			return answer, true, errEvent, bad, nil
		}
		text, ok, isErr := parseChunk(p, payload)
		errEvent = errEvent || isErr
		bad = bad || !ok
		if keep {
			answer = append(answer, text...)
		}
	}
	return answer, false, errEvent, bad, sc.Err()
}

// parseChunk reads one SSE data payload: its text, whether it parsed, and
// whether it is an error event.
func parseChunk(p *fastjson.Parser, payload []byte) (text []byte, ok, isErr bool) {
	v, err := p.ParseBytes(payload)
	if err != nil || v.Type() != fastjson.TypeObject {
		return nil, false, false
	}
	if v.Get("error") != nil || string(v.GetStringBytes("object")) == "error" {
		return nil, true, true
	}
	if ch := v.GetArray("choices"); len(ch) > 0 {
		if t := ch[0].GetStringBytes("text"); len(t) > 0 {
			return t, true, false
		}
		return ch[0].GetStringBytes("delta", "content"), true, false
	}
	return nil, true, false
}

// parseAnswer reads a non-streaming answer: its text, whether it is an
// answer, and whether it is an error object.
func parseAnswer(p *fastjson.Parser, body []byte) (text string, ok, isErr bool) {
	v, err := p.ParseBytes(body)
	if err != nil || v.Type() != fastjson.TypeObject {
		return "", false, false
	}
	if v.Get("error") != nil {
		return "", false, true
	}
	ch := v.GetArray("choices")
	if len(ch) == 0 {
		return "", false, false
	}
	if t := ch[0].Get("text"); t != nil {
		return string(t.GetStringBytes()), true, false
	}
	return string(ch[0].GetStringBytes("message", "content")), true, false
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// snapshot returns a copy of the records so far.
func (g *generator) snapshot() []Record {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]Record(nil), g.records...)
}
