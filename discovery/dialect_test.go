package discovery

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// engineServer is a loopback model server speaking one dialect, from the
// fixtures under testdata/dialects. Its dialect may change while it runs
// (another engine on the same address); it counts the requests per path.
type engineServer struct {
	*httptest.Server
	kind    atomic.Uint32 // a Dialect
	metrics atomic.Bool   // llama.cpp's --metrics
	// versionDelay holds Ollama's /api/version answers (nanoseconds).
	versionDelay atomic.Int64
	fixtures     map[string][]byte
	mu           sync.Mutex
	hits         map[string]int
}

// startEngine serves dialect d until the test ends; metrics says whether
// a llama.cpp server was started with --metrics.
func startEngine(t *testing.T, d Dialect, metrics bool) *engineServer {
	t.Helper()
	s := &engineServer{fixtures: map[string][]byte{}, hits: map[string]int{}}
	names, err := filepath.Glob(filepath.Join("testdata", "dialects", "*"))
	if err != nil || len(names) == 0 {
		t.Fatalf("no fixtures under testdata/dialects: %v", err)
	}
	for _, n := range names {
		b, err := os.ReadFile(n)
		if err != nil {
			t.Fatal(err)
		}
		s.fixtures[filepath.Base(n)] = b
	}
	s.kind.Store(uint32(d))
	s.metrics.Store(metrics)
	s.Server = httptest.NewServer(http.HandlerFunc(s.serve))
	t.Cleanup(s.Close)
	return s
}

// hit returns the requests for path so far.
func (s *engineServer) hit(path string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.hits[path]
}

func (s *engineServer) serve(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	s.hits[r.URL.Path]++
	s.mu.Unlock()
	d := Dialect(s.kind.Load())
	send := func(status int, ctype string, body []byte) {
		w.Header().Set("Content-Type", ctype)
		w.WriteHeader(status)
		_, _ = w.Write(body)
	}
	fixture := func(name string) []byte { return s.fixtures[d.String()+"-"+name] }
	const js, text = "application/json", "text/plain; version=0.0.4"
	switch d {
	case DialectLlamaCpp:
		w.Header().Set("Server", "llama.cpp") // on every answer, as llama-server
		switch r.URL.Path {
		case "/health":
			send(200, js, []byte(`{"status":"ok"}`))
		case "/props":
			p := fixture("props.json")
			if !s.metrics.Load() {
				p = bytes.Replace(p, []byte(`"endpoint_metrics":true`), []byte(`"endpoint_metrics":false`), 1)
			}
			send(200, js, p)
		case "/v1/models":
			send(200, js, fixture("models.json"))
		case "/metrics":
			if s.metrics.Load() {
				send(200, text, fixture("metrics.txt"))
			} else {
				send(501, js, []byte(`{"error":{"code":501,"message":"This server does not support metrics endpoint. Start it with `+"`--metrics`"+`","type":"not_supported_error"}}`))
			}
		default:
			send(404, js, []byte(`{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}`))
		}
	case DialectOllama:
		switch r.URL.Path {
		case "/":
			send(200, "text/plain; charset=utf-8", []byte("Ollama is running"))
		case "/api/version":
			time.Sleep(time.Duration(s.versionDelay.Load()))
			send(200, js, []byte(`{"version":"0.24.0"}`))
		case "/v1/models":
			send(200, js, fixture("models.json"))
		case "/api/ps":
			send(200, js, fixture("ps.json"))
		default:
			send(404, "text/plain", []byte("404 page not found"))
		}
	default: // vLLM, SGLang
		switch r.URL.Path {
		case "/health":
			send(200, js, nil)
		case "/v1/models":
			send(200, js, fixture("models.json"))
		case "/metrics":
			send(200, text, fixture("metrics.txt"))
		default:
			send(404, js, []byte(`{"detail":"Not Found"}`))
		}
	}
}

