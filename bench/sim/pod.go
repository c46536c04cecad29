package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
	"github.com/valyala/fasthttp"
	"github.com/valyala/fastjson"
	"github.com/zeebo/xxh3"
)

// Pod is one simulated vLLM server: an HTTP front end (fasthttp), one engine
// loop goroutine, a KV side-channel listener (vLLM's NIXL side channel and
// SGLang's bootstrap server in one), optionally a KV-cache event publisher
// (kvevents.go), and its own Prometheus registry.
// Create it with New, run it with Serve, stop it with Close. Methods are
// safe for concurrent use.
type Pod struct {
	cfg        Config
	engineID   string
	start      time.Time // wall; process_start_time_seconds
	eng        *engine
	m          *podMetrics
	faults     *faultState
	srv        *fasthttp.Server
	side       *fasthttp.Server
	sideLn     net.Listener
	sidePort   int
	pullTr     *http.Transport
	pullClient *http.Client
	kv         *kvPublisher // nil: KV events off
	parsers    fastjson.ParserPool
	ids        atomic.Uint64
	stalled    atomic.Int64 // requests held by a stall fault
	readyAt    atomic.Int64 // unix nanos after which /health is 200

	ctx    context.Context // cancelled by Close
	cancel context.CancelFunc
	done   <-chan struct{}
	wg     sync.WaitGroup

	mu      sync.Mutex // guards started, closed, lns
	started bool
	closed  bool
	lns     []net.Listener

	closeOnce sync.Once
	closeErr  error
}

// New validates cfg and builds a pod; it opens the KV side-channel listener
// and the KV event sockets but starts no goroutine until Serve.
func New(cfg Config) (*Pod, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	start := time.Now()
	ctx, cancel := context.WithCancel(context.Background())
	p := &Pod{cfg: cfg, start: start, ctx: ctx, cancel: cancel, done: ctx.Done()}
	p.engineID = cfg.EngineID
	if p.engineID == "" {
		p.engineID = uuidLike(cfg.Seed ^ uint64(start.UnixNano()))
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(cfg.SideChannelHost, strconv.Itoa(cfg.SideChannelPort)))
	if err != nil {
		cancel()
		return nil, fmt.Errorf("sim: KV side channel: %w", err)
	}
	p.sideLn = ln
	p.sidePort = ln.Addr().(*net.TCPAddr).Port
	p.eng = newEngine(&p.cfg, start, p.done)
	p.m = newPodMetrics(&p.cfg, p.eng, start)
	p.eng.m = p.m
	p.eng.startPull = p.startPull
	p.eng.startCPULoad = p.startCPULoad
	if cfg.KVEventsPort != 0 {
		if p.kv, err = newKVPublisher(&p.cfg, p.m.kvEventsDropped); err != nil {
			ln.Close()
			cancel()
			return nil, fmt.Errorf("sim: KV events: %w", err)
		}
		p.eng.kv = p.kv
	}
	p.faults = newFaultState(cfg.Faults, cfg.Seed)
	p.srv = &fasthttp.Server{
		Handler:               p.handle,
		Name:                  "kvsim",
		MaxRequestBodySize:    cfg.MaxBodyBytes,
		NoDefaultServerHeader: true,
		IdleTimeout:           2 * time.Minute,
		ReadBufferSize:        16 << 10,
		Logger:                quietLogger{},
	}
	p.side = &fasthttp.Server{Handler: p.handleSide, NoDefaultServerHeader: true, IdleTimeout: time.Minute, Logger: quietLogger{}}
	p.pullTr = &http.Transport{MaxIdleConnsPerHost: 16, IdleConnTimeout: time.Minute}
	p.pullClient = &http.Client{Transport: p.pullTr}
	return p, nil
}

// quietLogger drops fasthttp's per-connection error lines: cut streams are
// what the fault injection is for.
type quietLogger struct{}

func (quietLogger) Printf(string, ...any) {}

