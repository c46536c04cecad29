package load

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Engine metric names (vLLM V1, as listed in vLLM's docs, "Production
// Metrics": docs.vllm.ai/en/stable/usage/metrics). Prefix-cache counters
// count tokens; vLLM 0.10 also exported them as gpu_prefix_cache_*
// (deprecated).
const (
	metricPrefixQueries    = "vllm:prefix_cache_queries_total"
	metricPrefixHits       = "vllm:prefix_cache_hits_total"
	metricOldPrefixQueries = "vllm:gpu_prefix_cache_queries_total"
	metricOldPrefixHits    = "vllm:gpu_prefix_cache_hits_total"
	metricPreemptions      = "vllm:num_preemptions_total"
	metricPromptTokens     = "vllm:prompt_tokens_total"
	metricGenTokens        = "vllm:generation_tokens_total"
	// MetricTTFT is the engines' time-to-first-token histogram.
	MetricTTFT = "vllm:time_to_first_token_seconds"
)

// scrapeTimeout bounds one /metrics request.
const scrapeTimeout = 10 * time.Second

// EngineSnapshot is one scrape of every pod's /metrics: counters summed
// over pods and series, and the TTFT histogram summed over pods.
type EngineSnapshot struct {
	Pods     int
	Counters map[string]float64
	TTFT     Histogram
}

// EngineStats are engine-side figures over a run: differences of two
// snapshots, summed over pods.
type EngineStats struct {
	Pods int `json:"pods"`
	// PrefixQueries and PrefixHits are prompt tokens looked up in and found
	// in the engines' prefix caches; HitRate is hits ÷ queries (NaN-free:
	// 0 without queries).
	PrefixQueries float64 `json:"prefix_queries"`
	PrefixHits    float64 `json:"prefix_hits"`
	HitRate       float64 `json:"hit_rate"`
	// Preemptions counts sequences evicted from a running batch for KV.
	Preemptions float64 `json:"preemptions"`
	// PromptTokens and GenerationTokens as the engines counted them.
	PromptTokens     float64 `json:"prompt_tokens"`
	GenerationTokens float64 `json:"generation_tokens"`
}

// ScrapeEngines fetches /metrics from every base URL concurrently and sums
// them. hc nil means a client with a 10 s timeout.
func ScrapeEngines(ctx context.Context, hc *http.Client, urls []string) (*EngineSnapshot, error) {
	if hc == nil {
		hc = &http.Client{Timeout: scrapeTimeout}
	}
	fams := make([]map[string]*dto.MetricFamily, len(urls))
	errs := make([]error, len(urls))
	var wg sync.WaitGroup
	for i, u := range urls {
		wg.Go(func() { fams[i], errs[i] = scrapeOne(ctx, hc, u) })
	}
	wg.Wait()
	snap := &EngineSnapshot{Pods: len(urls), Counters: make(map[string]float64)}
	for i, f := range fams {
		if errs[i] != nil {
			return nil, errs[i]
		}
		for name, fam := range f {
			for _, m := range fam.GetMetric() {
				switch {
				case m.GetCounter() != nil:
					snap.Counters[name] += m.GetCounter().GetValue()
				case m.GetUntyped() != nil:
					snap.Counters[name] += m.GetUntyped().GetValue()
				case m.GetHistogram() != nil && name == MetricTTFT:
					snap.TTFT.add(m.GetHistogram())
				}
			}
		}
	}
	return snap, nil
}

func scrapeOne(ctx context.Context, hc *http.Client, base string) (map[string]*dto.MetricFamily, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(base, "/")+"/metrics", nil)
	if err != nil {
		return nil, fmt.Errorf("%w: pod URL %q: %v", ErrConfig, base, err)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("load: scrape %s: %w", base, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, resp.Body)
		return nil, fmt.Errorf("load: scrape %s: status %d", base, resp.StatusCode)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("load: scrape %s: %w", base, err)
	}
	return fams, nil
}

// counter returns a summed counter, accepting the name with or without
// "_total" (text parsers differ on where the suffix goes).
func (s *EngineSnapshot) counter(name string) (float64, bool) {
	if v, ok := s.Counters[name]; ok {
		return v, true
	}
	v, ok := s.Counters[strings.TrimSuffix(name, "_total")]
	return v, ok
}

// Since returns the engine figures accumulated between before and s.
func (s *EngineSnapshot) Since(before *EngineSnapshot) EngineStats {
	d := func(name string) (float64, bool) {
		a, ok := s.counter(name)
		b, _ := before.counter(name)
		return a - b, ok
	}
	st := EngineStats{Pods: s.Pods}
	var ok bool
	if st.PrefixQueries, ok = d(metricPrefixQueries); !ok {
		st.PrefixQueries, _ = d(metricOldPrefixQueries)
		st.PrefixHits, _ = d(metricOldPrefixHits)
	} else {
		st.PrefixHits, _ = d(metricPrefixHits)
	}
	if st.PrefixQueries > 0 {
		st.HitRate = st.PrefixHits / st.PrefixQueries
	}
	st.Preemptions, _ = d(metricPreemptions)
	st.PromptTokens, _ = d(metricPromptTokens)
	st.GenerationTokens, _ = d(metricGenTokens)
	return st
}

// Histogram is a Prometheus histogram: cumulative counts at ascending upper
// bounds (seconds for latency histograms), +Inf implied by Count.
type Histogram struct {
	Bounds     []float64 `json:"bounds"`
	Cumulative []float64 `json:"cumulative"`
	Count      float64   `json:"count"`
	Sum        float64   `json:"sum"`
}

func (h *Histogram) add(m *dto.Histogram) {
	bs := m.GetBucket()
	if h.Bounds == nil {
		for _, b := range bs {
			if !math.IsInf(b.GetUpperBound(), 1) {
				h.Bounds = append(h.Bounds, b.GetUpperBound())
			}
		}
		h.Cumulative = make([]float64, len(h.Bounds))
	}
	for _, b := range bs {
		i := sort.SearchFloat64s(h.Bounds, b.GetUpperBound())
		if i < len(h.Bounds) && h.Bounds[i] == b.GetUpperBound() {
			h.Cumulative[i] += float64(b.GetCumulativeCount())
		}
	}
	h.Count += float64(m.GetSampleCount())
	h.Sum += m.GetSampleSum()
}
