package sim

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
)

// TestWireFixturesKeepRealShapes: the module's own wire samples
// (testdata/wire), which the wire tests use when shared/vllm-wire is
// absent, keep the shapes of the real captures: the same keys at every
// level of the JSON bodies and SSE events, and for the metrics the same
// names, types, HELP, label names and buckets. It needs the real captures
// and skips without them.
func TestWireFixturesKeepRealShapes(t *testing.T) {
	shared := sharedWireDir(t)
	if shared == "" {
		t.Skip("shared/vllm-wire not found above the package directory: nothing to compare with")
	}
	own := ownWireDir(t)
	read := func(t *testing.T, dir, name string) []byte {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}

	for _, name := range []string{"completion.json", "chat-completion.json", "pd-prefill-response.json", "error-400.json", "models.json"} {
		t.Run(name, func(t *testing.T) {
			var ours, real any
			if err := json.Unmarshal(read(t, own, name), &ours); err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(read(t, shared, name), &real); err != nil {
				t.Fatal(err)
			}
			sameKeys(t, name, ours, real)
		})
	}

	for _, name := range []string{"completion-stream.sse", "chat-completion-stream.sse"} {
		t.Run(name, func(t *testing.T) {
			ours := read(t, own, name)
			events := sseEvents(t, ours) // checks the framing: data lines, blank lines
			if len(events) < 3 || events[len(events)-1] != "[DONE]" {
				t.Fatalf("%d events, last %q: want chunks then [DONE]", len(events), events[len(events)-1])
			}
			for _, path := range [][]string{{}, {"choices", "0"}, {"choices", "0", "delta"}} {
				if name == "completion-stream.sse" && len(path) == 3 {
					continue
				}
				var have, want []string
				for _, ev := range events[:len(events)-1] {
					have = union(have, keySet(t, field(t, []byte(ev), path...)))
				}
				for _, ev := range wireEventsIn(t, read(t, shared, name)) {
					want = union(want, keySet(t, field(t, ev, path...)))
				}
				slices.Sort(have)
				slices.Sort(want)
				if !slices.Equal(have, want) {
					t.Errorf("%v keys %v, the capture's %v", path, have, want)
				}
			}
		})
	}

	t.Run("vllm-metrics.txt", func(t *testing.T) {
		ours := parseMetrics(t, read(t, own, "vllm-metrics.txt"))
		real := parseMetrics(t, read(t, shared, "vllm-metrics.txt"))
		for name, mf := range ours {
			rf, ok := real[name]
			if !ok {
				t.Errorf("%s is not in the capture", name)
				continue
			}
			sameFamily(t, mf, rf, true)
		}
		for _, name := range []string{"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
			"vllm:cache_config_info", "vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total",
			"vllm:prefix_cache_hits_total", "vllm:inter_token_latency_seconds", "process_start_time_seconds"} {
			if _, ok := ours[name]; !ok {
				t.Errorf("%s (read by kvroute) missing", name)
			}
		}
	})

	t.Run("sglang-metrics.txt", func(t *testing.T) {
		ours := parseMetrics(t, read(t, own, "sglang-metrics.txt"))
		// Our sample has the newer layout: its names are those of the old
		// full capture or of the newer fragment; HELP texts changed
		// between them.
		real := parseMetrics(t, read(t, shared, "sglang-metrics.txt"))
		for name, mf := range parseMetrics(t, read(t, shared, "sglang-metrics-new-fragment.txt")) {
			real[name] = mf
		}
		for name, mf := range ours {
			rf, ok := real[name]
			if !ok {
				t.Errorf("%s is not in the captures", name)
				continue
			}
			sameFamily(t, mf, rf, false)
		}
	})
}

// wireEventsIn returns the JSON data events of an SSE capture, skipping
// the author's "..." elisions and [DONE].
func wireEventsIn(t *testing.T, b []byte) [][]byte {
	t.Helper()
	var out [][]byte
	for _, line := range strings.Split(string(b), "\n") {
		if data, ok := strings.CutPrefix(line, "data: "); ok && data != "[DONE]" {
			out = append(out, []byte(data))
		}
	}
	return out
}

// sameKeys fails unless the JSON values ours and real have the same keys
// in every object both have at the same path (the first element standing
// for an array); a null on either side (an optional object) is not
// compared.
func sameKeys(t *testing.T, path string, ours, real any) {
	t.Helper()
	switch r := real.(type) {
	case map[string]any:
		o, ok := ours.(map[string]any)
		if !ok {
			if ours != nil {
				t.Errorf("%s: %T, the capture has an object", path, ours)
			}
			return
		}
		var ok1, rk []string
		for k := range o {
			ok1 = append(ok1, k)
		}
		for k := range r {
			rk = append(rk, k)
		}
		slices.Sort(ok1)
		slices.Sort(rk)
		if !slices.Equal(ok1, rk) {
			t.Errorf("%s: keys %v, the capture's %v", path, ok1, rk)
			return
		}
		for k := range r {
			sameKeys(t, path+"."+k, o[k], r[k])
		}
	case []any:
		o, ok := ours.([]any)
		if ok && len(o) > 0 && len(r) > 0 {
			sameKeys(t, path+"[0]", o[0], r[0])
		}
	}
}

// sameFamily fails unless two metric families have the same type, label
// names and histogram buckets, and with help, the same HELP.
func sameFamily(t *testing.T, ours, real *dto.MetricFamily, help bool) {
	t.Helper()
	name := ours.GetName()
	if ours.GetType() != real.GetType() {
		t.Errorf("%s type %v, the capture's %v", name, ours.GetType(), real.GetType())
	}
	if help && ours.GetHelp() != real.GetHelp() {
		t.Errorf("%s help %q, the capture's %q", name, ours.GetHelp(), real.GetHelp())
	}
	labels := func(mf *dto.MetricFamily) []string {
		var out []string
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if !slices.Contains(out, l.GetName()) {
					out = append(out, l.GetName())
				}
			}
		}
		slices.Sort(out)
		return out
	}
	if have, want := labels(ours), labels(real); !slices.Equal(have, want) && (help || !slices.Contains(have, "engine_type")) {
		t.Errorf("%s labels %v, the capture's %v", name, have, want)
	}
	if ours.GetType() == dto.MetricType_HISTOGRAM && len(ours.GetMetric()) > 0 && len(real.GetMetric()) > 0 {
		bounds := func(mf *dto.MetricFamily) []float64 {
			var out []float64
			for _, b := range mf.GetMetric()[0].GetHistogram().GetBucket() {
				out = append(out, b.GetUpperBound())
			}
			return out
		}
		if have, want := bounds(ours), bounds(real); !slices.Equal(have, want) {
			t.Errorf("%s buckets %v, the capture's %v", name, have, want)
		}
	}
}