// dialectOptions probes, scrapes and reads models every few milliseconds.
func dialectOptions() Options {
	return Options{
		Health: HealthConfig{Interval: 5 * time.Millisecond, Timeout: time.Second, Jitter: 0.01},
		Scrape: ScrapeConfig{Interval: 5 * time.Millisecond, Timeout: time.Second, StaleAfter: time.Minute},
		Models: ModelsConfig{Interval: 5 * time.Millisecond, Timeout: time.Second},
	}
}

// statusOf returns e's introspection.
func statusOf(f *Fleet, e *Endpoint) EndpointStatus { return f.status(e, time.Now()) }

// TestDetectDialects: with default flags each dialect is detected, stays
// up through several probe rounds (Ollama has no /health), states what it
// can (slots, context), is scraped when it has metrics and left alone
// when not (no failed scrape), and matches model names its own way.
func TestDetectDialects(t *testing.T) {
	cases := []struct {
		name    string
		dialect Dialect
		metrics bool
		// wantMetrics is EndpointStatus.Metrics; engine the scraped
		// EngineStats.Engine ("" for none).
		wantMetrics, engine string
		slots, context      int
		serves              map[string]bool
	}{
		{name: "vllm", dialect: DialectVLLM, wantMetrics: "scraped", engine: "vllm",
			serves: map[string]bool{"meta-llama/Llama-3.1-8B-Instruct": true, "meta-llama/llama-3.1-8b-instruct": false}},
		{name: "sglang", dialect: DialectSGLang, wantMetrics: "scraped", engine: "sglang",
			serves: map[string]bool{"qwen/qwen2.5-7b": true, "tiny": false}},
		{name: "llama.cpp with --metrics", dialect: DialectLlamaCpp, metrics: true, wantMetrics: "scraped", engine: "llamacpp",
			slots: 4, context: 8192, serves: map[string]bool{"tiny": true, "gpt-4o": true}},
		{name: "llama.cpp without --metrics", dialect: DialectLlamaCpp, wantMetrics: "absent",
			slots: 4, context: 8192, serves: map[string]bool{"anything": true}},
		{name: "ollama", dialect: DialectOllama, wantMetrics: "absent", context: 4096,
			serves: map[string]bool{"tiny": true, "TINY": true, "tiny:latest": true, "library/tiny": true, "tiny:7b": false, "nope": false}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			srv := startEngine(t, tc.dialect, tc.metrics)
			f, rec, eps := staticFleet(t, dialectOptions(), srv.URL)
			e := eps[0]
			run(t, f)
			rec.until(t, "detected, models and capacity read, metrics settled", func() bool {
				info := e.Info()
				return e.Dialect() == tc.dialect && e.Models() != nil &&
					(tc.context == 0 || info != nil && info.ContextTokens == tc.context) &&
					statusOf(f, e).Metrics == tc.wantMetrics
			})
			from := rec.mark()
			rec.wait(t, from, "probe-ok", e, 3)
			if tc.engine != "" {
				rec.wait(t, from, "scrape", e, 2)
			}
			st := statusOf(f, e)
			if st.State != StateUp || !st.Routable {
				t.Errorf("state %v routable %v, want up", st.State, st.Routable)
			}
			if n := rec.count(0, "probe-fail", e) + rec.count(0, "scrape-fail", e); n != 0 {
				t.Errorf("%d failed probes or scrapes, want none", n)
			}
			if st.Dialect != tc.dialect {
				t.Errorf("status dialect %v, want %v", st.Dialect, tc.dialect)
			}
			if tc.slots != 0 && (st.Info == nil || st.Info.Slots != tc.slots || st.Info.KVCapacityTokens != tc.context) {
				t.Errorf("engine info %+v, want %d slots, %d tokens", st.Info, tc.slots, tc.context)
			}
			switch eng := e.Engine(); {
			case tc.engine == "" && eng != nil:
				t.Errorf("engine stats %+v from an engine without metrics", eng)
			case tc.engine != "" && (eng == nil || eng.Engine != tc.engine):
				t.Errorf("engine stats %+v, want engine %q", eng, tc.engine)
			}
			for m, want := range tc.serves {
				if got := e.Serves(m); got != want {
					t.Errorf("Serves(%q) = %v, want %v", m, got, want)
				}
			}
		})
	}
}

