package discovery

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

func readFixture(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "testdata", "metrics", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// sharedSample reads a file of shared/vllm-wire (the real captures) when
// the checkout has it, else returns nil.
func sharedSample(name string) []byte {
	for _, dir := range []string{"../../shared/vllm-wire", "../shared/vllm-wire"} {
		if b, err := os.ReadFile(filepath.Join(dir, name)); err == nil {
			return b
		}
	}
	return nil
}

// readWire reads a file of the module's own wire samples, testdata/wire.
func readWire(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "testdata", "wire", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestParseEngine(t *testing.T) {
	for _, tc := range []struct {
		name    string
		text    func(t *testing.T) []byte
		want    EngineStats
		wantErr error
	}{
		{
			name: "vLLM V1, two DP engines",
			text: func(t *testing.T) []byte { return readFixture(t, "vllm-v1-dp2.txt") },
			want: EngineStats{Engine: "vllm", Running: 7, Waiting: 3, KVUsage: 0.5, KVCapacityTokens: 255200,
				PromptTokens: 4600, PrefixQueries: 4000, PrefixHits: 2000, StartTime: 1.77775786492e+09,
				ITLSum: 20, ITLCount: 1600}, // summed over the engines: 12.5 ms a token
		},
		{
			name: "vLLM V0, old KV name",
			text: func(t *testing.T) []byte { return readFixture(t, "vllm-v0.txt") },
			want: EngineStats{Engine: "vllm", Running: 2, Waiting: 5, KVUsage: 0.4, KVCapacityTokens: 37440, PromptTokens: 14},
		},
		{
			name: "SGLang",
			text: func(t *testing.T) []byte { return readFixture(t, "sglang.txt") },
			want: EngineStats{Engine: "sglang", Running: 162, Waiting: 2826, KVUsage: 0.28,
				PromptTokens: 8.128902e+06, PrefixQueries: 8.128902e+06},
		},
		{
			name: "SGLang, two DP ranks",
			text: func(t *testing.T) []byte { return readFixture(t, "sglang-dp2.txt") },
			want: EngineStats{Engine: "sglang", Running: 12, Waiting: 3, KVUsage: 0.2,
				PromptTokens: 10752, PrefixQueries: 10752, PrefixHits: 2688},
		},
		{
			name:    "not an engine",
			text:    func(t *testing.T) []byte { return readFixture(t, "not-an-engine.txt") },
			wantErr: ErrNoEngineMetrics,
		},
		{
			name:    "empty",
			text:    func(*testing.T) []byte { return nil },
			wantErr: ErrNoEngineMetrics,
		},
		{
			name:    "garbled value of a read family",
			text:    func(*testing.T) []byte { return []byte("vllm:num_requests_running{a=\"b\"} many\n") },
			wantErr: ErrBadMetrics,
		},
		{
			name: "no trailing newline, KV usage clamped, NaN skipped",
			text: func(*testing.T) []byte {
				return []byte("vllm:num_requests_waiting 2\nvllm:num_requests_running NaN\nvllm:kv_cache_usage_perc 1.5")
			},
			want: EngineStats{Engine: "vllm", Waiting: 2, KVUsage: 1},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, _, err := parseEngine(tc.text(t), nil)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("err = %v, want %v", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("got  %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

// TestParseFullScrapes: whole scrapes of each engine and layout, every
// family an engine exports and not only the ones kvroute reads: the
// module's own samples always, and the real captures of the same shapes
// when the checkout has shared/vllm-wire.
func TestParseFullScrapes(t *testing.T) {
	for _, tc := range []struct {
		name string
		// own is the module's sample, shared the real capture's name.
		own          func(t *testing.T) []byte
		shared       string
		want, wantSh EngineStats
	}{
		{
			name: "vLLM V1 (0.19)", own: func(t *testing.T) []byte { return readWire(t, "vllm-metrics.txt") },
			want: EngineStats{Engine: "vllm", Running: 5, Waiting: 2, KVUsage: 0.4375, KVCapacityTokens: 16 * 28672,
				PromptTokens: 262144, PrefixQueries: 262144, PrefixHits: 196608, StartTime: 1.76421512305e+09,
				ITLSum: 572.8, ITLCount: 45824},
			shared: "vllm-metrics.txt",
			wantSh: EngineStats{Engine: "vllm", KVCapacityTokens: 16 * 7975, PromptTokens: 115898,
				PrefixQueries: 115898, PrefixHits: 101440, StartTime: 1.77775786492e+09,
				ITLSum: 412.552094290033, ITLCount: 17571}, // vllm:inter_token_latency_seconds
		},
		{
			name: "vLLM V0 (0.9)", own: func(t *testing.T) []byte { return readFixture(t, "vllm-v0.txt") },
			want:   EngineStats{Engine: "vllm", Running: 2, Waiting: 5, KVUsage: 0.4, KVCapacityTokens: 37440, PromptTokens: 14},
			shared: "vllm-metrics-old.txt",
			wantSh: EngineStats{Engine: "vllm", KVCapacityTokens: 16 * 2340, PromptTokens: 14,
				ITLSum: 2.254702091217041, ITLCount: 106}, // vllm:time_per_output_token_seconds
		},
		{
			name: "SGLang", own: func(t *testing.T) []byte { return readWire(t, "sglang-metrics.txt") },
			want: EngineStats{Engine: "sglang", Running: 24, Waiting: 7, KVUsage: 0.61,
				PromptTokens: 1048576, PrefixQueries: 1048576, PrefixHits: 524288,
				ITLSum: 81.92, ITLCount: 4096}, // sglang:time_per_output_token_seconds
			shared: "sglang-metrics.txt",
			wantSh: EngineStats{Engine: "sglang", Running: 162, Waiting: 2826, KVUsage: 0.28,
				PromptTokens: 8.128902e+06, PrefixQueries: 8.128902e+06,
				ITLSum: 866964.5791549598, ITLCount: 7.400757e+06},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			check := func(t *testing.T, text []byte, want EngineStats) {
				got, _, err := parseEngine(text, nil)
				if err != nil {
					t.Fatal(err)
				}
				if got != want {
					t.Errorf("got  %+v\nwant %+v", got, want)
				}
			}
			t.Run("testdata", func(t *testing.T) { check(t, tc.own(t), tc.want) })
			if b := sharedSample(tc.shared); b != nil {
				t.Run("shared", func(t *testing.T) { check(t, b, tc.wantSh) })
			}
		})
	}
}

// metricsPod serves a /metrics text that tests replace.
type metricsPod struct {
	*httptest.Server
	mu     sync.Mutex
	text   []byte
	status int
	// during, when set, runs while a request is being answered.
	during func(r *http.Request)
}

func startMetricsPod(t *testing.T, text []byte) *metricsPod {
	t.Helper()
	p := &metricsPod{text: text, status: http.StatusOK}
	p.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.during != nil {
			p.during(r)
		}
		w.WriteHeader(p.status)
		_, _ = w.Write(p.text)
	}))
	t.Cleanup(p.Close)
	return p
}

func (p *metricsPod) serve(status int, text []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.status, p.text = status, text
}

// TestScrape runs the scraper against a loopback pod: values and capacity
// arrive, restarts call the hook, stale values are withdrawn.
func TestScrape(t *testing.T) {
	base := readFixture(t, "vllm-v1-dp2.txt")
	p := startMetricsPod(t, base)
	restarts := make(chan *Endpoint, 8)
	capacity := make(chan int, 8)
	o := Options{
		Health:     HealthConfig{Disabled: true},
		Scrape:     ScrapeConfig{Interval: 5 * time.Millisecond, StaleAfter: 30 * time.Millisecond, Jitter: 0.01},
		OnRestart:  func(e *Endpoint) { restarts <- e },
		OnCapacity: func(_ *Endpoint, tokens int) { capacity <- tokens },
	}
	f, rec, eps := staticFleet(t, o, p.URL)
	e := eps[0]
	run(t, f)
	rec.wait(t, 0, "scrape", e, 1)

	s := e.Engine()
	if s == nil || s.Running != 7 || s.Waiting != 3 || s.KVUsage != 0.5 || s.At.IsZero() {
		t.Fatalf("Engine() = %+v", s)
	}
	if got := recv(t, capacity, "OnCapacity"); got != 255200 {
		t.Errorf("OnCapacity(%d), want 255200", got)
	}

	for _, tc := range []struct {
		name string
		text []byte
		// back: returning to the fixture is a restart too.
		back bool
	}{
		{name: "new process start time", back: true,
			text: bytes.Replace(base, []byte("process_start_time_seconds 1.77775786492e+09"), []byte("process_start_time_seconds 1.77775799e+09"), 1)},
		{name: "counters reset, same start time (start time not exported)",
			text: bytes.ReplaceAll(bytes.Replace(base, []byte("process_start_time_seconds 1.77775786492e+09\n"), nil, 1),
				[]byte("} 3400.0"), []byte("} 10.0")), back: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := rec.mark()
			p.serve(http.StatusOK, tc.text)
			select {
			case got := <-restarts:
				if got != e {
					t.Fatalf("OnRestart(%s)", got.URL)
				}
			case <-time.After(waitTimeout):
				t.Fatal("restart not detected")
			}
			// The forgotten engine's capacity counts anew (the index
			// resizes its LRU after OnRestart dropped it).
			if got := recv(t, capacity, "OnCapacity after the restart"); got != 255200 {
				t.Errorf("OnCapacity(%d) after the restart, want 255200", got)
			}
			rec.wait(t, m, "scrape", e, 3)
			if n := rec.count(m, "restart", e); n != 1 {
				t.Errorf("%d restart events for one restart", n)
			}
			m = rec.mark()
			p.serve(http.StatusOK, base)
			if tc.back {
				recv(t, restarts, "OnRestart on the return to the fixture")
				recv(t, capacity, "OnCapacity on the return to the fixture")
			}
			rec.wait(t, m, "scrape", e, 2)
		})
	}

	t.Run("capacity change", func(t *testing.T) {
		p.serve(http.StatusOK, bytes.ReplaceAll(base, []byte(`num_gpu_blocks="7975"`), []byte(`num_gpu_blocks="8000"`)))
		if got := recv(t, capacity, "OnCapacity after the change"); got != 2*16*8000 {
			t.Errorf("OnCapacity(%d), want %d", got, 2*16*8000)
		}
	})

	t.Run("stale values withdrawn", func(t *testing.T) {
		m := rec.mark()
		p.serve(http.StatusInternalServerError, nil)
		rec.wait(t, m, "scrape-fail", e, 1)
		rec.until(t, "Engine() is nil", func() bool { return e.Engine() == nil })
		st := f.Endpoints()[0]
		if st.Engine == nil || st.Engine.Fresh || st.Engine.AgeSec <= 0 {
			t.Errorf("introspection engine = %+v, want the last scrape, not fresh, with its age", st.Engine)
		}
		if got := counterValue(t, f, "kvroute_discovery_scrape_failures_total"); got < 1 {
			t.Errorf("scrape failures counted %v", got)
		}
		p.serve(http.StatusOK, base)
		rec.until(t, "Engine() is back", func() bool { return e.Engine() != nil })
	})
}

// TestScrapeRoutedIsEveryRequestTheEngineMayCount: the engine's count
// is taken during the scrape, so this router's requests that end or begin
// while it is answered may be in it; none of them is another client's
// (Foreign). One that was counted and gone by the end of the scrape read
// as another client's request: a router alone, one request at a time,
// learned that it shared the fleet.
func TestScrapeRoutedIsEveryRequestTheEngineMayCount(t *testing.T) {
	running := func(n int) []byte {
		return []byte(fmt.Sprintf("vllm:num_requests_running{engine=\"0\",model_name=\"m\"} %d\nvllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0\n", n))
	}
	for _, tc := range []struct {
		name        string
		engine      int // requests the engine reports
		ends, start bool
		want        int64 // Foreign
	}{
		{name: "ours ended during the scrape", engine: 1, ends: true},
		{name: "ours began during the scrape", engine: 1, start: true},
		{name: "ours ended, another client's runs", engine: 2, ends: true, want: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startMetricsPod(t, running(tc.engine))
			o := Options{Health: HealthConfig{Disabled: true},
				Scrape: ScrapeConfig{Interval: time.Hour, StaleAfter: 2 * time.Hour, Jitter: 0.01}}
			f, rec, eps := staticFleet(t, o, p.URL)
			e := eps[0]
			var ours Lease
			if tc.ends {
				ours = e.Acquire(0)
			}
			scraped := make(chan struct{})
			p.mu.Lock()
			p.during = func(r *http.Request) {
				if r.URL.Path != "/metrics" || scraped == nil {
					return
				}
				if tc.ends {
					ours.Release()
				} else if tc.start {
					ours = e.Acquire(0)
				}
				close(scraped)
				scraped = nil
			}
			p.mu.Unlock()
			done := scraped
			run(t, f)
			recv(t, done, "the scrape")
			rec.wait(t, 0, "scrape", e, 1)
			s := e.Engine()
			if s == nil || s.Running != int64(tc.engine) {
				t.Fatalf("Engine() = %+v", s)
			}
			if got := s.Foreign(); got != tc.want {
				t.Errorf("Foreign() = %d (Routed %d), want %d", got, s.Routed, tc.want)
			}
			if tc.start {
				ours.Release()
			}
		})
	}
}

// parseWhole is expfmt over a whole scrape, without kvroute's line filter.
func parseWhole(text []byte) (int, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(text))
	return len(fams), err
}

