package discovery

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"go.uber.org/zap"
)

// Sentinel errors of scraping and probing.
var (
	// ErrStatus: the endpoint answered a probe or scrape with a status
	// other than 200.
	ErrStatus = errors.New("discovery: unexpected status")
	// ErrNoEngineMetrics: a /metrics text holds none of the vLLM, SGLang
	// or llama.cpp load metrics kvroute reads.
	ErrNoEngineMetrics = errors.New("discovery: no engine metrics")
	// ErrTooLarge: a /metrics response exceeds ScrapeConfig.MaxBytes.
	ErrTooLarge = errors.New("discovery: metrics response too large")
	// ErrBadMetrics: a /metrics text kvroute reads does not parse.
	ErrBadMetrics = errors.New("discovery: bad metrics text")
)

// ScrapeConfig configures scraping the engines' own /metrics. A zero field
// takes its default.
type ScrapeConfig struct {
	// Disabled turns scraping off (Engine then always returns nil).
	Disabled bool
	// Interval between scrape rounds. Default 1 s: the engines' queues
	// change within seconds and routing needs fresh values; scraping 100
	// vLLM pods (56 KB each) at 1 s costs ≈ 0.03 CPU-seconds per second
	// (TestScrapeCPU100Pods).
	Interval time.Duration
	// Timeout of one scrape. Default 1 s.
	Timeout time.Duration
	// StaleAfter is the age after which scraped values are no longer
	// returned by Engine; it must exceed Interval. Default (0) 3 × Interval:
	// two scrapes in a row may fail before routing stops using the values.
	StaleAfter time.Duration
	// Jitter spreads rounds by ± this fraction of Interval. Default 0.1.
	Jitter float64
	// Path is the metrics path. Default "/metrics".
	Path string
	// MaxBytes caps one response. Default 8 MiB (a vLLM scrape is ~50 KB;
	// many LoRA adapters multiply its series).
	MaxBytes int
	// Workers is the number of scrapes in flight at once. Default 8.
	Workers int
}

// Defaults of ScrapeConfig.
const (
	DefaultScrapeInterval = time.Second
	DefaultScrapeTimeout  = time.Second
	DefaultScrapeJitter   = 0.1
	DefaultScrapePath     = "/metrics"
	DefaultScrapeMaxBytes = 8 << 20
	DefaultScrapeWorkers  = 8
)

func (c ScrapeConfig) withDefaults() ScrapeConfig {
	c.Interval = orDefault(c.Interval, DefaultScrapeInterval)
	c.Timeout = orDefault(c.Timeout, DefaultScrapeTimeout)
	c.StaleAfter = orDefault(c.StaleAfter, 3*c.Interval)
	c.Jitter = orDefault(c.Jitter, DefaultScrapeJitter)
	c.Path = orDefault(c.Path, DefaultScrapePath)
	c.MaxBytes = orDefault(c.MaxBytes, DefaultScrapeMaxBytes)
	c.Workers = orDefault(c.Workers, DefaultScrapeWorkers)
	return c
}

func (c ScrapeConfig) validate() error {
	switch {
	case c.Interval < 0 || c.Timeout < 0 || c.StaleAfter < 0:
		return fmt.Errorf("%w: scrape interval, timeout and staleness must be positive", ErrBadConfig)
	case c.StaleAfter <= c.Interval && !c.Disabled:
		return fmt.Errorf("%w: scrape staleness (%v) must exceed the interval (%v)", ErrBadConfig, c.StaleAfter, c.Interval)
	case c.Jitter < 0 || c.Jitter >= 1:
		return fmt.Errorf("%w: scrape jitter must be in [0, 1)", ErrBadConfig)
	case c.MaxBytes < 1 || c.Workers < 1:
		return fmt.Errorf("%w: scrape max bytes and workers must be at least 1", ErrBadConfig)
	case c.Path == "" || c.Path[0] != '/':
		return fmt.Errorf("%w: scrape path %q must start with /", ErrBadConfig, c.Path)
	}
	return nil
}