// uuidLike formats a seeded 128-bit value as a UUID string.
func uuidLike(seed uint64) string {
	a, b := splitmix(seed), splitmix(seed+1)
	s := fmt.Sprintf("%016x%016x", a, b)
	return s[0:8] + "-" + s[8:12] + "-4" + s[13:16] + "-a" + s[17:20] + "-" + s[20:32]
}

// Serve answers HTTP on ln until Close; the first call also starts the engine
// loop and the side channel. It returns ErrClosed after Close.
func (p *Pod) Serve(ln net.Listener) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		ln.Close()
		return ErrClosed
	}
	p.lns = append(p.lns, ln)
	if !p.started {
		p.started = true
		p.readyAt.Store(time.Now().Add(time.Duration(p.cfg.Faults.StartupDelay)).UnixNano())
		if p.kv != nil {
			p.kv.start(expandTopic(p.cfg.KVEventsTopic, ln.Addr().String(), p.cfg.Model))
		}
		p.wg.Add(2)
		go func() {
			defer p.wg.Done()
			p.eng.run()
		}()
		go func() {
			defer p.wg.Done()
			_ = p.side.Serve(p.sideLn)
		}()
	}
	p.mu.Unlock()
	err := p.srv.Serve(ln)
	if p.ctx.Err() != nil {
		return ErrClosed
	}
	return err
}

// Close stops the pod like a crash of the engine: open streams are cut,
// waiting requests fail, listeners close, and every goroutine the pod
// started has returned when Close returns. Idempotent.
func (p *Pod) Close() error {
	p.closeOnce.Do(func() {
		p.mu.Lock()
		p.closed = true
		lns := p.lns
		p.mu.Unlock()
		p.cancel()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		errs := []error{p.srv.ShutdownWithContext(ctx)}
		for _, ln := range lns {
			ln.Close() // usually closed by Shutdown already
		}
		errs = append(errs, p.side.ShutdownWithContext(ctx))
		p.sideLn.Close()
		p.wg.Wait()
		if p.kv != nil {
			p.kv.close() // after the engine, its only producer
		}
		p.pullTr.CloseIdleConnections()
		p.closeErr = errors.Join(errs...)
	})
	return p.closeErr
}

// Config returns the pod's configuration with defaults filled.
func (p *Pod) Config() Config { return p.cfg }

// EngineID returns the engine id the pod puts in kv_transfer_params.
func (p *Pod) EngineID() string { return p.engineID }

// StartTime returns the pod's start time (process_start_time_seconds).
func (p *Pod) StartTime() time.Time { return p.start }

// SideChannelAddr returns host:port of the KV side channel, which is also
// the SGLang bootstrap server (bootstrap_port is its port).
func (p *Pod) SideChannelAddr() string { return p.sideLn.Addr().String() }

// KVEventsAddr returns host:port of the KV event PUB socket, or "" when KV
// events are off (Config.KVEventsPort).
func (p *Pod) KVEventsAddr() string {
	if p.kv == nil {
		return ""
	}
	return p.kv.addr()
}

// KVEventsReplayAddr returns host:port of the KV event replay socket, or ""
// when it is off (Config.KVEventsReplayPort).
func (p *Pod) KVEventsReplayAddr() string {
	if p.kv == nil {
		return ""
	}
	return p.kv.replayAddr()
}

// ResetPrefixCache empties the prefix cache, GPU and CPU tier, as vLLM's
// POST /reset_prefix_cache does (also served here), and publishes
// AllBlocksCleared. Blocks in use lose their hashes too; their requests go
// on. It returns once the engine has done it, or with ctx's error, or
// ErrClosed when the pod closes first; the pod must be serving.
func (p *Pod) ResetPrefixCache(ctx context.Context) error {
	done := make(chan struct{})
	p.eng.post(event{kind: evReset, done: done})
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-p.done:
		return ErrClosed
	}
}

// startCPULoad starts the goroutine that posts evCPULoaded for s at the
// wall time ready, when its modelled copy from the CPU tier ends, or at
// once when its request is cancelled. Called by the engine goroutine.
func (p *Pod) startCPULoad(s *seq, ready time.Time) {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		at := ready
		t := time.NewTimer(time.Until(ready))
		defer t.Stop()
		select {
		case <-t.C:
		case <-s.req.ctx.Done():
			at = time.Now()
		case <-p.done:
			return
		}
		p.eng.post(event{kind: evCPULoaded, at: at, seq: s})
	}()
}

