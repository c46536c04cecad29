package proxy

import (
	"crypto/subtle"
	"encoding/json"
	"io"
	"net/http"
	"net/http/pprof"
	"strconv"
	"strings"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// AdminHandler returns the admin listener's handler: /metrics (from g),
// /livez, /readyz (503 while draining, with no endpoint, or while
// Options.Ready says not yet), /debug/pprof/.
// Later features add their /debug routes to the returned mux.
func (s *Server) AdminHandler(g prometheus.Gatherer) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /livez", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		var notReady error
		if s.opt.Ready != nil {
			notReady = s.opt.Ready()
		}
		switch {
		case s.draining.Load():
			http.Error(w, "draining", http.StatusServiceUnavailable)
		case !anyRoutable(s.opt.Pool.Load()):
			http.Error(w, "no usable endpoint", http.StatusServiceUnavailable)
		case notReady != nil:
			http.Error(w, notReady.Error(), http.StatusServiceUnavailable)
		default:
			_, _ = w.Write([]byte("ok\n"))
		}
	})
	mux.HandleFunc("GET /debug/queue", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(s.QueueStatus())
	})
	mux.HandleFunc("/debug/pprof/", s.guard(pprof.Index))
	mux.HandleFunc("/debug/pprof/cmdline", s.guard(pprof.Cmdline))
	mux.HandleFunc("/debug/pprof/profile", s.guard(pprof.Profile))
	mux.HandleFunc("/debug/pprof/symbol", s.guard(pprof.Symbol))
	mux.HandleFunc("/debug/pprof/trace", s.guard(pprof.Trace))
	return mux
}

