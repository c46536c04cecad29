package load

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvroute/kvroute/bench/workload"
)

// Config configures one load run against one target.
type Config struct {
	// BaseURL receives the requests: kvroute, one pod, or any
	// OpenAI-compatible server ("http://host:port[/prefix]").
	BaseURL string
	// PodURLs are the engines' base URLs; when set (and NoEngineMetrics
	// not), their /metrics are scraped before and after the run (and each
	// stage) for the engine-side prefix-cache hit rate.
	PodURLs []string
	// Direct sends every request straight to one of PodURLs instead of
	// BaseURL, with fixed, balanced affinity: the sessions of prefix group
	// g to pod g mod n, every other session (a conversation, a random
	// prompt) to pod s mod n for its index s. It is the finite-cache
	// reference a router is measured against: each group cached on one
	// pod, groups spread evenly, no load awareness.
	Direct bool
	// NoEngineMetrics leaves PodURLs' /metrics alone: engines without
	// vLLM's (Ollama has none; llama-server's, when on, have other names).
	NoEngineMetrics bool
	// Model is the "model" field; "" leaves it out (the server's default).
	Model string
	// API selects completions or chat.
	API workload.API
	// Workload is what to send; Load how.
	Workload *workload.Workload
	Load     Load
	// SLO sets the objectives goodput counts.
	SLO SLO
	// TimeScale is modelled time ÷ wall time of the target (a simulator
	// run with --time-scale); measured durations are multiplied by it and
	// rates divided. 0 means 1 (real engines).
	TimeScale float64
	// Timeout bounds one request, send to end of stream, in wall time;
	// 0 means 30 minutes.
	Timeout time.Duration
	// Seed seeds the arrival process.
	Seed uint64
	// Label names the run (e.g. the policy) in results and progress.
	Label string
	// APIKey, when set, is sent as Authorization: Bearer (a tenant);
	// ServiceTier, when set, as every body's "service_tier".
	APIKey      string
	ServiceTier string
	// Progress, when non-nil, gets a status line every second, each
	// starting with a carriage return (for a terminal), and a newline at
	// the end. nil: quiet.
	Progress io.Writer
}

// Result is one run's outcome. Times and rates are modelled.
type Result struct {
	Label   string       `json:"label"`
	Target  string       `json:"target"`
	API     workload.API `json:"api"`
	Started time.Time    `json:"started"`
	// WallSeconds is the run's wall-clock length.
	WallSeconds float64 `json:"wall_s"`
	TimeScale   float64 `json:"time_scale"`
	// IdealHitRate is the workload's infinite-cache hit rate for the
	// requests sent (see workload.IdealHitRate).
	IdealHitRate float64 `json:"ideal_hit_rate"`
	Summary      Summary `json:"summary"`
	// Stages has one entry per load stage when there are several.
	Stages []StageResult `json:"stages,omitempty"`
	// Engine is the engines' side of the run (nil without PodURLs).
	Engine *EngineStats `json:"engine,omitempty"`
	// EngineErr records a failed scrape after the start.
	EngineErr string   `json:"engine_error,omitempty"`
	CPU       CPUStats `json:"cpu"`
	// Requests are the per-request records, in send order.
	Requests []RequestResult `json:"-"`
}

// StageResult is one load stage's outcome.
type StageResult struct {
	Rate    Rate         `json:"rate"`
	Summary Summary      `json:"summary"`
	Engine  *EngineStats `json:"engine,omitempty"`
}

// defaultTimeout bounds one request when Config.Timeout is 0.
const defaultTimeout = 30 * time.Minute

