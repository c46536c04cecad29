package discovery

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// Served models. Every endpoint's GET /v1/models (vLLM and SGLang answer
// it with the OpenAI model list: the served model names, and vLLM's loaded
// LoRA adapters with the base model as their "parent") is read on the
// health cadence, so that a request goes only to endpoints that serve its
// model: in a pool mid-upgrade, or with adapters loaded per pod, any other
// endpoint answers 404. An endpoint whose list is not known (not read yet,
// or an engine without the endpoint) is presumed to serve every model; a
// failed read keeps the last list read.
//
// Names match per dialect (dialect.go): exactly for vLLM and SGLang (a
// LoRA adapter's name is its own); as Ollama matches them for Ollama
// (ollamaName: "tiny", "TINY" and "library/tiny" are "tiny:latest"); and
// not at all for llama.cpp, whose server answers a request for any model
// with the one it loaded: its list is kept for /v1/models only.

// ModelsConfig configures the reading of the endpoints' model lists.
type ModelsConfig struct {
	// Disabled turns it off: every endpoint is presumed to serve every
	// model.
	Disabled bool
	// Interval between rounds. Default 5 s (the health probes').
	Interval time.Duration
	// Timeout of one read. Default 2 s.
	Timeout time.Duration
	// Workers is the number of reads in flight at once. Default 4.
	Workers int
}

func (c ModelsConfig) withDefaults() ModelsConfig {
	c.Interval = orDefault(c.Interval, 5*time.Second)
	c.Timeout = orDefault(c.Timeout, 2*time.Second)
	c.Workers = orDefault(c.Workers, 4)
	return c
}

func (c ModelsConfig) validate() error {
	if c.Interval < 0 || c.Timeout < 0 || c.Workers < 0 {
		return fmt.Errorf("models: negative interval, timeout or workers")
	}
	return nil
}

// Model is one entry of an endpoint's model list.
type Model struct {
	ID      string  `json:"id"`
	Object  string  `json:"object"`
	Created int64   `json:"created"`
	OwnedBy string  `json:"owned_by"`
	Root    string  `json:"root,omitempty"`
	Parent  *string `json:"parent"`
	// MaxModelLen is vLLM's context length (null for adapters).
	MaxModelLen *int `json:"max_model_len"`
}

// Models is an endpoint's model list as last read. Immutable.
type Models struct {
	List []Model
	At   time.Time
	ids  map[string]bool // List's ids, true for adapters: every pick asks (pods may list hundreds)
	// ollama holds List's ids in Ollama's canonical form (ollamaName).
	ollama map[string]bool
}

// Serves reports whether the list names model (a served name or an
// adapter).
func (m *Models) Serves(model string) bool {
	_, ok := m.ids[model]
	return ok
}

// Adapter reports whether the list names model as a LoRA adapter (an entry
// with a parent).
func (m *Models) Adapter(model string) bool { return m.ids[model] }

// Models returns e's model list as last read; nil when not known.
func (e *Endpoint) Models() *Models { return e.models.Load() }

// Serves reports whether a request for model may go to e: model is empty,
// e's list is not known, e is a llama.cpp server (it serves any name), or
// its list names model (for Ollama, in any of the spellings Ollama
// accepts). Safe for concurrent use; it allocates only to canonicalise a
// name an Ollama list does not hold as spelt.
func (e *Endpoint) Serves(model string) bool {
	if model == "" {
		return true
	}
	m := e.models.Load()
	if m == nil || m.Serves(model) {
		return true
	}
	switch e.Dialect() {
	case DialectLlamaCpp:
		return true
	case DialectOllama:
		return m.ollama[ollamaName(model)]
	}
	return false
}

// SetModels records e's model list (tests and other discovery sources).
func (e *Endpoint) SetModels(list []Model) {
	m := &Models{List: list, At: time.Now(), ids: make(map[string]bool, len(list)),
		ollama: make(map[string]bool, len(list))}
	for _, x := range list {
		m.ids[x.ID] = x.Parent != nil
		m.ollama[ollamaName(x.ID)] = true
	}
	e.models.Store(m)
}