func FuzzParseEngine(f *testing.F) {
	for _, name := range []string{"vllm-v1-dp2.txt", "vllm-v0.txt", "sglang.txt", "sglang-dp2.txt", "not-an-engine.txt"} {
		f.Add(readFixture(f, name))
	}
	f.Add([]byte("vllm:cache_config_info{block_size=\"1048575\",num_gpu_blocks=\"1099511627775\"} 1\n"))
	f.Add([]byte("sglang:token_usage -Inf\nsglang:num_queue_reqs 1e300\n"))
	var scratch []byte
	f.Fuzz(func(t *testing.T, text []byte) {
		s, sc, err := parseEngine(text, scratch)
		scratch = sc
		for _, line := range strings.SplitAfter(string(sc), "\n") {
			if line == "" {
				continue
			}
			n := strings.IndexAny(line, "{ \t\n")
			if n < 0 {
				n = len(line)
			}
			if !wanted([]byte(line[:n])) {
				t.Fatalf("filter kept %q", line)
			}
		}
		if err != nil {
			if s.Engine != "" && !errors.Is(err, ErrBadMetrics) && !errors.Is(err, ErrNoEngineMetrics) {
				t.Fatalf("unexpected error %v", err)
			}
			return
		}
		if s.Engine != "vllm" && s.Engine != "sglang" {
			t.Fatalf("engine %q without error", s.Engine)
		}
		if s.Running < 0 || s.Waiting < 0 || s.KVCapacityTokens < 0 || !(s.KVUsage >= 0 && s.KVUsage <= 1) {
			t.Fatalf("out of range: %+v", s)
		}
	})
}