// EngineStats is one scrape of an engine's /metrics, summed over its series
// (several engines or data-parallel ranks, several models). It is immutable
// once published.
type EngineStats struct {
	// Engine is "vllm", "sglang" or "llamacpp".
	Engine string `json:"engine"`
	// Waiting is the requests queued in the engine, not yet scheduled
	// (vllm:num_requests_waiting, sglang:num_queue_reqs,
	// llamacpp:requests_deferred).
	Waiting int64 `json:"waiting"`
	// Running is the requests in the engine's running batch
	// (vllm:num_requests_running, sglang:num_running_reqs,
	// llamacpp:requests_processing).
	Running int64 `json:"running"`
	// KVUsage is the KV-cache fill in [0, 1], the mean over the engine's
	// series (vllm:kv_cache_usage_perc, before v0.10 vllm:gpu_cache_usage_perc;
	// sglang:token_usage); 0 when not reported (llama.cpp).
	KVUsage float64 `json:"kv_usage"`
	// KVCapacityTokens is the KV cache's size in tokens, Σ block_size ×
	// num_gpu_blocks of vllm:cache_config_info; 0 when unknown (SGLang).
	KVCapacityTokens int64 `json:"kv_capacity_tokens"`
	// PromptTokens is the cumulative prompt tokens processed
	// (vllm:prompt_tokens_total, sglang:prompt_tokens_total,
	// llamacpp:prompt_tokens_total).
	PromptTokens float64 `json:"prompt_tokens_total"`
	// PrefixQueries and PrefixHits are cumulative prefix-cache token
	// counters (vllm:prefix_cache_queries_total and _hits_total; for SGLang
	// sglang:prompt_tokens_total and sglang:cached_tokens_total); the hit
	// rate is ΔHits/ΔQueries.
	PrefixQueries float64 `json:"prefix_queries_total"`
	PrefixHits    float64 `json:"prefix_hits_total"`
	// ITLSum and ITLCount are the engine's cumulative inter-token latency
	// histogram (seconds, tokens): vllm:inter_token_latency_seconds, or
	// vllm:time_per_output_token_seconds before it; SGLang's likewise;
	// llama.cpp's llamacpp:tokens_predicted_seconds_total and
	// llamacpp:tokens_predicted_total. 0 when not exported.
	ITLSum   float64 `json:"inter_token_latency_seconds_sum,omitempty"`
	ITLCount float64 `json:"inter_token_latency_seconds_count,omitempty"`
	// StartTime is process_start_time_seconds (Unix seconds); 0 when absent.
	StartTime float64 `json:"process_start_time_seconds,omitempty"`
	// LoRA is vLLM's LoRA adapter slots (vllm:lora_requests_info); nil when
	// the engine does not serve adapters.
	LoRA *LoRAStats `json:"lora,omitempty"`
	// At is when the scrape completed.
	At time.Time `json:"scraped_at"`
	// Routed is how many of this router's requests the engine may have
	// counted: those in flight at the endpoint when the scrape began
	// (Endpoint.InFlight) and those sent to it before the scrape
	// completed. The engine's running and waiting requests beyond it are
	// other clients' (other router replicas, clients bypassing kvroute),
	// which the router's own counters cannot see. (Taken when the scrape
	// completed, a request that ended during the scrape counted as
	// another client's: a router alone sending one request at a time
	// learned it shared the fleet and moved its homes.) 0 when the stats
	// did not come from the scraper.
	Routed int64 `json:"routed"`
	// Peers is the other router replicas' requests in flight at the
	// endpoint during the scrape, as their gossip told (the most at its
	// start or end; 0 without gossip): the engine counts them, and the
	// router counts them apart (Endpoint.PeerInFlight), fresher.
	Peers int64 `json:"peers,omitempty"`
}

// LoRAStats is an engine's LoRA adapter slots, from the latest series of
// vllm:lora_requests_info (its value is the time it was set; vLLM keeps
// the earlier label sets as stale series): at most MaxLoRAs adapters run
// in one batch (vLLM's --max-loras), and a request for another adapter
// waits, even with room in the batch, until one of them has no running
// request left.
type LoRAStats struct {
	MaxLoRAs int `json:"max_lora"`
	// Running and Waiting name the adapters of the running and the
	// waiting requests.
	Running []string `json:"running_lora_adapters"`
	Waiting []string `json:"waiting_lora_adapters,omitempty"`
}

// Foreign returns the engine's running and waiting requests beyond this
// router's own at the scrape (Routed) and its gossiping peers' (Peers):
// other clients' (router replicas that do not gossip with this one,
// clients bypassing kvroute).
func (s *EngineStats) Foreign() int64 { return max(0, s.Running+s.Waiting-s.Routed-s.Peers) }