// Run drives cfg.Workload at cfg.BaseURL as cfg.Load says and returns what
// it measured. When ctx ends it stops sending, aborts requests in flight
// (counted as "canceled") and returns the partial result with ctx's error.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	if cfg.Workload == nil || len(cfg.Workload.Sessions) == 0 {
		return nil, fmt.Errorf("%w: empty workload", ErrConfig)
	}
	if err := cfg.Load.Validate(); err != nil {
		return nil, err
	}
	if cfg.Load.Arrival == ArrivalTrace && cfg.Workload.Config.Kind != workload.KindTrace {
		return nil, fmt.Errorf("%w: trace arrivals need a trace workload", ErrConfig)
	}
	if cfg.TimeScale <= 0 {
		cfg.TimeScale = 1
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = defaultTimeout
	}
	targets := []string{cfg.BaseURL}
	if cfg.Direct {
		if len(cfg.PodURLs) == 0 {
			return nil, fmt.Errorf("%w: direct sending needs pod URLs", ErrConfig)
		}
		targets = cfg.PodURLs
	}
	r := &runner{cfg: cfg, scale: cfg.TimeScale}
	for _, t := range targets {
		c, err := newClient(t, cfg.API, cfg.Timeout)
		c.apiKey = cfg.APIKey
		if err != nil {
			return nil, err
		}
		defer c.close()
		stopAbort := context.AfterFunc(ctx, c.close)
		defer stopAbort()
		r.clients = append(r.clients, c)
	}
	r.plan()
	res := &Result{Label: cfg.Label, Target: cfg.BaseURL, API: cfg.API, TimeScale: cfg.TimeScale}
	res.IdealHitRate = workload.IdealHitRate(cfg.Workload, cfg.API, r.total, workload.DefaultBlockSize)

	hc := &http.Client{Timeout: scrapeTimeout}
	defer hc.CloseIdleConnections()
	var before *EngineSnapshot
	if len(cfg.PodURLs) > 0 && !cfg.NoEngineMetrics {
		var err error
		if before, err = ScrapeEngines(ctx, hc, cfg.PodURLs); err != nil {
			return nil, err
		}
	}

	cpu := startCPU()
	r.start = time.Now()
	res.Started = r.start
	r.progressStart()

	if cfg.Load.Arrival == ArrivalClosed {
		r.closedLoop(ctx)
	} else {
		r.openLoop(ctx, hc, before)
	}
	res.CPU = cpu.finish()
	res.WallSeconds = time.Since(r.start).Seconds()
	r.progressStop()

	if before != nil {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), scrapeTimeout)
		after, err := ScrapeEngines(sctx, hc, cfg.PodURLs)
		cancel()
		if err != nil {
			res.EngineErr = err.Error()
		} else {
			st := after.Since(before)
			res.Engine = &st
		}
	}

	r.mu.Lock()
	res.Requests = r.results
	r.mu.Unlock()
	slices.SortStableFunc(res.Requests, func(a, b RequestResult) int { return cmpFloat(a.Start, b.Start) })
	res.Summary = Summarize(res.Requests, cfg.SLO, 0)
	if len(r.stages) > 1 {
		res.Stages = r.stageResults(res.Requests)
	}
	return res, ctx.Err()
}

func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// runner is one Run's state.
type runner struct {
	cfg Config
	// clients are BaseURL's, or one per pod URL with Config.Direct.
	clients []*client
	scale   float64
	start   time.Time
	stages  []Stage
	total   int // requests to send; −1: until Duration expires
	q       *queue

	stage atomic.Int32
	// Per stage: its window in wall time (first send to the end of its
	// last send) and the engines' counters over that window.
	stageFrom, stageTo []time.Time
	stageEngine        []*EngineStats

	mu      sync.Mutex
	results []RequestResult
	ttfts   []float64 // successful TTFTs so far, for the progress line
	sent    atomic.Int64
	done    atomic.Int64
	failed  atomic.Int64

	progStop chan struct{}
	progDone chan struct{}
}

// plan resolves the stages and the number of requests to send.
func (r *runner) plan() {
	r.total, r.stages = r.cfg.Planned(), r.cfg.Load.Stages
	if len(r.stages) == 0 {
		r.stages = []Stage{{Rate: r.cfg.Load.Rate, Requests: r.total}}
	}
	r.q = newQueue(r.cfg.Workload, r.total)
}

