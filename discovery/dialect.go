package discovery

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"go.uber.org/zap"
)

// Engine dialects. kvroute serves fleets of vLLM (and the llm-d simulator,
// which speaks vLLM), SGLang, llama.cpp's llama-server and Ollama with the
// same flags: each endpoint's dialect decides its liveness probe, how its
// model names match a request's, which /metrics names give its load and
// where it states its capacity. The dialect is detected by the Fleet, once
// per engine incarnation, beside the request path, from the first health
// probe's answer (or its own GET /health when probes are off):
//
//  1. GET /health. A "Server: llama.cpp" header (llama-server sets it on
//     every answer, 503 while loading included) means llamacpp.
//  2. A 404 or 405 there: GET /api/version; a JSON {"version": ...} means
//     ollama (Ollama has no /health).
//  3. A 200 from /health without that header: GET /v1/models; owned_by
//     "vllm", "sglang" or "llamacpp" names the engine.
//  4. Otherwise the dialect stays unknown (vLLM-like: /health, exact model
//     names), and the first scrape whose metric names are vLLM's, SGLang's
//     or llama.cpp's sets it.
//
// Beyond the probe, llama.cpp thus costs no request, Ollama and vLLM and
// SGLang one. An endpoint is detected again after it went down, when a
// scrape shows its engine restarted, and when its probe path starts
// answering 404 (at most once per redetectEvery). Options.Dialect pins
// one dialect for every endpoint (--engine-dialect): no detection then.

// Dialect is the kind of engine an endpoint runs. The zero value is
// DialectUnknown (also the "auto" of --engine-dialect).
type Dialect uint32

// Dialects.
const (
	DialectUnknown  Dialect = iota // not detected (yet): treated as vLLM
	DialectVLLM                    // vLLM, and the llm-d inference simulator
	DialectSGLang                  // SGLang
	DialectLlamaCpp                // llama.cpp's llama-server
	DialectOllama                  // Ollama
)

var dialectNames = [...]string{"unknown", "vllm", "sglang", "llamacpp", "ollama"}

// String returns the dialect's flag spelling ("unknown" for the zero
// value).
func (d Dialect) String() string {
	if int(d) < len(dialectNames) {
		return dialectNames[d]
	}
	return "unknown"
}

// Slotted reports whether the dialect's engines cache prompts per sequence
// slot (llama.cpp's server, Ollama's runner): a request whose prompt's slot
// is busy is computed afresh in another, where vLLM's and SGLang's paged
// caches share the prompt's blocks between requests.
func (d Dialect) Slotted() bool { return d == DialectLlamaCpp || d == DialectOllama }

// MarshalText makes Dialect a JSON string.
func (d Dialect) MarshalText() ([]byte, error) { return []byte(d.String()), nil }

// ParseDialect parses --engine-dialect: "auto" (or "") is DialectUnknown,
// which means detect; the other names are Dialect.String's.
func ParseDialect(s string) (Dialect, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "auto":
		return DialectUnknown, nil
	case "vllm":
		return DialectVLLM, nil
	case "sglang":
		return DialectSGLang, nil
	case "llamacpp", "llama.cpp", "llama-server":
		return DialectLlamaCpp, nil
	case "ollama":
		return DialectOllama, nil
	}
	return DialectUnknown, fmt.Errorf("%w: engine dialect %q: want auto, vllm, sglang, llamacpp or ollama", ErrBadConfig, s)
}

// Dialect returns e's engine dialect as detected or pinned;
// DialectUnknown until then. One atomic load; safe for concurrent use.
func (e *Endpoint) Dialect() Dialect { return Dialect(e.dialect.Load()) }

// SetDialect records e's dialect (a Fleet detects it; embedders and tests
// may set it). It does not stop a Fleet from detecting it again.
func (e *Endpoint) SetDialect(d Dialect) { e.dialect.Store(uint32(d)) }