// Registry returns the pod's own Prometheus registry (served at /metrics).
func (p *Pod) Registry() *prometheus.Registry { return p.m.reg }

// Faults returns the current fault set.
func (p *Pod) Faults() Faults { return p.faults.get() }

// SetFaults replaces the fault set (StartupDelay excepted).
func (p *Pod) SetFaults(f Faults) error {
	if err := f.validate(); err != nil {
		return err
	}
	p.faults.set(f)
	return nil
}

// ReleaseStalls lets every request held by StallUntilRelease proceed.
func (p *Pod) ReleaseStalls() { p.faults.releaseStalls() }

// Stats is a snapshot of a pod's engine state, for tests and tools.
type Stats struct {
	Running      int           `json:"running"`     // sequences in the batch
	Waiting      int           `json:"waiting"`     // queued or loading KV
	UsedBlocks   int           `json:"used_blocks"` // referenced KV blocks
	HeldBlocks   int           `json:"held_blocks"` // of which held for remote decode
	NumGPUBlocks int           `json:"num_gpu_blocks"`
	Stalled      int           `json:"stalled"`    // requests held by a stall fault
	Steps        uint64        `json:"steps"`      // engine steps run
	ModelTime    time.Duration `json:"model_time"` // modelled clock at the last step end
}

// Stats returns a snapshot of the engine's published state.
func (p *Pod) Stats() Stats {
	e := p.eng
	return Stats{
		Running: int(e.nRunning.Load()), Waiting: int(e.nWaiting.Load()),
		UsedBlocks: int(e.nUsed.Load()), HeldBlocks: int(e.nHeld.Load()),
		NumGPUBlocks: p.cfg.NumGPUBlocks, Stalled: int(p.stalled.Load()), Steps: e.steps.Load(),
		ModelTime: time.Duration(e.modelClock.Load()),
	}
}

func (p *Pod) ready() bool { return time.Now().UnixNano() >= p.readyAt.Load() }