// BenchmarkParseEngine parses one full vLLM scrape (the shared 0.19 sample
// when present, else the module's own of the same shape), with the line
// filter kvroute uses and, for comparison, expfmt over the whole text.
func BenchmarkParseEngine(b *testing.B) {
	text := sharedSample("vllm-metrics.txt")
	if text == nil {
		text = readWire(b, "vllm-metrics.txt")
	}
	b.Run("filtered", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(text)))
		var scratch []byte
		for b.Loop() {
			var err error
			if _, scratch, err = parseEngine(text, scratch); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("expfmt-whole-text", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(text)))
		for b.Loop() {
			if _, err := parseWhole(text); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// vllm:lora_requests_info: the latest series (the highest value, the time
// it was set) gives the adapter slots; vLLM keeps earlier label sets as
// stale series, and max_lora 0 (LoRA off) gives none.
func TestParseLoRASlots(t *testing.T) {
	text := []byte(`# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql-lora",waiting_lora_adapters=""} 1.7640001e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql-lora,chat-lora",waiting_lora_adapters="math-lora"} 1.7640003e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7640002e+09
vllm:num_requests_running{engine="0",model_name="m"} 3
`)
	got, _, err := parseEngine(text, nil)
	if err != nil {
		t.Fatal(err)
	}
	want := LoRAStats{MaxLoRAs: 2, Running: []string{"sql-lora", "chat-lora"}, Waiting: []string{"math-lora"}}
	if got.LoRA == nil || !reflect.DeepEqual(*got.LoRA, want) {
		t.Fatalf("LoRA slots %+v, want %+v", got.LoRA, want)
	}
	off := []byte("vllm:lora_requests_info{max_lora=\"0\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1.7e+09\nvllm:num_requests_running 1\n")
	if got, _, err := parseEngine(off, nil); err != nil || got.LoRA != nil {
		t.Fatalf("LoRA off: %+v, %v", got.LoRA, err)
	}
}