// TestOllamaNeverProbedOnHealth: once detected, Ollama is probed on
// /api/version; its /health (404) was asked once, by detection.
func TestOllamaNeverProbedOnHealth(t *testing.T) {
	srv := startEngine(t, DialectOllama, false)
	f, rec, eps := staticFleet(t, dialectOptions(), srv.URL)
	e := eps[0]
	run(t, f)
	rec.wait(t, 0, "probe-ok", e, 5)
	if n := srv.hit("/health"); n != 1 {
		t.Errorf("/health asked %d times, want once (detection)", n)
	}
	if n := srv.hit("/metrics"); n > 1 {
		t.Errorf("/metrics asked %d times, want at most once (before detection)", n)
	}
	if rec.count(0, "probe-unserved", e) != 0 || rec.count(0, "detect", e) != 1 {
		t.Errorf("unserved %d, detections %d: want 0, 1", rec.count(0, "probe-unserved", e), rec.count(0, "detect", e))
	}
}

// TestOllamaListWaitsForDialect: an Ollama server whose /api/version is
// slow to answer (detection waits on it) while /v1/models answers at once
// serves "tiny" all along: its list ("tiny:latest") is not matched by
// another dialect's rules before its own is known. (Read first and matched
// exactly, a request that came as the router started got 404.)
func TestOllamaListWaitsForDialect(t *testing.T) {
	srv := startEngine(t, DialectOllama, false)
	srv.versionDelay.Store(int64(200 * time.Millisecond))
	f, _, eps := staticFleet(t, dialectOptions(), srv.URL)
	e := eps[0]
	run(t, f)
	deadline := time.Now().Add(10 * time.Second) // a deadlock guard
	for e.Dialect() != DialectOllama || e.Models() == nil {
		if !e.Serves("tiny") {
			t.Fatalf("refused tiny with dialect %v and list %+v", e.Dialect(), e.Models())
		}
		if time.Now().After(deadline) {
			t.Fatalf("dialect %v, list %+v", e.Dialect(), e.Models())
		}
		time.Sleep(time.Millisecond)
	}
	if !e.Serves("tiny") || !e.Serves("TINY") || e.Serves("other") {
		t.Errorf("after detection: tiny %v, TINY %v, other %v", e.Serves("tiny"), e.Serves("TINY"), e.Serves("other"))
	}
}

// TestRedetectOnNewEngine: an Ollama server replaces a vLLM one on the
// same address: the 404 on /health is no outage, and the endpoint is
// detected again and then probed on /api/version.
func TestRedetectOnNewEngine(t *testing.T) {
	srv := startEngine(t, DialectVLLM, false)
	f, rec, eps := staticFleet(t, dialectOptions(), srv.URL)
	f.redetectEvery = 0
	e := eps[0]
	run(t, f)
	rec.wait(t, 0, "detect", e, 1) // by the probe (scraping may tell the dialect first)
	if e.Dialect() != DialectVLLM {
		t.Fatalf("detected %v, want vllm", e.Dialect())
	}
	srv.kind.Store(uint32(DialectOllama))
	rec.until(t, "ollama detected, its names served", func() bool {
		return e.Dialect() == DialectOllama && e.Serves("TINY")
	})
	from := rec.mark()
	rec.wait(t, from, "probe-ok", e, 3)
	if rec.count(0, "probe-fail", e) != 0 || e.State() != StateUp {
		t.Errorf("failed probes %d, state %v: the 404 was counted as an outage", rec.count(0, "probe-fail", e), e.State())
	}
	if rec.count(0, "probe-unserved", e) == 0 {
		t.Error("no unserved probe seen")
	}
}