// EngineInfo is what an engine says of itself outside its metrics: its
// version, its slots and its context, read on the models cadence from
// llama.cpp's /props and Ollama's /api/ps. Zero fields are unknown.
// Immutable once published.
type EngineInfo struct {
	// Version is the engine's version (Ollama's /api/version).
	Version string `json:"version,omitempty"`
	// Slots is the sequences the engine decodes at once (llama.cpp's
	// total_slots); unknown for Ollama (OLLAMA_NUM_PARALLEL is not
	// exposed).
	Slots int `json:"slots,omitempty"`
	// ContextTokens is one sequence's context in tokens: llama.cpp's
	// n_ctx (per slot), Ollama's context_length of its loaded model (the
	// largest when several are loaded; 0 before the first request loads
	// one).
	ContextTokens int `json:"context_tokens,omitempty"`
	// KVCapacityTokens is the KV cache's size in tokens: llama.cpp's
	// n_ctx, the whole unified cache its default -np auto shares among the
	// slots (with an explicit -np N the slots split -c evenly and n_ctx is
	// one slot's share, so this is a lower bound).
	//
	// It is shown, not fed to the prefix index (Options.OnCapacity) nor to
	// EngineStats.KVCapacityTokens: llama-server saves a slot's prompt to
	// its host-memory prompt cache (--cache-ram, 8 GiB by default, not
	// shown in /props) before overwriting it and restores it when a later
	// prompt matches, so it reuses far more than n_ctx tokens of prefixes,
	// and an index sized to n_ctx would forget prefixes the server still
	// restores cheaply; and the calibration reads a capacity together with
	// the KV usage, which llama.cpp does not report.
	KVCapacityTokens int `json:"kv_capacity_tokens,omitempty"`
	// Metrics is llama.cpp's endpoint_metrics: false when the server was
	// started without --metrics; nil when not stated.
	Metrics *bool `json:"metrics,omitempty"`
	// At is when it was read.
	At time.Time `json:"at"`
}

// Info returns what e's engine said of itself (EngineInfo); nil when
// nothing. One atomic load; safe for concurrent use.
func (e *Endpoint) Info() *EngineInfo { return e.info.Load() }

// Tuning of detection and of engines without metrics.
const (
	// redetectEvery bounds how often an endpoint whose probe path
	// answers 404 is detected again: an engine that serves neither
	// /health nor /api/version costs three requests per interval, not
	// per probe round.
	redetectEvery = 30 * time.Second
	// metricsRecheck is how long the scraper leaves alone an engine that
	// answered its /metrics with 404, 405 or 501 (llama-server without
	// --metrics, Ollama) before asking again; re-detection asks at once.
	metricsRecheck = time.Minute
	// maxInfoBytes caps one /health, /props, /api/version or /api/ps
	// answer (llama.cpp's /props carries its chat template: a few KB).
	maxInfoBytes = 1 << 20
)

// healthPath returns the probe path for dialect d: HealthConfig.Path when
// set, else Ollama's /api/version and everyone else's /health.
func (f *Fleet) healthPath(d Dialect) string {
	switch {
	case f.o.Health.Path != "":
		return f.o.Health.Path
	case d == DialectOllama:
		return "/api/version"
	default:
		return DefaultHealthPath
	}
}

