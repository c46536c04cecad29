package sim

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// vLLM's histogram buckets (vllm-wire/vllm-metrics.txt, v0.19).
var (
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
		1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}
	itlBuckets = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
		1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}
	latencyBuckets = []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
		40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}
)

// podMetrics are one pod's collectors on its own registry, named and labelled
// as vLLM V1 exports them (engine="0", model_name). Latencies are modelled
// seconds, i.e. what a client of a real engine would see. Collectors are safe
// for concurrent use; the engine goroutine updates most of them.
type podMetrics struct {
	reg *prometheus.Registry

	promptTokens, generationTokens prometheus.Counter
	prefixQueries, prefixHits      prometheus.Counter
	extQueries, extHits            prometheus.Counter
	preemptions                    prometheus.Counter
	successStop, successLength     prometheus.Counter
	successAbort                   prometheus.Counter
	ttft, itl, e2e, queue          prometheus.Histogram
	kvFailed, kvExpired            prometheus.Counter

	// kvEventsDropped is registered with KV events on, offload* with the
	// CPU tier on; both are nil otherwise.
	kvEventsDropped           prometheus.Counter
	offloadBytes, offloadTime [2]prometheus.Counter  // by offloadDir
	offloadSize               [2]prometheus.Observer // by offloadDir
}

// offloadDir is the transfer_type of vLLM's offloading metrics.
type offloadDir int

const (
	gpuToCPU offloadDir = iota
	cpuToGPU
)

// offloadBuckets are vLLM's vllm:kv_offload_size buckets, in bytes.
var offloadBuckets = []float64{1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6}

// offloaded counts one CPU-tier copy of bytes bytes that takes d (modelled).
func (m *podMetrics) offloaded(dir offloadDir, bytes float64, d time.Duration) {
	m.offloadBytes[dir].Add(bytes)
	m.offloadTime[dir].Add(d.Seconds())
	m.offloadSize[dir].Observe(bytes)
}

// newPodMetrics registers the collectors of engine e, configured by cfg
// and started at start, on a registry of their own.
func newPodMetrics(cfg *Config, e *engine, start time.Time) *podMetrics {
	r := podRegistry{reg: prometheus.NewRegistry(), labels: prometheus.Labels{"engine": "0", "model_name": cfg.Model}}
	m := &podMetrics{reg: r.reg}

	r.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "process_start_time_seconds",
		Help: "Start time of the process since unix epoch in seconds.",
	}, func() float64 { return float64(start.UnixNano()) / 1e9 }))

	r.gaugeFunc("vllm:num_requests_running", "Number of requests in model execution batches.",
		func() float64 { return float64(e.nRunning.Load()) })
	r.gaugeFunc("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
		func() float64 { return float64(e.nWaiting.Load()) })
	r.gaugeFunc("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
		func() float64 { return float64(e.nUsed.Load()) / float64(cfg.NumGPUBlocks) })

	m.registerRequests(r)
	r.reg.MustRegister(cacheConfigInfo(cfg))
	if len(cfg.LoRAs) > 0 {
		r.reg.MustRegister(loraCollector{e: e, max: strconv.Itoa(cfg.MaxLoRAs), start: float64(start.UnixNano()) / 1e9})
	}
	m.registerKVConnector(r, cfg, e)
	if cfg.CPUBlocks > 0 {
		m.registerOffload(r)
	}
	return m
}

// podRegistry registers a pod's collectors with its constant labels (engine
// and model_name).
type podRegistry struct {
	reg    *prometheus.Registry
	labels prometheus.Labels
}

func (r podRegistry) counter(name, help string) prometheus.Counter {
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: r.labels})
	r.reg.MustRegister(c)
	return c
}

func (r podRegistry) hist(name, help string, buckets []float64) prometheus.Histogram {
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, ConstLabels: r.labels, Buckets: buckets})
	r.reg.MustRegister(h)
	return h
}

func (r podRegistry) gaugeFunc(name, help string, f func() float64) {
	r.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: r.labels}, f))
}

// registerRequests registers the token, prefix-cache, outcome and latency
// collectors of the requests the engine serves.
func (m *podMetrics) registerRequests(r podRegistry) {
	m.prefixQueries = r.counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.")
	m.prefixHits = r.counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.")
	m.extQueries = r.counter("vllm:external_prefix_cache_queries_total",
		"External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.")
	m.extHits = r.counter("vllm:external_prefix_cache_hits_total",
		"External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.")
	m.preemptions = r.counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.")
	m.promptTokens = r.counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.")
	m.generationTokens = r.counter("vllm:generation_tokens_total", "Number of generation tokens processed.")

	success := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "vllm:request_success_total", Help: "Count of successfully processed requests.", ConstLabels: r.labels,
	}, []string{"finished_reason"})
	r.reg.MustRegister(success)
	m.successStop = success.WithLabelValues("stop")
	m.successLength = success.WithLabelValues("length")
	m.successAbort = success.WithLabelValues("abort")

	m.ttft = r.hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", ttftBuckets)
	m.itl = r.hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", itlBuckets)
	m.e2e = r.hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", latencyBuckets)
	m.queue = r.hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", latencyBuckets)
}