// Planned returns how many requests Run will send: the stages' requests,
// else Load.Requests, else every request of the workload once (a
// multi-turn workload's turns at most); -1 when Load.Duration alone ends
// the run of a single-turn workload.
func (c Config) Planned() int {
	l, w := c.Load, c.Workload
	var n int
	switch {
	case len(l.Stages) > 0:
		for _, s := range l.Stages {
			n += s.Requests
		}
	case l.Requests > 0:
		n = l.Requests
	case l.Duration > 0 && !w.MultiTurn():
		return -1
	default:
		n = w.Requests()
	}
	if w.MultiTurn() && n > w.Requests() {
		n = w.Requests()
	}
	return n
}

// expired reports whether Load.Duration has passed.
func (r *runner) expired() bool {
	d := r.cfg.Load.Duration
	return d > 0 && time.Since(r.start) >= time.Duration(float64(d)/r.scale)
}

// openLoop sends every stage's requests on its arrival schedule, one stage
// after the other without pausing (requests of a stage may still run in
// the next), and waits for all of them. With pod URLs it snapshots the
// engines' counters at each stage boundary.
func (r *runner) openLoop(ctx context.Context, hc *http.Client, before *EngineSnapshot) {
	var sem chan struct{}
	if m := r.cfg.Load.MaxConcurrency; m > 0 {
		sem = make(chan struct{}, m)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	snap := before
	for i, st := range r.stages {
		r.stage.Store(int32(i))
		r.stageFrom = append(r.stageFrom, time.Now())
		r.dispatch(ctx, i, st, sem, &wg)
		r.stageTo = append(r.stageTo, time.Now())
		if len(r.stages) > 1 && snap != nil {
			next, err := ScrapeEngines(ctx, hc, r.cfg.PodURLs)
			var es *EngineStats
			if err == nil {
				st := next.Since(snap)
				es, snap = &st, next
			}
			r.stageEngine = append(r.stageEngine, es)
		}
		if ctx.Err() != nil || r.expired() {
			return
		}
	}
}

// dispatch sends stage i's requests.
func (r *runner) dispatch(ctx context.Context, i int, st Stage, sem chan struct{}, wg *sync.WaitGroup) {
	g := newGaps(r.cfg.Seed+uint64(i), r.cfg.Load)
	next := time.Now()
	for n := 0; st.Requests < 0 || n < st.Requests; n++ {
		if r.expired() {
			return
		}
		it, ok := r.q.next(ctx)
		if !ok {
			return
		}
		if r.cfg.Load.Arrival == ArrivalTrace {
			if it.turn == 0 {
				next = r.start.Add(time.Duration(float64(it.s.At) / r.scale))
			} else {
				next = time.Now() // a later turn goes as soon as it is ready
			}
		} else if n > 0 {
			next = next.Add(time.Duration(g.next(st.Rate) / r.scale * float64(time.Second)))
		}
		if now := time.Now(); next.Before(now) && r.cfg.Load.Arrival != ArrivalTrace {
			next = now // the item was not ready in time; keep the gaps from here
		}
		if !sleepUntil(ctx, next) {
			r.q.finish(it, "", false)
			return
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if sem != nil {
				select {
				case sem <- struct{}{}:
					defer func() { <-sem }()
				case <-ctx.Done():
					r.q.finish(it, "", false)
					return
				}
			}
			r.send(ctx, it, i)
		}()
	}
}

// stageResults summarises each stage: latencies of the requests sent in it,
// throughputs over its window (requests completed and tokens generated
// while it lasted, whichever request they belong to), engine counters over
// the window.
func (r *runner) stageResults(all []RequestResult) []StageResult {
	var out []StageResult
	for i := range r.stageTo {
		var rs []RequestResult
		for _, q := range all {
			if q.Stage == i {
				rs = append(rs, q)
			}
		}
		if len(rs) == 0 {
			continue
		}
		st := r.stages[i]
		from := r.stageFrom[i].Sub(r.start).Seconds() * r.scale
		to := r.stageTo[i].Sub(r.start).Seconds() * r.scale
		if math.IsInf(float64(st.Rate), 1) {
			for _, q := range rs { // everything at once: until the last one ends
				to = max(to, q.Start+q.E2EL)
			}
		}
		sr := StageResult{Rate: st.Rate, Summary: Summarize(rs, r.cfg.SLO, to-from)}
		sr.Summary.RequestThroughput, sr.Summary.OutputThroughput, sr.Summary.InputThroughput = windowRates(all, from, to)
		if i < len(r.stageEngine) {
			sr.Engine = r.stageEngine[i]
		}
		out = append(out, sr)
	}
	return out
}

// windowRates returns, per second of [from, to) (modelled seconds since the
// start), the requests that completed, the output tokens that arrived
// (chunk times rebuilt from TTFT and the inter-token gaps) and the prompt
// tokens whose prefill finished (first token) in it.
func windowRates(rs []RequestResult, from, to float64) (reqs, out, in float64) {
	span := to - from
	if span <= 0 {
		return 0, 0, 0
	}
	inside := func(t float64) bool { return t >= from && t < to }
	for i := range rs {
		q := &rs[i]
		if q.Err != "" {
			continue
		}
		if inside(q.Start + q.E2EL) {
			reqs++
		}
		t := q.Start + q.TTFT
		if inside(t) {
			in += float64(q.PromptTokens)
		}
		perChunk := float64(q.OutputTokens) / float64(len(q.ITL)+1)
		if inside(t) {
			out += perChunk
		}
		for _, g := range q.ITL {
			t += float64(g)
			if t >= to {
				break
			}
			if t >= from {
				out += perChunk
			}
		}
	}
	return reqs / span, out / span, in / span
}

// closedLoop runs Concurrency workers until the queue is exhausted.
func (r *runner) closedLoop(ctx context.Context) {
	var wg sync.WaitGroup
	for range r.cfg.Load.Concurrency {
		wg.Go(func() {
			for ctx.Err() == nil && !r.expired() {
				it, ok := r.q.next(ctx)
				if !ok {
					return
				}
				r.send(ctx, it, 0)
			}
		})
	}
	wg.Wait()
}

// sleepUntil waits until t or ctx's end; it reports whether t came first.
func sleepUntil(ctx context.Context, t time.Time) bool {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err() == nil
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// send sends one item and records the result.
func (r *runner) send(ctx context.Context, it *item, stage int) {
	res := RequestResult{Session: it.session, Turn: it.turn, Stage: stage}
	model := r.cfg.Model
	if it.s.Model != "" {
		model = it.s.Model
	}
	body := workload.AppendBody(make([]byte, 0, 1024), r.cfg.API, model, it.s, it.turn, it.conv.answers)
	if t := r.cfg.ServiceTier; t != "" && len(body) > 1 {
		body = slices.Insert(body, 1, []byte(`"service_tier":`+strconv.Quote(t)+`,`)...) // after the object's brace
	}
	keep := it.turn+1 < len(it.s.Turns)
	res.Start = time.Since(r.start).Seconds() * r.scale
	r.sent.Add(1)
	answer := r.clientFor(it).do(ctx, body, keep, r.scale, &res)
	ok := res.Err == ""
	r.q.finish(it, answer, ok)
	r.mu.Lock()
	r.results = append(r.results, res)
	if ok {
		r.ttfts = append(r.ttfts, res.TTFT)
	}
	r.mu.Unlock()
	if ok {
		r.done.Add(1)
	} else {
		r.failed.Add(1)
	}
}

// clientFor returns the client it goes to: the only one, or with
// Config.Direct the pod of its group (else of its session).
func (r *runner) clientFor(it *item) *client {
	key := it.session
	if it.s.Group >= 0 {
		key = it.s.Group
	}
	return r.clients[key%len(r.clients)]
}

// progressStart starts the status line when Progress is set.
func (r *runner) progressStart() {
	if r.cfg.Progress == nil {
		return
	}
	r.progStop, r.progDone = make(chan struct{}), make(chan struct{})
	go func() {
		defer close(r.progDone)
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-r.progStop:
				r.printProgress()
				fmt.Fprintln(r.cfg.Progress)
				return
			case <-t.C:
				r.printProgress()
			}
		}
	}()
}