// ensureDetected detects e's dialect unless it is pinned, already detected
// for this incarnation, or being detected by another worker. health is the
// answer of GET /health when the caller has one, nil to ask.
func (f *Fleet) ensureDetected(ctx context.Context, e *Endpoint, health *answer) {
	if f.o.Dialect != DialectUnknown || e.detected.Load() || !e.detecting.CompareAndSwap(false, true) {
		return
	}
	defer e.detecting.Store(false)
	if health == nil {
		a := f.probeOnce(ctx, e.URL+DefaultHealthPath, f.o.Health.Timeout)
		health = &a
	}
	d, ok := f.detect(ctx, e, *health)
	if !ok {
		return // unreachable or busy: next round
	}
	e.detectedAt.Store(time.Now().UnixNano())
	e.detected.Store(true)
	e.noMetricsUntil.Store(0) // a new engine: ask its /metrics again
	old := e.Dialect()
	if d == DialectUnknown && old != DialectUnknown {
		d = old // detection found nothing new: keep what scraping told
	}
	e.SetDialect(d)
	if d != old {
		f.log.Info("engine dialect", zap.String("endpoint", e.URL), zap.Stringer("dialect", d), zap.Stringer("was", old))
		e.peakRunning.Store(0) // another engine: what the last one ran says nothing of it (seenLimit)
	}
	// What the engine serves and says of itself (llama.cpp's slots: its
	// room) now, not at the models loop's next round: its list waited for
	// the dialect (readModels).
	if f.o.Models.Disabled {
		f.readInfo(ctx, e)
	} else {
		f.readModels(ctx, e)
	}
	f.event("detect", e)
}

// detect runs the sequence of the package's Dialects note from health,
// the answer of GET /health; ok is false when the endpoint did not answer
// well enough to tell (try again later).
func (f *Fleet) detect(ctx context.Context, e *Endpoint, health answer) (d Dialect, ok bool) {
	status := health.status
	switch {
	case status == 0:
		return DialectUnknown, false
	case strings.HasPrefix(health.server, "llama.cpp"):
		return DialectLlamaCpp, true
	case status == http.StatusNotFound || status == http.StatusMethodNotAllowed:
		st, body, err := f.get(ctx, e.URL+"/api/version")
		var v struct {
			Version *string `json:"version"`
		}
		if err != nil || st != http.StatusOK {
			return DialectUnknown, err == nil
		}
		if json.Unmarshal(body, &v) == nil && v.Version != nil {
			e.info.Store(&EngineInfo{Version: *v.Version, At: time.Now()})
			return DialectOllama, true
		}
		return DialectUnknown, true
	case status != http.StatusOK:
		return DialectUnknown, false // vLLM dead or starting: ask again
	}
	st, body, err := f.get(ctx, e.URL+"/v1/models")
	if err != nil {
		return DialectUnknown, false
	}
	if st == http.StatusOK {
		var list struct {
			Data []struct {
				OwnedBy string `json:"owned_by"`
			} `json:"data"`
		}
		if json.Unmarshal(body, &list) == nil && len(list.Data) > 0 {
			switch list.Data[0].OwnedBy {
			case "vllm":
				return DialectVLLM, true
			case "sglang":
				return DialectSGLang, true
			case "llamacpp":
				return DialectLlamaCpp, true
			}
		}
	}
	return DialectUnknown, true
}

// get GETs url within the health timeout and returns the status and up to
// maxInfoBytes of the body.
func (f *Fleet) get(ctx context.Context, url string) (int, []byte, error) {
	ctx, cancel := context.WithTimeout(ctx, f.o.Health.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, nil, err
	}
	resp, err := f.client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxInfoBytes))
	if err != nil {
		return 0, nil, err
	}
	return resp.StatusCode, body, nil
}

// unserved handles a probe path that answered 404 or 405: the engine is
// alive and serves something else; it is detected again (at most once per
// redetectEvery), and nothing is counted.
func (f *Fleet) unserved(e *Endpoint) {
	if f.o.Dialect == DialectUnknown && time.Since(time.Unix(0, e.detectedAt.Load())) >= f.redetectEvery {
		e.detected.Store(false)
	}
	f.event("probe-unserved", e)
}

