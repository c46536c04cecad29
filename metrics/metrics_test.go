package metrics

import (
	"fmt"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"
)

var testClasses = []string{"other", "completions", "chat"}

// gather returns reg's families by name.
func gather(t *testing.T, reg *prometheus.Registry) map[string]*dto.MetricFamily {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := make(map[string]*dto.MetricFamily, len(mfs))
	for _, mf := range mfs {
		out[mf.GetName()] = mf
	}
	return out
}

// labelsOf renders a sample's labels as "k=v,k=v" (sorted by name, as
// Gather returns them).
func labelsOf(m *dto.Metric) string {
	var parts []string
	for _, l := range m.GetLabel() {
		parts = append(parts, l.GetName()+"="+l.GetValue())
	}
	return strings.Join(parts, ",")
}

// sample returns the sample of family name with exactly the given labels.
func sample(t *testing.T, mfs map[string]*dto.MetricFamily, name, labels string) *dto.Metric {
	t.Helper()
	mf, ok := mfs[name]
	if !ok {
		t.Fatalf("family %s missing", name)
	}
	var have []string
	for _, m := range mf.GetMetric() {
		if labelsOf(m) == labels {
			return m
		}
		have = append(have, labelsOf(m))
	}
	t.Fatalf("%s{%s} missing; have %q", name, labels, have)
	return nil
}

// lint fails on what the Prometheus linter finds in reg's families.
func lint(t *testing.T, reg *prometheus.Registry) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	problems, err := promlint.NewWithMetricFamilies(mfs).Lint()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
}

func wantType(t *testing.T, mfs map[string]*dto.MetricFamily, name string, typ dto.MetricType) {
	t.Helper()
	mf, ok := mfs[name]
	if !ok {
		t.Errorf("family %s missing", name)
		return
	}
	if mf.GetType() != typ {
		t.Errorf("%s type %v, want %v", name, mf.GetType(), typ)
	}
	if mf.GetHelp() == "" {
		t.Errorf("%s has no help", name)
	}
}

// TestNewRegistersEveryFamily: New registers kvroute's families with their
// types, before anything is recorded (families without label children
// show once recorded), and they pass the Prometheus linter.
func TestNewRegistersEveryFamily(t *testing.T) {
	reg := prometheus.NewRegistry()
	New(reg, testClasses, nil)
	mfs := gather(t, reg)
	for name, typ := range map[string]dto.MetricType{
		"kvroute_in_flight_requests":                   dto.MetricType_GAUGE,
		"kvroute_retries_total":                        dto.MetricType_COUNTER,
		"kvroute_request_duration_seconds":             dto.MetricType_HISTOGRAM,
		"kvroute_time_to_first_byte_seconds":           dto.MetricType_HISTOGRAM,
		"llm_router_cache_hit_total":                   dto.MetricType_COUNTER,
		"llm_router_cache_hit_ratio":                   dto.MetricType_GAUGE,
		"kvroute_routed_prompt_tokens_total":           dto.MetricType_COUNTER,
		"kvroute_prefix_estimated_cached_tokens_total": dto.MetricType_COUNTER,
		"kvroute_prefix_engine_cached_tokens_total":    dto.MetricType_COUNTER,
		"kvroute_prefix_estimates_total":               dto.MetricType_COUNTER,
	} {
		wantType(t, mfs, name, typ)
	}
	// The per-class histograms exist for every class from the start.
	for _, c := range testClasses {
		sample(t, mfs, "kvroute_request_duration_seconds", "class="+c)
		sample(t, mfs, "kvroute_time_to_first_byte_seconds", "class="+c)
	}
	for _, o := range []string{"exact", "over", "under"} {
		sample(t, mfs, "kvroute_prefix_estimates_total", "outcome="+o)
	}
	if v := sample(t, mfs, "llm_router_cache_hit_ratio", "").GetGauge().GetValue(); v != 0 {
		t.Errorf("hit ratio %v before any decision, want 0", v)
	}
	lint(t, reg)
}