// Age returns how old s is at now.
func (s *EngineStats) Age(now time.Time) time.Duration { return now.Sub(s.At) }

// scrapeMemory is what the scraper remembers of an endpoint between
// scrapes; only the worker holding Endpoint.scraping touches it.
type scrapeMemory struct {
	seen     bool
	start    float64
	prompt   float64
	queries  float64
	capacity int64
	failing  int // scrapes failed in a row
}

// The metric names kvroute reads; every other line of a scrape is skipped
// before parsing.
const (
	mVLLMRunning     = "vllm:num_requests_running"
	mVLLMWaiting     = "vllm:num_requests_waiting"
	mVLLMKVUsage     = "vllm:kv_cache_usage_perc"
	mVLLMGPUKVUsage  = "vllm:gpu_cache_usage_perc"
	mVLLMCacheConfig = "vllm:cache_config_info"
	mVLLMPrompt      = "vllm:prompt_tokens_total"
	mVLLMQueries     = "vllm:prefix_cache_queries_total"
	mVLLMHits        = "vllm:prefix_cache_hits_total"
	mSGLRunning      = "sglang:num_running_reqs"
	mSGLWaiting      = "sglang:num_queue_reqs"
	mSGLUsage        = "sglang:token_usage"
	mSGLPrompt       = "sglang:prompt_tokens_total"
	mSGLCached       = "sglang:cached_tokens_total"
	mStartTime       = "process_start_time_seconds"
	mLCPRunning      = "llamacpp:requests_processing"
	mLCPWaiting      = "llamacpp:requests_deferred"
	mLCPPrompt       = "llamacpp:prompt_tokens_total"
	mLCPDecodeSec    = "llamacpp:tokens_predicted_seconds_total"
	mLCPDecoded      = "llamacpp:tokens_predicted_total"
	mVLLMLoRA        = "vllm:lora_requests_info"
	// Inter-token latency histograms, newest name first; their _sum and
	// _count samples are read.
	mVLLMITL    = "vllm:inter_token_latency_seconds"
	mVLLMTPOT   = "vllm:time_per_output_token_seconds"
	mSGLITL     = "sglang:inter_token_latency_seconds"
	mSGLTPOT    = "sglang:time_per_output_token_seconds"
	sumSuffix   = "_sum"
	countSuffix = "_count"
)

// itlNames are the inter-token latency histograms of each engine, in order
// of preference.
var itlNames = map[string][]string{"vllm": {mVLLMITL, mVLLMTPOT}, "sglang": {mSGLITL, mSGLTPOT}}

// wanted reports whether a sample line's metric name is one kvroute reads.
func wanted(name []byte) bool {
	switch string(name) {
	case mVLLMRunning, mVLLMWaiting, mVLLMKVUsage, mVLLMGPUKVUsage, mVLLMCacheConfig,
		mVLLMPrompt, mVLLMQueries, mVLLMHits, mVLLMLoRA,
		mSGLRunning, mSGLWaiting, mSGLUsage, mSGLPrompt, mSGLCached, mStartTime,
		mLCPRunning, mLCPWaiting, mLCPPrompt, mLCPDecodeSec, mLCPDecoded,
		mVLLMITL + sumSuffix, mVLLMITL + countSuffix, mVLLMTPOT + sumSuffix, mVLLMTPOT + countSuffix,
		mSGLITL + sumSuffix, mSGLITL + countSuffix, mSGLTPOT + sumSuffix, mSGLTPOT + countSuffix:
		return true
	}
	return false
}

// filterMetrics appends to dst the sample lines of text whose metric name
// is wanted, dropping comments (HELP, TYPE) and every other family. A
// full vLLM scrape (~580 lines, 56 KB) shrinks to about ten lines, so the
// expfmt parse that follows costs little.
func filterMetrics(dst, text []byte) []byte {
	for len(text) > 0 {
		var line []byte
		if i := bytes.IndexByte(text, '\n'); i >= 0 {
			line, text = text[:i+1], text[i+1:]
		} else {
			line, text = text, nil
		}
		n := 0
		for n < len(line) && line[n] != '{' && line[n] != ' ' && line[n] != '\t' && line[n] != '\n' {
			n++
		}
		if n == 0 || line[0] == '#' || !wanted(line[:n]) {
			continue
		}
		dst = append(dst, line...)
		if dst[len(dst)-1] != '\n' {
			dst = append(dst, '\n')
		}
	}
	return dst
}