func (r *runner) progressStop() {
	if r.progStop != nil {
		close(r.progStop)
		<-r.progDone
	}
}

func (r *runner) printProgress() {
	elapsed := time.Since(r.start).Seconds()
	r.mu.Lock()
	ttfts := slices.Clone(r.ttfts)
	r.mu.Unlock()
	slices.Sort(ttfts)
	p90 := "-"
	if len(ttfts) > 0 {
		p90 = fmt.Sprintf("%.0f ms", Percentile(ttfts, 90)*1e3)
	}
	done := r.done.Load()
	rate := 0.0
	if elapsed > 0 {
		rate = float64(done) / (elapsed * r.scale)
	}
	stage := ""
	if len(r.stages) > 1 {
		i := int(r.stage.Load())
		stage = fmt.Sprintf(" stage %d/%d @%s/s", i+1, len(r.stages), r.stages[i].Rate)
	}
	fmt.Fprintf(r.cfg.Progress, "\r\033[K%s%s  %.1f req/s  sent %d  done %d  errors %d  p90 TTFT %s  %s",
		r.cfg.Label, stage, rate, r.sent.Load(), done, r.failed.Load(), p90,
		time.Duration(elapsed*float64(time.Second)).Round(time.Second))
}

// item is one request handed out by the queue.
type item struct {
	conv    *conv
	s       *workload.Session
	session int // index into Workload.Sessions
	turn    int
}