// TestPinnedDialect: --engine-dialect skips detection; --health-path is
// every endpoint's probe path whatever the dialect.
func TestPinnedDialect(t *testing.T) {
	t.Run("pinned ollama", func(t *testing.T) {
		srv := startEngine(t, DialectOllama, false)
		o := dialectOptions()
		o.Dialect = DialectOllama
		f, rec, eps := staticFleet(t, o, srv.URL)
		e := eps[0]
		if e.Dialect() != DialectOllama {
			t.Fatalf("dialect %v before Run, want ollama", e.Dialect())
		}
		run(t, f)
		rec.wait(t, 0, "probe-ok", e, 3)
		rec.until(t, "context read", func() bool { return e.Info() != nil })
		if n := srv.hit("/health"); n != 0 || rec.count(0, "detect", nil) != 0 {
			t.Errorf("/health asked %d times, %d detections: want none", n, rec.count(0, "detect", nil))
		}
	})
	t.Run("explicit health path", func(t *testing.T) {
		srv := startEngine(t, DialectOllama, false)
		o := dialectOptions()
		o.Health.Path = "/"
		f, rec, eps := staticFleet(t, o, srv.URL)
		e := eps[0]
		run(t, f)
		rec.wait(t, 0, "probe-ok", e, 3)
		if srv.hit("/") < 3 || srv.hit("/api/version") > 1 || e.Dialect() != DialectOllama {
			t.Errorf("probes: / %d, /api/version %d, dialect %v: want / probed, the dialect detected",
				srv.hit("/"), srv.hit("/api/version"), e.Dialect())
		}
	})
}

func TestParseDialect(t *testing.T) {
	for in, want := range map[string]Dialect{"": DialectUnknown, "auto": DialectUnknown, "vllm": DialectVLLM,
		"SGLang": DialectSGLang, "llamacpp": DialectLlamaCpp, "llama.cpp": DialectLlamaCpp, "ollama": DialectOllama} {
		if d, err := ParseDialect(in); err != nil || d != want {
			t.Errorf("ParseDialect(%q) = %v, %v; want %v", in, d, err, want)
		}
		if want != DialectUnknown {
			if d, _ := ParseDialect(want.String()); d != want {
				t.Errorf("%v does not round-trip", want)
			}
		}
	}
	if _, err := ParseDialect("tgi"); err == nil {
		t.Error("ParseDialect(tgi): no error")
	}
}