// cacheConfigInfo is vLLM's vllm:cache_config_info for cfg's KV cache.
func cacheConfigInfo(cfg *Config) prometheus.Gauge {
	info := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "vllm:cache_config_info",
		Help: "Information of the LLMEngine CacheConfig",
		// vLLM exports this series without model_name.
		ConstLabels: prometheus.Labels{
			"block_size":               strconv.Itoa(cfg.BlockSize),
			"cache_dtype":              "auto",
			"enable_prefix_caching":    "True",
			"engine":                   "0",
			"gpu_memory_utilization":   "0.9",
			"num_cpu_blocks":           "None",
			"num_gpu_blocks":           strconv.Itoa(cfg.NumGPUBlocks),
			"num_gpu_blocks_override":  "None",
			"prefix_caching_hash_algo": "xxhash",
		},
	})
	info.Set(1)
	return info
}

// registerKVConnector registers the KV connector figures, and the KV
// events' drop count when cfg publishes events. vLLM's NixlConnector
// exports the failure count; the hold and drop figures are the simulator's
// own (kvsim: prefix).
func (m *podMetrics) registerKVConnector(r podRegistry, cfg *Config, e *engine) {
	m.kvFailed = r.counter("vllm:nixl_num_failed_transfers",
		"Number of failed NIXL KV Cache transfers; the decode pod computed the prefill itself.")
	m.kvExpired = r.counter("kvsim:kv_hold_expired_total",
		"Prefill KV holds released because no decode pod pulled them before the timeout.")
	r.gaugeFunc("kvsim:kv_held_blocks", "KV blocks a prefill pod holds for decode pods that have not pulled them yet.",
		func() float64 { return float64(e.nHeld.Load()) })

	if cfg.KVEventsPort != 0 {
		m.kvEventsDropped = r.counter("kvsim:kv_events_dropped_total",
			"KV event batches dropped because the publisher's queue was full (their sequence numbers are skipped), plus batches a subscriber's full send queue dropped.")
	}
}

// registerOffload registers vLLM's OffloadingConnector metrics
// (OffloadPromMetrics), per transfer_type; times are modelled seconds.
func (m *podMetrics) registerOffload(r podRegistry) {
	dirs := []string{"GPU_to_CPU", "CPU_to_GPU"}
	vec := func(name, help string) *prometheus.CounterVec {
		v := prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: r.labels}, []string{"transfer_type"})
		r.reg.MustRegister(v)
		return v
	}
	bytes := vec("vllm:kv_offload_total_bytes_total", "Number of bytes offloaded by KV connector")
	secs := vec("vllm:kv_offload_total_time_total", "Total time measured by all KV offloading operations")
	size := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "vllm:kv_offload_size",
		Help: "Histogram of KV offload transfer size, in bytes.", ConstLabels: r.labels, Buckets: offloadBuckets}, []string{"transfer_type"})
	r.reg.MustRegister(size)
	for i, d := range dirs {
		m.offloadBytes[i] = bytes.WithLabelValues(d)
		m.offloadTime[i] = secs.WithLabelValues(d)
		m.offloadSize[i] = size.WithLabelValues(d)
	}
}

// loraDesc is vLLM's LoRA gauge (vllm/v1/metrics/loggers.py): one series
// whose labels name the adapters of the running and waiting requests and
// whose value is when it was set. (vLLM keeps the earlier label sets as
// stale series; the simulator exports only the current one.)
var loraDesc = prometheus.NewDesc("vllm:lora_requests_info", "Running stats on lora requests.",
	[]string{"max_lora", "running_lora_adapters", "waiting_lora_adapters"}, nil)

// loraCollector exports vllm:lora_requests_info from the engine's
// published adapters.
type loraCollector struct {
	e     *engine
	max   string
	start float64
}

func (c loraCollector) Describe(ch chan<- *prometheus.Desc) { ch <- loraDesc }

func (c loraCollector) Collect(ch chan<- prometheus.Metric) {
	info := loraInfo{at: c.start}
	if p := c.e.loras.Load(); p != nil {
		info = *p
	}
	ch <- prometheus.MustNewConstMetric(loraDesc, prometheus.GaugeValue, info.at, c.max, info.running, info.waiting)
}

func (m *podMetrics) success(reason string) prometheus.Counter {
	switch reason {
	case "stop":
		return m.successStop
	case "abort":
		return m.successAbort
	}
	return m.successLength
}
