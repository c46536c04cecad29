package discovery

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
)

// readModels: a model list is read with its adapters; an engine without
// /v1/models (404) or an answer that is no model list makes the list
// unknown (every model presumed served); a failed read keeps the last list.
func TestReadModels(t *testing.T) {
	var answer atomic.Value // func(http.ResponseWriter)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/models" {
			http.NotFound(w, r)
			return
		}
		answer.Load().(func(http.ResponseWriter))(w)
	}))
	defer srv.Close()
	f, err := New(DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	e, err := NewEndpoint(srv.URL, RoleMixed)
	if err != nil {
		t.Fatal(err)
	}
	body := func(s string) func(http.ResponseWriter) {
		return func(w http.ResponseWriter) { _, _ = w.Write([]byte(s)) }
	}
	// Before its dialect is detected nothing is read: names match per
	// dialect.
	answer.Store(body(`{"object":"list","data":[{"id":"base","object":"model"}]}`))
	f.readModels(context.Background(), e)
	if e.Models() != nil {
		t.Fatalf("a list read before the dialect was known: %+v", e.Models())
	}
	e.SetDialect(DialectVLLM)
	e.detected.Store(true)
	steps := []struct {
		name  string
		ans   func(http.ResponseWriter)
		known bool
		serve map[string]bool
	}{
		{"a base model and an adapter", body(`{"object":"list","data":[{"id":"base","object":"model","parent":null,"max_model_len":4096},{"id":"sql","object":"model","parent":"base","max_model_len":null}]}`),
			true, map[string]bool{"base": true, "sql": true, "other": false, "": true}},
		{"a failed read keeps it", func(w http.ResponseWriter) { w.WriteHeader(500) }, true, map[string]bool{"sql": true, "other": false}},
		{"garbage keeps nothing", body(`<html>`), false, map[string]bool{"other": true}},
		{"read again", body(`{"object":"list","data":[{"id":"base2","object":"model"}]}`), true, map[string]bool{"base2": true, "base": false}},
		{"no /v1/models", func(w http.ResponseWriter) { w.WriteHeader(404) }, false, map[string]bool{"anything": true}},
	}
	for _, s := range steps {
		answer.Store(s.ans)
		f.readModels(context.Background(), e)
		if (e.Models() != nil) != s.known {
			t.Errorf("%s: list known %v, want %v", s.name, e.Models() != nil, s.known)
		}
		for m, want := range s.serve {
			if e.Serves(m) != want {
				t.Errorf("%s: Serves(%q) = %v, want %v", s.name, m, !want, want)
			}
		}
	}
	if m := e.Models(); m != nil {
		t.Errorf("after a 404: %+v", m)
	}
	e.SetModels([]Model{{ID: "x"}})
	set := &Set{Serving: []*Endpoint{e}}
	if set.Serves("y") || !set.Serves("x") || !(&Set{}).Serves("y") {
		t.Error("Set.Serves: a set whose only endpoint lists x serves x, not y; an empty set decides nothing")
	}
}