// handle routes the OpenAI-compatible API, the operational endpoints and the
// /sim admin API.
func (p *Pod) handle(ctx *fasthttp.RequestCtx) {
	method := func(m string) bool {
		if string(ctx.Method()) == m {
			return true
		}
		ctx.SetStatusCode(fasthttp.StatusMethodNotAllowed)
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"detail":"Method Not Allowed"}`)
		return false
	}
	switch string(ctx.Path()) {
	case "/v1/completions":
		if method(fasthttp.MethodPost) {
			p.infer(ctx, false)
		}
	case "/v1/chat/completions":
		if method(fasthttp.MethodPost) {
			p.infer(ctx, true)
		}
	case "/v1/models":
		if method(fasthttp.MethodGet) {
			p.models(ctx)
		}
	case "/health", "/ping":
		f := p.faults.get()
		if f.HealthFail || !p.ready() {
			ctx.SetStatusCode(fasthttp.StatusServiceUnavailable)
		}
	case "/version":
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"version":"0.19.1+kvsim"}`)
	case "/metrics":
		p.metrics(ctx)
	case "/tokenize":
		if method(fasthttp.MethodPost) {
			p.tokenize(ctx)
		}
	case "/reset_prefix_cache":
		if method(fasthttp.MethodPost) && p.ResetPrefixCache(ctx) != nil {
			writeError(ctx, &apiError{503, "ServiceUnavailableError", "The engine is shutting down."})
		}
	case "/sim/faults":
		p.adminFaults(ctx)
	case "/sim/release":
		if method(fasthttp.MethodPost) {
			p.ReleaseStalls()
		}
	case "/sim/stats":
		b, _ := json.Marshal(p.Stats())
		ctx.SetContentType("application/json")
		ctx.SetBody(b)
	default:
		ctx.SetStatusCode(fasthttp.StatusNotFound)
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"detail":"Not Found"}`)
	}
}

func writeError(ctx *fasthttp.RequestCtx, e *apiError) {
	ctx.SetStatusCode(e.status)
	ctx.SetContentType("application/json")
	ctx.SetBody(appendErrorBody(nil, e))
}

// errorType names an injected status as vLLM/OpenAI error types do.
func errorType(status int) string {
	switch status {
	case 400:
		return "BadRequestError"
	case 404:
		return "NotFoundError"
	case 429:
		return "RateLimitError"
	case 503:
		return "ServiceUnavailableError"
	}
	if status >= 500 {
		return "InternalServerError"
	}
	return "Error"
}

// infer serves /v1/completions and /v1/chat/completions.
func (p *Pod) infer(ctx *fasthttp.RequestCtx, chat bool) {
	if !p.ready() {
		writeError(ctx, &apiError{503, "ServiceUnavailableError", "The engine is not ready yet."})
		return
	}
	parser := p.parsers.Get()
	ar, aerr := parseRequest(parser, ctx.PostBody(), chat, uint32(p.cfg.VocabSize))
	p.parsers.Put(parser)
	var rooms []*room
	if aerr == nil && ar.boot != nil && p.cfg.Role == RolePrefill {
		// Open the rooms first: the decode pod's pull may come at any time,
		// and it learns at once if this request fails.
		rooms, aerr = p.openRooms(ar.boot.rooms)
	}
	if aerr == nil && ar.model != "" && ar.model != p.cfg.Model && !slices.Contains(p.cfg.LoRAs, ar.model) {
		aerr = &apiError{404, "NotFoundError", fmt.Sprintf("The model `%s` does not exist.", ar.model)}
	}
	var maxTokens []int
	if aerr == nil {
		maxTokens, aerr = p.limits(ar, chat)
	}
	if aerr == nil {
		aerr = p.injectFaults()
	}
	if aerr != nil {
		p.eng.failRooms(rooms)
		writeError(ctx, aerr)
		return
	}
	r := p.newInferRequest(ctx, ar, chat, maxTokens, rooms)
	p.eng.post(event{kind: evRequest, req: r})

	if r.stream {
		ctx.SetContentType("text/event-stream; charset=utf-8")
		ctx.Response.Header.Set("Cache-Control", "no-cache")
		ctx.Response.SetBodyStream(newSSEStream(p, r, p.faults.get().DropAfterTokens), -1)
		return
	}
	for {
		r.mu.Lock()
		done := r.doneSeqs == len(r.seqs)
		r.mu.Unlock()
		if done {
			break
		}
		select {
		case <-r.wake:
		case <-p.done:
			writeError(ctx, &apiError{503, "ServiceUnavailableError", "The engine is shutting down."})
			return
		}
	}
	pubs := make([]seqPub, len(r.seqs))
	r.mu.Lock()
	for i, s := range r.seqs {
		pubs[i] = s.pub
	}
	kv := r.kv
	r.mu.Unlock()
	ctx.SetContentType("application/json")
	ctx.SetBody(appendFull(make([]byte, 0, 512), r, pubs, kv, p))
}

// injectFaults applies the fault set to an inference request: an injected
// error, or a stall before it reaches the engine.
func (p *Pod) injectFaults() *apiError {
	status, stall, until := p.faults.draw()
	if status != 0 {
		return &apiError{status, errorType(status), "Simulated failure (fault injection)."}
	}
	if stall == 0 && until == nil {
		return nil
	}
	var timeout <-chan time.Time
	if stall > 0 {
		t := time.NewTimer(stall)
		defer t.Stop()
		timeout = t.C
	}
	p.stalled.Add(1)
	defer p.stalled.Add(-1)
	select {
	case <-timeout:
	case <-until:
	case <-p.done:
		return &apiError{503, "ServiceUnavailableError", "The engine is shutting down."}
	}
	return nil
}

// newInferRequest builds the engine request of a parsed inference body and
// sets its X-Request-Id: one sequence per prompt and choice, each with the
// KV reference it pulls from (decode role) or, for a bootstrap prefill, the
// room of its prompt (rooms) and exactly one token to generate.
func (p *Pod) newInferRequest(ctx *fasthttp.RequestCtx, ar *apiRequest, chat bool, maxTokens []int, rooms []*room) *request {
	base := string(ctx.Request.Header.Peek("X-Request-Id"))
	if base == "" {
		n := p.ids.Add(1)
		base = fmt.Sprintf("%016x%016x", splitmix(p.cfg.Seed), splitmix(p.cfg.Seed^n)+n)
	}
	ctx.Response.Header.Set("X-Request-Id", base)
	r := newRequest()
	r.chat, r.stream, r.includeUsage, r.noCached = chat, ar.stream, ar.includeUsage, p.cfg.NoCachedTokens
	r.model, r.created = p.cfg.Model, time.Now().Unix()
	r.id = "cmpl-" + base
	if chat {
		r.id = "chatcmpl-" + base
	}
	seed := splitmix(p.cfg.Seed ^ xxh3.HashString(r.id))
	root, lora := rootHash(ar.salt), ""
	if ar.model != "" && ar.model != p.cfg.Model { // a LoRA adapter: its own cache entries
		root, lora = rootHash(ar.salt+"\x00lora\x00"+ar.model), ar.model
	}
	refs := p.remoteRefs(ar)
	for i, prompt := range ar.prompts {
		for j := range ar.n {
			idx := i*ar.n + j
			s := &seq{
				req: r, index: idx, prompt: prompt, maxTokens: maxTokens[i], ignoreEOS: ar.ignoreEOS,
				seed: splitmix(seed + uint64(idx)), root: root, lora: lora, remote: refs[i],
			}
			if rooms != nil {
				// An SGLang prefill server ends the request after the
				// first token (n is 1: one sequence per prompt).
				s.room, s.maxTokens, s.ignoreEOS = rooms[i], 1, true
			}
			r.seqs = append(r.seqs, s)
		}
	}
	r.holdKV = ar.remoteDecode && p.cfg.Role.servesPrefill() && !ar.stream && len(r.seqs) == 1
	return r
}

// remoteRefs returns, per prompt, where a decode pod pulls its KV from
// (nil: compute the prefill here). A mixed pod ignores bootstrap fields:
// the same body goes to both SGLang legs, so only a role tells them apart.
func (p *Pod) remoteRefs(ar *apiRequest) []*kvRef {
	refs := make([]*kvRef, len(ar.prompts))
	switch {
	case ar.boot != nil && p.cfg.Role == RoleDecode:
		for i := range refs {
			refs[i] = ar.boot.ref(i)
		}
	case ar.remotePrefill && p.cfg.Role.servesDecode():
		if ar.ref == nil {
			p.m.kvFailed.Inc() // malformed reference: compute the prefill here
		}
		for i := range refs {
			refs[i] = ar.ref
		}
	}
	return refs
}

// limits resolves max_tokens per prompt and rejects what can never run:
// prompt+max_tokens beyond MaxModelLen or beyond the KV capacity.
func (p *Pod) limits(ar *apiRequest, chat bool) ([]int, *apiError) {
	out := make([]int, len(ar.prompts))
	def := p.cfg.DefaultMaxTokens
	if chat {
		def = p.cfg.DefaultChatMaxTokens
	}
	for i, pr := range ar.prompts {
		n := ar.maxTokens
		if n == 0 {
			n = min(def, p.cfg.MaxModelLen-len(pr))
		}
		if n < 1 || len(pr)+n > p.cfg.MaxModelLen {
			return nil, badRequest("This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the messages, %d in the completion). Please reduce the length of the messages or completion.",
				p.cfg.MaxModelLen, len(pr)+max(n, 0), len(pr), max(n, 0))
		}
		if need := p.eng.blocksFor(len(pr) + n); need > p.cfg.NumGPUBlocks {
			return nil, badRequest("The request needs %d KV cache blocks of %d tokens (%d prompt + %d completion tokens) but the cache holds %d blocks.",
				need, p.cfg.BlockSize, len(pr), n, p.cfg.NumGPUBlocks)
		}
		out[i] = n
	}
	return out, nil
}

func (p *Pod) models(ctx *fasthttp.RequestCtx) {
	created := strconv.FormatInt(p.start.Unix(), 10)
	b := append(make([]byte, 0, 512), `{"object":"list","data":[{"id":`...)
	b = appendJSONString(b, p.cfg.Model)
	b = append(b, `,"object":"model","created":`+created+`,"owned_by":"vllm","root":`...)
	b = appendJSONString(b, p.cfg.Model)
	b = append(b, `,"parent":null,"max_model_len":`...)
	b = strconv.AppendInt(b, int64(p.cfg.MaxModelLen), 10)
	b = append(b, `,"permission":[{"id":"modelperm-`...)
	b = append(b, p.engineID...)
	b = append(b, `","object":"model_permission","created":`+created+`,"allow_create_engine":false,"allow_sampling":true,"allow_logprobs":true,"allow_search_indices":false,"allow_view":true,"allow_fine_tuning":false,"organization":"*","group":null,"is_blocking":false}]}`...)
	for _, l := range p.cfg.LoRAs { // as vLLM lists --lora-modules
		b = append(b, `,{"id":`...)
		b = appendJSONString(b, l)
		b = append(b, `,"object":"model","created":`+created+`,"owned_by":"vllm","root":`...)
		b = appendJSONString(b, "/adapters/"+l)
		b = append(b, `,"parent":`...)
		b = appendJSONString(b, p.cfg.Model)
		b = append(b, `,"max_model_len":null,"permission":[]}`...)
	}
	b = append(b, `]}`...)
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
}

// tokenize serves vLLM's POST /tokenize for {"prompt": "..."} or
// {"messages": [...]} bodies.
func (p *Pod) tokenize(ctx *fasthttp.RequestCtx) {
	parser := p.parsers.Get()
	defer p.parsers.Put(parser)
	v, err := parser.ParseBytes(ctx.PostBody())
	if err != nil || v.Type() != fastjson.TypeObject {
		writeError(ctx, badRequest("Invalid JSON body"))
		return
	}
	var text []byte
	switch {
	case v.Get("messages") != nil:
		var aerr *apiError
		if text, aerr = renderChat(v); aerr != nil {
			writeError(ctx, aerr)
			return
		}
	case v.Get("prompt") != nil && v.Get("prompt").Type() == fastjson.TypeString:
		text = v.GetStringBytes("prompt")
	default:
		writeError(ctx, badRequest("prompt (a string) or messages is required"))
		return
	}
	toks := appendTokens(nil, string(text), uint32(p.cfg.VocabSize))
	b := append(make([]byte, 0, 64+len(toks)*7), `{"count":`...)
	b = strconv.AppendInt(b, int64(len(toks)), 10)
	b = append(b, `,"max_model_len":`...)
	b = strconv.AppendInt(b, int64(p.cfg.MaxModelLen), 10)
	b = append(b, `,"tokens":[`...)
	for i, t := range toks {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, uint64(t), 10)
	}
	b = append(b, `],"token_strs":null}`...)
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
}

func (p *Pod) metrics(ctx *fasthttp.RequestCtx) {
	mfs, err := p.m.reg.Gather()
	if err != nil {
		ctx.Error(err.Error(), fasthttp.StatusInternalServerError)
		return
	}
	ctx.SetContentType(string(expfmt.FmtText))
	for _, mf := range mfs {
		if _, err := expfmt.MetricFamilyToText(ctx, mf); err != nil {
			ctx.Error(err.Error(), fasthttp.StatusInternalServerError)
			return
		}
	}
}

// adminFaults serves GET (current faults) and POST (replace) /sim/faults.
func (p *Pod) adminFaults(ctx *fasthttp.RequestCtx) {
	if ctx.IsPost() {
		var f Faults
		if err := json.Unmarshal(ctx.PostBody(), &f); err != nil {
			writeError(ctx, badRequest("bad faults: %v", err))
			return
		}
		if err := p.SetFaults(f); err != nil {
			writeError(ctx, badRequest("%v", err))
			return
		}
	}
	b, _ := json.Marshal(p.Faults())
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
}