// parseEngine reads an engine's load from a /metrics text in the
// Prometheus text format. scratch is reused between calls (one per
// goroutine) and returned grown.
func parseEngine(text, scratch []byte) (EngineStats, []byte, error) {
	scratch = filterMetrics(scratch[:0], text)
	var s EngineStats
	if len(scratch) == 0 {
		return s, scratch, ErrNoEngineMetrics
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(scratch))
	if err != nil {
		return s, scratch, fmt.Errorf("%w: %v", ErrBadMetrics, err)
	}
	sum := func(name string) (float64, int) {
		f := fams[name]
		if f == nil {
			return 0, 0
		}
		var t float64
		var n int
		for _, m := range f.GetMetric() {
			if v := value(m); !math.IsNaN(v) && !math.IsInf(v, 0) {
				t += v
				n++
			}
		}
		return t, n
	}
	mean := func(name string) (float64, bool) {
		t, n := sum(name)
		if n == 0 {
			return 0, false
		}
		return t / float64(n), true
	}
	count := func(name string) int64 {
		t, _ := sum(name)
		return int64(math.Round(min(max(t, 0), math.MaxInt32))) // no overflow, whatever the input
	}
	_, nv := sum(mVLLMRunning)
	_, nw := sum(mVLLMWaiting)
	_, nu := sum(mVLLMKVUsage)
	_, ng := sum(mVLLMGPUKVUsage)
	_, ns := sum(mSGLRunning)
	_, nq := sum(mSGLWaiting)
	_, nt := sum(mSGLUsage)
	_, nl := sum(mLCPRunning)
	_, nd := sum(mLCPWaiting)
	switch {
	case nv+nw+nu+ng > 0 || fams[mVLLMCacheConfig] != nil:
		s.Engine = "vllm"
		s.Running, s.Waiting = count(mVLLMRunning), count(mVLLMWaiting)
		if u, ok := mean(mVLLMKVUsage); ok {
			s.KVUsage = u
		} else {
			s.KVUsage, _ = mean(mVLLMGPUKVUsage)
		}
		s.PromptTokens, _ = sum(mVLLMPrompt)
		s.PrefixQueries, _ = sum(mVLLMQueries)
		s.PrefixHits, _ = sum(mVLLMHits)
		s.KVCapacityTokens = cacheCapacity(fams[mVLLMCacheConfig])
		s.LoRA = loraSlots(fams[mVLLMLoRA])
	case ns+nq+nt > 0:
		s.Engine = "sglang"
		s.Running, s.Waiting = count(mSGLRunning), count(mSGLWaiting)
		s.KVUsage, _ = mean(mSGLUsage)
		s.PromptTokens, _ = sum(mSGLPrompt)
		s.PrefixQueries = s.PromptTokens
		s.PrefixHits, _ = sum(mSGLCached)
	case nl+nd > 0:
		// llama-server: no KV usage, no cache counters; its decode time
		// over its decoded tokens is the inter-token latency.
		s.Engine = "llamacpp"
		s.Running, s.Waiting = count(mLCPRunning), count(mLCPWaiting)
		s.PromptTokens, _ = sum(mLCPPrompt)
		if c, n := sum(mLCPDecoded); n > 0 {
			s.ITLSum, _ = sum(mLCPDecodeSec)
			s.ITLCount = c
		}
	default:
		return s, scratch, ErrNoEngineMetrics
	}
	s.KVUsage = min(max(s.KVUsage, 0), 1)
	for _, name := range itlNames[s.Engine] {
		if c, n := sum(name + countSuffix); n > 0 {
			s.ITLSum, _ = sum(name + sumSuffix)
			s.ITLCount = c
			break
		}
	}
	if st, n := sum(mStartTime); n > 0 {
		s.StartTime = st / float64(n)
	}
	return s, scratch, nil
}

// value returns a sample's value whatever its declared type.
func value(m *dto.Metric) float64 {
	switch {
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Untyped != nil:
		return m.Untyped.GetValue()
	}
	return math.NaN()
}