func TestOllamaName(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{in: "tiny", want: "registry.ollama.ai/library/tiny:latest"},
		{in: "TINY", want: "registry.ollama.ai/library/tiny:latest"},
		{in: "tiny:latest", want: "registry.ollama.ai/library/tiny:latest"},
		{in: "library/tiny", want: "registry.ollama.ai/library/tiny:latest"},
		{in: "registry.ollama.ai/library/tiny:latest", want: "registry.ollama.ai/library/tiny:latest"},
		{in: "Tiny:Latest@sha256:abc", want: "registry.ollama.ai/library/tiny:latest"},
		{in: "tiny:7b", want: "registry.ollama.ai/library/tiny:7b"},
		{in: "me/tiny", want: "registry.ollama.ai/me/tiny:latest"},
		{in: "localhost:5000/me/tiny", want: "localhost:5000/me/tiny:latest"},
	} {
		if got := ollamaName(c.in); got != c.want {
			t.Errorf("ollamaName(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

// TestModelsPerDialect: Set.Models lists one entry per Ollama model
// however many servers list it, and vLLM's exact names beside it; a set
// serves a model when one endpoint's dialect accepts the name.
func TestModelsPerDialect(t *testing.T) {
	var set Set
	for i, id := range []string{"tiny:latest", "tiny:latest", "TINY:latest", "library/tiny"} {
		e, _ := NewEndpoint("10.0.0."+string(rune('1'+i))+":11434", RoleMixed)
		e.SetDialect(DialectOllama)
		e.SetModels([]Model{{ID: id}})
		set.Serving = append(set.Serving, e)
	}
	v, _ := NewEndpoint("10.0.1.1:8000", RoleMixed)
	v.SetDialect(DialectVLLM)
	v.SetModels([]Model{{ID: "tiny"}, {ID: "Tiny"}})
	set.Serving = append(set.Serving, v)
	list, ok := set.Models()
	var ids []string
	for _, m := range list {
		ids = append(ids, m.ID)
	}
	if !ok || len(ids) != 3 || ids[0] != "tiny:latest" || ids[1] != "tiny" || ids[2] != "Tiny" {
		t.Errorf("Set.Models = %q, want [tiny:latest tiny Tiny]", ids)
	}
	if !set.Serves("TINY") || !set.Serves("tiny:latest") || set.Serves("tiny:7b") {
		t.Error("Set.Serves: TINY and tiny:latest served by Ollama, tiny:7b by none")
	}
	if v.Serves("TINY") {
		t.Error("vLLM matched TINY: its names are exact")
	}
	l, _ := NewEndpoint("10.0.2.1:8080", RoleMixed)
	l.SetDialect(DialectLlamaCpp)
	l.SetModels([]Model{{ID: "tiny"}})
	if !l.Serves("gpt-4o") {
		t.Error("llama.cpp refused a model name: it serves any")
	}
}

func TestParseLlamaCppMetrics(t *testing.T) {
	text, err := os.ReadFile(filepath.Join("testdata", "dialects", "llamacpp-metrics.txt"))
	if err != nil {
		t.Fatal(err)
	}
	s, _, err := parseEngine(text, nil)
	if err != nil {
		t.Fatal(err)
	}
	want := EngineStats{Engine: "llamacpp", Running: 3, Waiting: 2, PromptTokens: 1234, ITLSum: 0.8, ITLCount: 400}
	if s != want {
		t.Errorf("parsed %+v, want %+v", s, want)
	}
}

func TestParseEngineInfo(t *testing.T) {
	props, err := os.ReadFile(filepath.Join("testdata", "dialects", "llamacpp-props.json"))
	if err != nil {
		t.Fatal(err)
	}
	if i, ok := parseProps(props); !ok || i.Slots != 4 || i.ContextTokens != 8192 || i.KVCapacityTokens != 8192 || i.Metrics == nil || !*i.Metrics {
		t.Errorf("parseProps = %+v, %v", i, ok)
	}
	if _, ok := parseProps([]byte(`{"version":"0.24.0"}`)); ok {
		t.Error("parseProps took a non-llama.cpp answer")
	}
	ps, err := os.ReadFile(filepath.Join("testdata", "dialects", "ollama-ps.json"))
	if err != nil {
		t.Fatal(err)
	}
	if i, ok := parsePS(ps); !ok || i.ContextTokens != 4096 || i.Slots != 0 {
		t.Errorf("parsePS = %+v, %v", i, ok)
	}
	if i, ok := parsePS([]byte(`{"models":[]}`)); !ok || i.ContextTokens != 0 {
		t.Errorf("parsePS(no model loaded) = %+v, %v", i, ok)
	}
}

func FuzzOllamaName(f *testing.F) {
	for _, s := range []string{"tiny", "TINY:latest", "library/tiny", "a/b/c/d:e@sha256:f", "", ":", "/"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		c := ollamaName(s)
		if ollamaName(c) != c {
			t.Errorf("ollamaName not idempotent: %q -> %q -> %q", s, c, ollamaName(c))
		}
	})
}

func FuzzParseEngineInfo(f *testing.F) {
	f.Add([]byte(`{"total_slots":4,"default_generation_settings":{"n_ctx":8192},"endpoint_metrics":true}`))
	f.Add([]byte(`{"models":[{"context_length":4096}]}`))
	f.Add([]byte(`{"total_slots":-1,"default_generation_settings":{"n_ctx":-5}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, parse := range []func([]byte) (*EngineInfo, bool){parseProps, parsePS} {
			if i, ok := parse(b); ok && (i.Slots < 0 || i.ContextTokens < 0 || i.KVCapacityTokens < 0) {
				t.Errorf("negative capacity %+v", i)
			}
		}
	})
}