// maxModelsBytes caps one /v1/models answer: a pod with hundreds of
// adapters lists a few hundred KB.
const maxModelsBytes = 4 << 20

func (f *Fleet) modelsLoop() loopConfig {
	c := f.o.Models
	return loopConfig{
		interval: c.Interval, jitter: 0.1, workers: c.Workers,
		busy:      func(e *Endpoint) *atomic.Bool { return &e.listing },
		newWorker: func() func(context.Context, *Endpoint) { return f.readModels },
	}
}

// readModels reads e's /v1/models, and what its engine says of itself
// (readInfo). A 404 or 405 (an engine without the endpoint) makes the list
// unknown; other failures keep the last one. Without health probes, which
// detect dialects otherwise, it detects e's. Names match per dialect, so
// an engine's list waits for its dialect (not pinned, not detected yet:
// nothing read; its detection reads it at once, ensureDetected): read
// before, four Ollama servers' "tiny:latest" was matched exactly, and a
// request for "tiny" that came as the router started got 404 although
// every server would have served it.
func (f *Fleet) readModels(ctx context.Context, e *Endpoint) {
	if f.o.Dialect == DialectUnknown && !e.detected.Load() {
		if f.o.Health.Disabled {
			f.ensureDetected(ctx, e, nil) // which reads the list once detected
		}
		return
	}
	f.readInfo(ctx, e)
	ctx, cancel := context.WithTimeout(ctx, f.o.Models.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.URL+"/v1/models", nil)
	if err != nil {
		return
	}
	resp, err := f.client.Do(req)
	if err != nil {
		return
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxModelsBytes+1))
	switch {
	case resp.StatusCode == http.StatusNotFound || resp.StatusCode == http.StatusMethodNotAllowed:
		e.models.Store(nil)
		return
	case err != nil || resp.StatusCode != http.StatusOK:
		return
	case len(body) > maxModelsBytes:
		f.log.Warn("model list too large", zap.String("endpoint", e.URL), zap.Int("max_bytes", maxModelsBytes))
		return
	}
	var list struct {
		Data []Model `json:"data"`
	}
	if err := json.Unmarshal(body, &list); err != nil || len(list.Data) == 0 {
		// Not a model list (an engine serves at least one model): unknown.
		f.log.Debug("unreadable model list", zap.String("endpoint", e.URL), zap.Error(err))
		e.models.Store(nil)
		return
	}
	old := e.models.Load()
	e.SetModels(list.Data)
	if old == nil || !slices.EqualFunc(old.List, list.Data, func(a, b Model) bool { return a.ID == b.ID }) {
		ids := make([]string, len(list.Data))
		for i, m := range list.Data {
			ids[i] = m.ID
		}
		f.log.Info("endpoint models", zap.String("endpoint", e.URL), zap.Stringer("role", e.Role), zap.Strings("models", ids))
	}
}

// Serves reports whether some serving endpoint of s (the mixed and decode
// pools) may take a request for model (see Endpoint.Serves): false only
// when there are serving endpoints and every one has a known list that
// does not name it.
func (s *Set) Serves(model string) bool {
	return len(s.Serving) == 0 || slices.ContainsFunc(s.Serving, func(e *Endpoint) bool { return e.Serves(model) })
}

// Models returns the union of the model lists of s's routable serving
// endpoints, by id (Ollama's by their canonical name, so four Ollama
// servers listing "tiny:latest" give one entry, the first server's id), in
// the order first seen; ok is false when none of them has a known list.
func (s *Set) Models() (list []Model, ok bool) {
	var keys []string
	for _, e := range s.Serving {
		m := e.Models()
		if m == nil || !e.Routable() {
			continue
		}
		ok = true
		ollama := e.Dialect() == DialectOllama
		for _, x := range m.List {
			k := x.ID
			if ollama {
				k = "\x00ollama:" + ollamaName(x.ID) // never an exact id
			}
			if !slices.Contains(keys, k) {
				keys = append(keys, k)
				list = append(list, x)
			}
		}
	}
	return list, ok
}