// readInfo reads what e's engine says of itself, per dialect: llama.cpp's
// /props (slots, context, whether /metrics is on), Ollama's /api/ps
// (loaded models' context). A failed read keeps the last.
func (f *Fleet) readInfo(ctx context.Context, e *Endpoint) {
	switch e.Dialect() {
	case DialectLlamaCpp:
		st, body, err := f.get(ctx, e.URL+"/props")
		if err != nil || st != http.StatusOK {
			return
		}
		if info, ok := parseProps(body); ok {
			if info.Metrics != nil && !*info.Metrics && e.noMetricsUntil.Load() == 0 {
				e.noMetricsUntil.Store(time.Now().Add(metricsRecheck).UnixNano())
			}
			f.setInfo(e, info)
		}
	case DialectOllama:
		st, body, err := f.get(ctx, e.URL+"/api/ps")
		if err != nil || st != http.StatusOK {
			return
		}
		if info, ok := parsePS(body); ok {
			if old := e.Info(); old != nil {
				info.Version = old.Version
			}
			f.setInfo(e, info)
		}
	}
}

// setInfo publishes info on e, and logs it when what it says changed.
func (f *Fleet) setInfo(e *Endpoint, info *EngineInfo) {
	info.At = time.Now()
	old := e.info.Swap(info)
	if old == nil || old.Slots != info.Slots || old.ContextTokens != info.ContextTokens {
		f.log.Info("engine capacity", zap.String("endpoint", e.URL), zap.Stringer("dialect", e.Dialect()),
			zap.Int("slots", info.Slots), zap.Int("context_tokens", info.ContextTokens), zap.Boolp("metrics", info.Metrics))
		f.event("info", e)
	}
}

// parseProps reads llama.cpp's GET /props: total_slots,
// default_generation_settings.n_ctx, endpoint_metrics. ok is false when
// it is not llama.cpp's.
func parseProps(body []byte) (*EngineInfo, bool) {
	var p struct {
		TotalSlots *int `json:"total_slots"`
		Defaults   struct {
			NCtx int `json:"n_ctx"`
		} `json:"default_generation_settings"`
		Metrics *bool `json:"endpoint_metrics"`
	}
	if json.Unmarshal(body, &p) != nil || p.TotalSlots == nil {
		return nil, false
	}
	clamp := func(n int) int { return min(max(n, 0), 1<<30) }
	n := clamp(p.Defaults.NCtx)
	return &EngineInfo{Slots: clamp(*p.TotalSlots), ContextTokens: n, KVCapacityTokens: n, Metrics: p.Metrics}, true
}

// parsePS reads Ollama's GET /api/ps: the largest context_length of the
// loaded models (0 when none is loaded). ok is false when it is not
// Ollama's.
func parsePS(body []byte) (*EngineInfo, bool) {
	var ps struct {
		Models *[]struct {
			ContextLength int `json:"context_length"`
		} `json:"models"`
	}
	if json.Unmarshal(body, &ps) != nil || ps.Models == nil {
		return nil, false
	}
	info := &EngineInfo{}
	for _, m := range *ps.Models {
		info.ContextTokens = max(info.ContextTokens, min(max(m.ContextLength, 0), 1<<30))
	}
	return info, true
}

// ollamaName returns Ollama's canonical form of a model name, as Ollama
// matches names: case-insensitive, host "registry.ollama.ai", namespace
// "library" and tag "latest" when absent, digest ("@sha256:...") dropped.
// So "tiny", "TINY", "tiny:latest", "library/tiny" and
// "registry.ollama.ai/library/tiny:latest" are one name.
func ollamaName(s string) string {
	s = strings.ToLower(strings.TrimSpace(s))
	if i := strings.IndexByte(s, '@'); i >= 0 {
		s = s[:i]
	}
	tag := "latest"
	slash := strings.LastIndexByte(s, '/')
	if i := strings.LastIndexByte(s, ':'); i > slash {
		s, tag = s[:i], s[i+1:]
	}
	host, ns := "registry.ollama.ai", "library"
	parts := strings.Split(s, "/")
	switch len(parts) {
	case 1:
	case 2:
		ns = parts[0]
	default:
		host, ns = strings.Join(parts[:len(parts)-2], "/"), parts[len(parts)-2]
	}
	return host + "/" + ns + "/" + parts[len(parts)-1] + ":" + tag
}