// conv is a session in progress: the answers it has received so far.
type conv struct {
	s       *workload.Session
	session int
	turn    int // next turn to send
	answers []string
}

// queue hands out requests: a conversation's next turn as soon as its
// previous answer arrived (continuations first), else the next fresh
// session. Safe for concurrent use.
type queue struct {
	w *workload.Workload

	mu      sync.Mutex
	total   int // requests to hand out; −1: unlimited
	handed  int
	fresh   int     // next session to start
	ready   []*conv // conversations whose next turn may go
	active  int     // multi-turn conversations that may still yield a turn
	changed chan struct{}
}

func newQueue(w *workload.Workload, total int) *queue {
	return &queue{w: w, total: total, changed: make(chan struct{})}
}

// next returns the next request, waiting while conversations in flight may
// still yield one; false when there is none left or ctx ended.
func (q *queue) next(ctx context.Context) (*item, bool) {
	for {
		q.mu.Lock()
		if q.total >= 0 && q.handed >= q.total {
			q.mu.Unlock()
			return nil, false
		}
		var c *conv
		switch {
		case len(q.ready) > 0:
			c = q.ready[0]
			q.ready = q.ready[1:]
		case q.fresh < len(q.w.Sessions) || !q.w.MultiTurn():
			i := q.fresh % len(q.w.Sessions)
			q.fresh++
			c = &conv{s: &q.w.Sessions[i], session: i}
			if len(c.s.Turns) > 1 {
				q.active++
			}
		case q.active == 0:
			q.mu.Unlock()
			return nil, false
		}
		if c != nil {
			q.handed++
			it := &item{conv: c, s: c.s, session: c.session, turn: c.turn}
			q.mu.Unlock()
			return it, true
		}
		wait := q.changed
		q.mu.Unlock()
		select {
		case <-wait:
		case <-ctx.Done():
			return nil, false
		}
	}
}

// finish reports that it ended; a successful turn with a successor makes
// the successor ready, carrying answer.
func (q *queue) finish(it *item, answer string, ok bool) {
	c := it.conv
	if len(c.s.Turns) <= 1 {
		return
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if ok && c.turn+1 < len(c.s.Turns) {
		c.answers = append(c.answers, answer)
		c.turn++
		q.ready = append(q.ready, c)
	} else {
		q.active--
	}
	close(q.changed)
	q.changed = make(chan struct{})
}