// cacheCapacity sums block_size × num_gpu_blocks over the series of
// vllm:cache_config_info (one per engine); series without both numbers
// (e.g. "None" before the KV cache is profiled) count nothing.
func cacheCapacity(f *dto.MetricFamily) int64 {
	var total int64
	for _, m := range f.GetMetric() {
		var bs, nb int64
		for _, l := range m.GetLabel() {
			switch l.GetName() {
			case "block_size":
				bs, _ = strconv.ParseInt(l.GetValue(), 10, 64)
			case "num_gpu_blocks":
				nb, _ = strconv.ParseInt(l.GetValue(), 10, 64)
			}
		}
		if bs > 0 && nb > 0 && bs < 1<<20 && nb < 1<<40 {
			total = min(total+bs*nb, 1<<60) // no overflow, whatever the input
		}
	}
	return total
}

// maxAdapters bounds the adapters read from one label (a pod may load
// hundreds; more than this many running at once is beyond any engine).
const maxAdapters = 1024

// loraSlots reads the latest series of vllm:lora_requests_info (the
// highest value: the time it was set); nil without one with max_lora > 0.
func loraSlots(f *dto.MetricFamily) *LoRAStats {
	var latest *dto.Metric
	for _, m := range f.GetMetric() {
		if v := value(m); !math.IsNaN(v) && (latest == nil || v > value(latest)) {
			latest = m
		}
	}
	if latest == nil {
		return nil
	}
	l := &LoRAStats{}
	names := func(v string) []string {
		var out []string
		for _, n := range strings.Split(v, ",") {
			if n = strings.TrimSpace(n); n != "" && len(out) < maxAdapters {
				out = append(out, n)
			}
		}
		return out
	}
	for _, lp := range latest.GetLabel() {
		switch lp.GetName() {
		case "max_lora":
			n, _ := strconv.Atoi(lp.GetValue())
			l.MaxLoRAs = min(max(n, 0), maxAdapters)
		case "running_lora_adapters":
			l.Running = names(lp.GetValue())
		case "waiting_lora_adapters":
			l.Waiting = names(lp.GetValue())
		}
	}
	if l.MaxLoRAs == 0 {
		return nil
	}
	return l
}

// scraperLoop is the engine-metrics loop.
func (f *Fleet) scraperLoop() loopConfig {
	c := f.o.Scrape
	return loopConfig{
		interval: c.Interval, jitter: c.Jitter, workers: c.Workers, now: f.ramp,
		busy: func(e *Endpoint) *atomic.Bool { return &e.scraping },
		newWorker: func() func(context.Context, *Endpoint) {
			w := &scrapeWorker{f: f}
			return w.scrape
		},
		sweep: func(now time.Time, set *Set) {
			for _, e := range set.Endpoints {
				f.expire(e, now)
			}
		},
	}
}

// expire withdraws e's engine stats once they are older than StaleAfter.
func (f *Fleet) expire(e *Endpoint, now time.Time) {
	if s := e.fresh.Load(); s != nil && now.Sub(s.At) > f.o.Scrape.StaleAfter {
		e.fresh.CompareAndSwap(s, nil)
	}
}

// scrapeWorker is one scraping goroutine's reusable buffers.
type scrapeWorker struct {
	f        *Fleet
	body     bytes.Buffer
	filtered []byte
}