// TestRecording: each recording function moves its family, with the label
// values it is given.
func TestRecording(t *testing.T) {
	reg := prometheus.NewRegistry()
	recordSome(New(reg, testClasses, nil))

	mfs := gather(t, reg)
	wantType(t, mfs, "kvroute_requests_total", dto.MetricType_COUNTER)
	wantType(t, mfs, "kvroute_upstream_errors_total", dto.MetricType_COUNTER)
	wantType(t, mfs, "kvroute_routing_decisions_total", dto.MetricType_COUNTER)
	counters := []struct {
		name, labels string
		want         float64
	}{
		{"kvroute_requests_total", "class=completions,code=200,model=m", 2},
		{"kvroute_requests_total", "class=chat,code=499,model=m", 1},
		{"kvroute_requests_total", "class=other,code=503,model=none", 1},
		{"kvroute_upstream_errors_total", "kind=connect", 2},
		{"kvroute_upstream_errors_total", "kind=timeout", 1},
		{"kvroute_retries_total", "", 3},
		{"kvroute_retries_budget_exhausted_total", "", 1},
		{"kvroute_upstream_cancellations_total", "", 2},
		{"kvroute_overload_rejections_total", "", 1},
		{"kvroute_routing_decisions_total", "reason=warm", 2},
		{"kvroute_routing_decisions_total", "reason=cold", 1},
		{"kvroute_routed_prompt_tokens_total", "", 4000},
		{"llm_router_cache_hit_total", "", 3000},
		{"kvroute_prefix_estimated_cached_tokens_total", "", 4200},
		{"kvroute_prefix_engine_cached_tokens_total", "", 3512},
		{"kvroute_prefix_estimates_total", "outcome=exact", 2},
		{"kvroute_prefix_estimates_total", "outcome=over", 1},
		{"kvroute_prefix_estimates_total", "outcome=under", 1},
	}
	for _, c := range counters {
		if got := sample(t, mfs, c.name, c.labels).GetCounter().GetValue(); got != c.want {
			t.Errorf("%s{%s} = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	if n := len(mfs["kvroute_requests_total"].GetMetric()); n != 3 {
		t.Errorf("%d request series, want 3", n)
	}
	if got := sample(t, mfs, "kvroute_in_flight_requests", "").GetGauge().GetValue(); got != 1 {
		t.Errorf("in flight %v, want 1", got)
	}
	if got := sample(t, mfs, "kvroute_queued_requests", "").GetGauge().GetValue(); got != 2 {
		t.Errorf("queued %v, want 2", got)
	}
	if got := sample(t, mfs, "llm_router_cache_hit_ratio", "").GetGauge().GetValue(); got != 0.75 {
		t.Errorf("hit ratio %v, want 0.75", got)
	}

	checkRecordedHistograms(t, mfs)
	lint(t, reg)
}

// recordSome calls every recording function of m, for TestRecording.
func recordSome(m *Metrics) {
	m.Request(1, 200, []byte("m"), 0.5)
	m.Request(1, 200, []byte("m"), 1.5)
	m.Request(2, 499, []byte("m"), 0.0002)
	m.Request(0, 503, nil, 30)
	m.FirstByte(1, 0.003)
	m.FirstByte(2, 0.25)
	m.InFlight(1)
	m.InFlight(1)
	m.InFlight(-1)
	m.UpstreamError("connect")
	m.UpstreamError("connect")
	m.UpstreamError("timeout")
	m.Retry()
	m.Retry()
	m.Retry()
	m.RetryDenied()
	m.Cancelled()
	m.Cancelled()
	m.Queued(1)
	m.Queued(1)
	m.Queued(1)
	m.Queued(-1)
	m.Overloaded()
	m.Decision("warm", 1000, 750)
	m.Decision("warm", 3000, 2250)
	m.Decision("cold", 0, 0)  // no prompt: counted as a decision only
	m.CacheReport(1000, 1000) // exact
	m.CacheReport(1200, 1000) // within 256: exact
	m.CacheReport(2000, 1000) // over
	m.CacheReport(0, 512)     // under
}

// checkRecordedHistograms checks the latency histograms after recordSome:
// per class, and with buckets from a loopback hop to a long generation.
func checkRecordedHistograms(t *testing.T, mfs map[string]*dto.MetricFamily) {
	t.Helper()
	hist := func(name, class string) *dto.Histogram {
		return sample(t, mfs, name, "class="+class).GetHistogram()
	}
	if h := hist("kvroute_request_duration_seconds", "completions"); h.GetSampleCount() != 2 || h.GetSampleSum() != 2 {
		t.Errorf("completions duration: count %d sum %v, want 2 and 2", h.GetSampleCount(), h.GetSampleSum())
	}
	if h := hist("kvroute_request_duration_seconds", "other"); h.GetSampleCount() != 1 || h.GetSampleSum() != 30 {
		t.Errorf("other duration: count %d sum %v", h.GetSampleCount(), h.GetSampleSum())
	}
	if h := hist("kvroute_time_to_first_byte_seconds", "chat"); h.GetSampleCount() != 1 || h.GetSampleSum() != 0.25 {
		t.Errorf("chat first byte: count %d sum %v", h.GetSampleCount(), h.GetSampleSum())
	}
	if h := hist("kvroute_time_to_first_byte_seconds", "other"); h.GetSampleCount() != 0 {
		t.Errorf("other first byte: count %d, want 0", h.GetSampleCount())
	}
	// The buckets span a loopback hop to a long generation: 0.0002 s
	// lands in the 0.00025 bucket, 30 s in the 60 s one.
	b := hist("kvroute_request_duration_seconds", "chat").GetBucket()
	if len(b) == 0 || b[0].GetUpperBound() != 0.0001 || b[len(b)-1].GetUpperBound() != 600 {
		t.Fatalf("buckets %v", b)
	}
	for _, bk := range b {
		want := uint64(0)
		if bk.GetUpperBound() >= 0.00025 {
			want = 1
		}
		if bk.GetCumulativeCount() != want {
			t.Errorf("chat duration bucket le=%v count %d, want %d", bk.GetUpperBound(), bk.GetCumulativeCount(), want)
		}
	}
}

// TestEndpointCollector: the endpoints callback is read at every gather;
// the learned-cost families appear only for endpoints with costs.
func TestEndpointCollector(t *testing.T) {
	reg := prometheus.NewRegistry()
	samples := []EndpointSample{
		{URL: "http://10.0.0.1:8000", Role: "mixed", InFlight: 3, Requests: 40, Failures: 2, KVUsage: 0.25, PeerInFlight: 5},
		{URL: "http://10.0.0.2:8000", Role: "prefill", InFlight: 0, Requests: 7, Failures: 0, KVUsage: 0.5, PeerInFlight: -1,
			Costs: &CostsSample{PrefillTokensPerSec: 20000, LoadTokensPerSec: 200000, FixedSec: 0.02, DecodeStepSec: 0.012, DecodeSec: 1.5,
				BatchLimit: 64, TTFTSamples: 11, DecodeSamples: 12, StepSamples: 13, LimitSamples: 14}},
	}
	New(reg, testClasses, func(yield func(EndpointSample)) {
		for _, s := range samples {
			yield(s)
		}
	})
	mfs := gather(t, reg)
	wantType(t, mfs, "kvroute_endpoint_in_flight_requests", dto.MetricType_GAUGE)
	wantType(t, mfs, "kvroute_endpoint_requests_total", dto.MetricType_COUNTER)
	wantType(t, mfs, "kvroute_endpoint_failures_total", dto.MetricType_COUNTER)
	a := "endpoint=http://10.0.0.1:8000,role=mixed"
	b := "endpoint=http://10.0.0.2:8000,role=prefill"
	if v := sample(t, mfs, "kvroute_endpoint_in_flight_requests", a).GetGauge().GetValue(); v != 3 {
		t.Errorf("in flight %v", v)
	}
	if v := sample(t, mfs, "kvroute_endpoint_peer_in_flight_requests", a).GetGauge().GetValue(); v != 5 {
		t.Errorf("peers' in flight %v", v)
	}
	if n := len(mfs["kvroute_endpoint_peer_in_flight_requests"].GetMetric()); n != 1 {
		t.Errorf("peers' in flight exported for %d endpoints, want the one with gossip", n)
	}
	if v := sample(t, mfs, "kvroute_endpoint_requests_total", a).GetCounter().GetValue(); v != 40 {
		t.Errorf("requests %v", v)
	}
	if v := sample(t, mfs, "kvroute_endpoint_failures_total", a).GetCounter().GetValue(); v != 2 {
		t.Errorf("failures %v", v)
	}
	if v := sample(t, mfs, "kvroute_endpoint_requests_total", b).GetCounter().GetValue(); v != 7 {
		t.Errorf("requests of b %v", v)
	}
	// The decode-side KV usage, in percent, of every endpoint that decodes:
	// the mixed one, not the prefill one.
	if ms := mfs["llm_decode_kv_cache_usage_percent"].GetMetric(); len(ms) != 1 || ms[0].GetGauge().GetValue() != 25 {
		t.Errorf("llm_decode_kv_cache_usage_percent %v, want the mixed endpoint's 25 alone", ms)
	}
	for name, want := range map[string]float64{
		"kvroute_endpoint_prefill_tokens_per_second": 20000,
		"kvroute_endpoint_load_tokens_per_second":    200000,
		"kvroute_endpoint_ttft_fixed_seconds":        0.02,
		"kvroute_endpoint_decode_step_seconds":       0.012,
		"kvroute_endpoint_decode_seconds":            1.5,
		"kvroute_endpoint_batch_limit":               64,
	} {
		wantType(t, mfs, name, dto.MetricType_GAUGE)
		if n := len(mfs[name].GetMetric()); n != 1 {
			t.Errorf("%s has %d series, want only the endpoint with costs", name, n)
		}
		if v := sample(t, mfs, name, b).GetGauge().GetValue(); v != want {
			t.Errorf("%s = %v, want %v", name, v, want)
		}
	}
	for kind, want := range map[string]float64{"ttft": 11, "decode": 12, "decode_step": 13, "batch_limit": 14} {
		if v := sample(t, mfs, "kvroute_endpoint_calibration_samples", "endpoint=http://10.0.0.2:8000,kind="+kind+",role=prefill").GetGauge().GetValue(); v != want {
			t.Errorf("calibration samples %s = %v, want %v", kind, v, want)
		}
	}

	// Read at every gather: the values follow the callback.
	samples[0].InFlight, samples = 9, samples[:1]
	mfs = gather(t, reg)
	if v := sample(t, mfs, "kvroute_endpoint_in_flight_requests", a).GetGauge().GetValue(); v != 9 {
		t.Errorf("in flight after the change %v, want 9", v)
	}
	if _, ok := mfs["kvroute_endpoint_prefill_tokens_per_second"]; ok {
		t.Error("costs of an endpoint that is gone still reported")
	}
	if n := collectCount(&endpointCollector{each: func(func(EndpointSample)) {}}); n != 0 {
		t.Errorf("no endpoints: %d samples", n)
	}
}

// TestRegisterIndex: the prefix index's sizes and counters, read at every
// gather.
func TestRegisterIndex(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := IndexSample{Endpoints: 4, Hashes: 100, Entries: 250, Bytes: 14000, Evictions: 7, Expiries: 3, Homes: 12, Foreign: 0.5}
	RegisterIndex(reg, func() IndexSample { return s })
	mfs := gather(t, reg)
	for _, c := range []struct {
		name string
		typ  dto.MetricType
		want float64
	}{
		{"kvroute_prefix_index_entries", dto.MetricType_GAUGE, 250},
		{"kvroute_prefix_index_blocks", dto.MetricType_GAUGE, 100},
		{"kvroute_prefix_index_bytes", dto.MetricType_GAUGE, 14000},
		{"kvroute_prefix_index_evictions_total", dto.MetricType_COUNTER, 7},
		{"kvroute_prefix_index_expiries_total", dto.MetricType_COUNTER, 3},
		{"kvroute_prefix_homes", dto.MetricType_GAUGE, 12},
		{"kvroute_prefix_foreign_share", dto.MetricType_GAUGE, 0.5},
	} {
		wantType(t, mfs, c.name, c.typ)
		m := sample(t, mfs, c.name, "")
		got := m.GetGauge().GetValue()
		if c.typ == dto.MetricType_COUNTER {
			got = m.GetCounter().GetValue()
		}
		if got != c.want {
			t.Errorf("%s = %v, want %v", c.name, got, c.want)
		}
	}
	s.Entries = 300
	if got := sample(t, gather(t, reg), "kvroute_prefix_index_entries", "").GetGauge().GetValue(); got != 300 {
		t.Errorf("entries after a change %v, want 300", got)
	}
	if n := collectCount(&indexCollector{read: func() IndexSample { return s }}); n != 7 {
		t.Errorf("%d index samples, want 7", n)
	}
}

// collectCount returns the number of samples c collects; c must collect
// fewer than 64 (the collectors tested here collect at most 6).
func collectCount(c prometheus.Collector) int {
	ch := make(chan prometheus.Metric, 64)
	c.Collect(ch)
	close(ch)
	return len(ch)
}

// TestRegistriesAreIndependent: no package-global state; two Metrics on
// two registries record separately, and one registry takes one Metrics.
func TestRegistriesAreIndependent(t *testing.T) {
	r1, r2 := prometheus.NewRegistry(), prometheus.NewRegistry()
	m1, m2 := New(r1, testClasses, nil), New(r2, testClasses, nil)
	m1.Retry()
	m2.Retry()
	m2.Retry()
	if a, b := sample(t, gather(t, r1), "kvroute_retries_total", "").GetCounter().GetValue(),
		sample(t, gather(t, r2), "kvroute_retries_total", "").GetCounter().GetValue(); a != 1 || b != 2 {
		t.Errorf("retries %v and %v, want 1 and 2", a, b)
	}
	defer func() {
		if recover() == nil {
			t.Error("a second New on one registry did not panic (duplicate registration)")
		}
	}()
	New(r1, testClasses, nil)
}

// TestModelLabelBounded: only names an endpoint answered with a success
// are labelled, at most MaxModels of them; the rest are "other".
func TestModelLabelBounded(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg, testClasses, nil)
	for i := range MaxModels + 10 {
		m.Request(1, 200, fmt.Appendf(nil, "model-%d", i), 0.1)
		m.Request(1, 404, fmt.Appendf(nil, "typo-%d", i), 0.1)
	}
	models := map[string]bool{}
	for _, mf := range gather(t, reg) {
		if mf.GetName() != "kvroute_requests_total" {
			continue
		}
		for _, x := range mf.GetMetric() {
			for _, l := range x.GetLabel() {
				if l.GetName() == "model" {
					models[l.GetValue()] = true
				}
			}
		}
	}
	if len(models) != MaxModels+1 || !models["other"] || !models["model-0"] || models["typo-0"] || models[fmt.Sprintf("model-%d", MaxModels)] {
		t.Errorf("model label values %v: want model-0 … model-%d and other", models, MaxModels-1)
	}
}