// guard puts h behind the admin token: a request must carry
// "Authorization: Bearer <token>" (compared in constant time), else 401;
// without a configured token h is off (403). /metrics, /livez, /readyz and
// the read-only /debug pages stay open for probes and Prometheus.
func (s *Server) guard(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		token := s.opt.AdminToken
		if token == "" {
			http.Error(w, "disabled: start kvroute with --admin-token (or KVROUTE_ADMIN_TOKEN) to enable", http.StatusForbidden)
			return
		}
		got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(token)) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="kvroute-admin"`)
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		h(w, r)
	}
}

// anyRoutable reports whether set has an endpoint that can take requests.
func anyRoutable(set *discovery.Set) bool {
	for _, e := range set.Serving {
		if e.Routable() {
			return true
		}
	}
	return false
}

// Explainer is a policy that can show its work: the prefix policy.
type Explainer interface {
	Explain(r *routing.Request, set *discovery.Set) (routing.Decision, []routing.Term)
}

// explanation is /debug/route's answer.
type explanation struct {
	Path          string         `json:"path"`
	Model         string         `json:"model"`
	PromptBytes   int            `json:"prompt_bytes"`
	PromptTokens  int            `json:"prompt_tokens_estimate"`
	Blocks        int            `json:"blocks"`
	Pick          string         `json:"pick"`
	Reason        string         `json:"reason"`
	MatchedBlocks int            `json:"matched_blocks"`
	Prefill       int            `json:"prefill_tokens"`
	Endpoints     []routing.Term `json:"endpoints"`
	// PD explains the disaggregation decision when the pick is a decode
	// endpoint.
	PD *pdExplanation `json:"pd,omitempty"`
	// Continuation: the body was the continuation of a stream that failed
	// on FailedEndpoint after Text (migrate.go); the pick is the
	// continuation's.
	Continuation   bool   `json:"continuation,omitempty"`
	FailedEndpoint string `json:"failed_endpoint,omitempty"`
}

// pdExplanation is /debug/route's account of a disaggregation decision and
// of the prefill pick.
type pdExplanation struct {
	Protocol        string         `json:"protocol"`
	Decision        string         `json:"decision"`
	UncachedTokens  int            `json:"uncached_tokens"`
	ThresholdTokens int            `json:"threshold_tokens,omitempty"`
	Prefill         string         `json:"prefill,omitempty"`
	PrefillReason   string         `json:"prefill_reason,omitempty"`
	PrefillMatched  int            `json:"prefill_matched_blocks"`
	PrefillTokens   int            `json:"prefill_tokens"`
	PrefillPool     []routing.Term `json:"prefill_endpoints,omitempty"`
}

// HandleExplain serves POST /debug/route?path=/v1/chat/completions: it
// parses the body as the proxy would and returns the policy's decision with
// every endpoint's terms, without forwarding or recording anything. With
// failed=URL (and text=T, tokens=N), it explains instead where the
// continuation of the body's stream would go had it failed on the
// endpoint URL after the text T of N tokens (migrate.go).
func (s *Server) HandleExplain(mux *http.ServeMux, e Explainer) {
	mux.HandleFunc("POST /debug/route", func(w http.ResponseWriter, r *http.Request) {
		path := r.URL.Query().Get("path")
		if path == "" {
			path = string(pathChat)
		}
		kind := kindOf([]byte(http.MethodPost), []byte(path))
		if kind == routing.KindOther {
			http.Error(w, "path must be an inference path (/v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings)", http.StatusBadRequest)
			return
		}
		body, err := io.ReadAll(io.LimitReader(r.Body, int64(s.opt.MaxBodyBytes)+1))
		if err != nil || len(body) > s.opt.MaxBodyBytes {
			http.Error(w, "cannot read body", http.StatusBadRequest)
			return
		}
		q := r.URL.Query()
		failed := q.Get("failed")
		if failed != "" {
			text := appendJSONString(nil, q.Get("text"))
			tokens, _ := strconv.Atoi(q.Get("tokens"))
			if body, err = continuation(body, kind == routing.KindChat, text[1:len(text)-1], tokens); err != nil {
				http.Error(w, "invalid JSON body: "+err.Error(), http.StatusBadRequest)
				return
			}
		}
		st := reqState{maxTokens: s.opt.MaxPromptTokens}
		if err := st.parse(kind, body, s.opt.BlockSize, s.opt.MaxBlocks); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		set := s.opt.Pool.Load()
		if failed != "" {
			for _, ep := range set.Endpoints {
				if ep.URL == failed {
					st.req.Tried = append(st.req.Tried, ep)
				}
			}
		}
		d, terms := e.Explain(&st.req, set)
		out := explanation{Path: path, Model: st.req.Model, PromptBytes: st.req.PromptBytes,
			PromptTokens: st.req.PromptTokens, Blocks: len(st.req.Hashes), Reason: d.Reason,
			MatchedBlocks: d.MatchedBlocks, Prefill: d.Prefill, Endpoints: terms, Continuation: failed != "", FailedEndpoint: failed}
		if d.Endpoint != nil {
			out.Pick = d.Endpoint.URL
			if d.Endpoint.Role == discovery.RoleDecode && s.pd != nil {
				out.PD = s.explainPD(e, &st, d)
			}
		}
		writeJSON(w, http.StatusOK, out)
	})
}

// Tunable is a policy whose parameters change at run time.
type Tunable interface {
	Params() routing.PrefixParams
	SetParams(routing.PrefixParams) error
}

// HandleParams serves GET and PUT /debug/prefix/params: operators tune the
// prefix policy's thresholds under live traffic. PUT takes the whole JSON
// object or a subset of its fields, and the admin token (guard).
func (s *Server) HandleParams(mux *http.ServeMux, t Tunable) {
	mux.HandleFunc("GET /debug/prefix/params", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, t.Params())
	})
	mux.HandleFunc("PUT /debug/prefix/params", s.guard(func(w http.ResponseWriter, r *http.Request) {
		p := t.Params()
		dec := json.NewDecoder(io.LimitReader(r.Body, 1<<16))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&p); err != nil {
			http.Error(w, "bad parameters: "+err.Error(), http.StatusBadRequest)
			return
		}
		if err := t.SetParams(p); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		writeJSON(w, http.StatusOK, t.Params())
	}))
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}