// scrape fetches and parses e's /metrics and publishes the result. An
// engine without /metrics (Ollama; llama-server without --metrics) is not
// scraped, and its 404, 405 or 501 is no failure: the router's own
// in-flight counts stand alone (metricsAbsent).
func (w *scrapeWorker) scrape(ctx context.Context, e *Endpoint) {
	f := w.f
	start := time.Now()
	if e.Dialect() == DialectOllama || start.UnixNano() < e.noMetricsUntil.Load() {
		return
	}
	routed, sent, peers := e.InFlight(), e.Requests(), e.PeerInFlight()
	status, err := w.fetch(ctx, e.URL+f.o.Scrape.Path)
	if status == http.StatusNotFound || status == http.StatusMethodNotAllowed || status == http.StatusNotImplemented {
		f.metricsAbsent(e, status)
		return
	}
	var s EngineStats
	if err == nil {
		s, w.filtered, err = parseEngine(w.body.Bytes(), w.filtered)
	}
	now := time.Now()
	r := roleIndex(e.Role)
	f.m.scrapeDuration[r].Observe(now.Sub(start).Seconds())
	if w.body.Cap() > 1<<20 { // do not pin a huge buffer per worker
		w.body = bytes.Buffer{}
	}
	mem := &e.scr
	if err != nil {
		if ctx.Err() != nil {
			return
		}
		f.m.scrapeFailures[r].Inc()
		e.metricsFailing.Store(true)
		if mem.failing == 0 {
			f.log.Warn("engine metrics scrape failing", zap.String("endpoint", e.URL), zap.Error(err))
		}
		mem.failing++
		f.expire(e, now)
		f.event("scrape-fail", e)
		return
	}
	e.metricsFailing.Store(false)
	if mem.failing > 0 {
		f.log.Info("engine metrics scrape recovered", zap.String("endpoint", e.URL), zap.Int("failed_scrapes", mem.failing))
		mem.failing = 0
	}
	if e.noMetricsUntil.Load() != 0 {
		e.noMetricsUntil.Store(0) // metrics turned on: say so again if they go
	}
	f.learnDialect(e, s.Engine)
	s.At, s.Routed, s.Peers = now, routed+int64(e.Requests()-sent), max(peers, e.PeerInFlight())
	restarted := mem.seen && (s.StartTime != 0 && mem.start != 0 && math.Abs(s.StartTime-mem.start) > 1e-3 ||
		s.PromptTokens < mem.prompt || s.PrefixQueries < mem.queries)
	// A restarted engine was forgotten (OnRestart): its capacity counts anew.
	capChanged := s.KVCapacityTokens > 0 && (restarted || s.KVCapacityTokens != mem.capacity)
	mem.seen, mem.start, mem.prompt, mem.queries = true, s.StartTime, s.PromptTokens, s.PrefixQueries
	if s.KVCapacityTokens > 0 {
		mem.capacity = s.KVCapacityTokens
	}
	st := &s
	e.SetEngine(st)
	if c := e.calib; c != nil {
		if restarted {
			c.restart()
		}
		c.observeEngine(s.ITLSum, s.ITLCount, s.ITLCount > 0, s.Running, s.Waiting, s.KVUsage, s.KVCapacityTokens)
	}
	if restarted {
		f.m.restarts[r].Inc()
		f.log.Info("engine restarted; forgetting its cache", zap.String("endpoint", e.URL))
		e.detected.Store(false) // detect it again: it may be another engine
		if f.o.OnRestart != nil {
			f.o.OnRestart(e)
		}
		f.event("restart", e)
	}
	if capChanged {
		if f.o.OnCapacity != nil {
			f.o.OnCapacity(e, int(s.KVCapacityTokens))
		}
		f.event("capacity", e)
	}
	f.event("scrape", e)
}

// fetch GETs url into w.body; status is the answer's (0: none).
func (w *scrapeWorker) fetch(ctx context.Context, url string) (status int, err error) {
	f := w.f
	ctx, cancel := context.WithTimeout(ctx, f.o.Scrape.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	// The classic text format: no OpenMetrics, no protobuf.
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := f.client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return resp.StatusCode, fmt.Errorf("%w: %s", ErrStatus, resp.Status)
	}
	w.body.Reset()
	max := f.o.Scrape.MaxBytes
	if _, err := w.body.ReadFrom(io.LimitReader(resp.Body, int64(max)+1)); err != nil {
		return resp.StatusCode, err
	}
	if w.body.Len() > max {
		return resp.StatusCode, fmt.Errorf("%w: over %d bytes", ErrTooLarge, max)
	}
	return resp.StatusCode, nil
}

// metricsAbsent handles an engine that answered its /metrics with status
// (404, 405, 501): it is left alone for metricsRecheck, or until it is
// detected again; logged once, when first seen.
func (f *Fleet) metricsAbsent(e *Endpoint, status int) {
	now := time.Now()
	if e.noMetricsUntil.Swap(now.Add(metricsRecheck).UnixNano()) == 0 {
		f.log.Info("engine serves no metrics; routing on the router's own counts",
			zap.String("endpoint", e.URL), zap.Stringer("dialect", e.Dialect()), zap.Int("status", status))
	}
	f.expire(e, now)
	f.event("scrape-absent", e)
}

// learnDialect sets e's dialect from the engine its metrics name, when
// neither detection nor the flag told it.
func (f *Fleet) learnDialect(e *Endpoint, engine string) {
	if e.Dialect() != DialectUnknown {
		return
	}
	if d, err := ParseDialect(engine); err == nil && d != DialectUnknown {
		e.SetDialect(d)
		f.log.Info("engine dialect", zap.String("endpoint", e.URL), zap.Stringer("dialect", d), zap.String("from", "metrics"))
	}
}
