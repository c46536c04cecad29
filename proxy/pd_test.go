package proxy

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/metrics"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// pdPools are the URLs of a disaggregated fleet's pools.
type pdPools struct {
	mixed, prefill, decode []string
}

// startPD starts a proxy over pools with the PD options of opt (the vLLM
// protocol unless opt says) and opt's Picker, or the prefix policy with
// learned priors.
func startPD(t testing.TB, opt Options, pools pdPools) *harness {
	t.Helper()
	pool := &discovery.Pool{}
	var eps []*discovery.Endpoint
	for _, g := range []struct {
		role discovery.Role
		urls []string
	}{{discovery.RoleMixed, pools.mixed}, {discovery.RolePrefill, pools.prefill}, {discovery.RoleDecode, pools.decode}} {
		for _, u := range g.urls {
			ep, err := discovery.NewEndpoint(u, g.role)
			if err != nil {
				t.Fatal(err)
			}
			eps = append(eps, ep)
		}
	}
	pool.Publish(eps)
	reg := prometheus.NewRegistry()
	pfx := routing.NewPrefix(prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: 1000, MaxEntries: 100000}), 1024, routing.DefaultPrefixParams())
	if opt.Picker == nil {
		opt.Picker, opt.Learner = pfx, pfx
	}
	opt.Pool = pool
	opt.PD.Disaggregated = true
	opt.Metrics = metrics.New(reg, Classes, nil)
	opt.MaxBodyBytes = 1 << 20
	if opt.Logger == nil {
		opt.Logger = zap.NewNop()
	}
	if opt.PD.Protocol == "" {
		opt.PD.Protocol = ProtocolVLLM
	}
	if opt.PD.Decider.Params == nil {
		opt.PD.Decider.Params = pfx.Params
		opt.PD.Decider.BlockTokens = func() int { return int(1024 / pfx.BytesPerToken()) }
	}
	opt.Retries = max(opt.Retries, 2)
	srv := New(opt)
	return &harness{url: serveLoopback(t, srv), srv: srv, pool: pool, reg: reg}
}

// simPod starts one simulated pod of role and returns it with its URL.
func simPod(t testing.TB, role sim.Role, mut ...func(*sim.Config)) (*sim.Pod, string, *atomic.Int64) {
	t.Helper()
	var prefilled atomic.Int64
	cfg := sim.Config{TimeScale: 100, Role: role, Model: "m", OnStep: func(s sim.StepInfo) { prefilled.Add(int64(s.PrefillTokens)) }}
	for _, m := range mut {
		m(&cfg)
	}
	f := startSimFleet(t, 1, cfg)
	return f.Pod(0), f.URL(0), &prefilled
}

// words returns a prompt of about n tokens of distinct text.
func promptWords(seed string, n int) string {
	var b strings.Builder
	for i := 0; b.Len() < 4*n; i++ {
		b.WriteString(seed)
		b.WriteString(" w")
		b.WriteString(string(rune('a' + i%26)))
		b.WriteString(string(rune('a' + i/26%26)))
		b.WriteByte(' ')
	}
	return b.String()
}

func pdCompletion(prompt string, stream bool, extra string) string {
	b, _ := json.Marshal(map[string]any{"model": "m", "prompt": prompt, "max_tokens": 8, "stream": stream})
	if extra != "" {
		b = append(b[:len(b)-1], ","+extra+"}"...)
	}
	return string(b)
}

func pdChat(prompt string, stream bool) string {
	m := map[string]any{"model": "m", "max_tokens": 8, "stream": stream,
		"messages": []map[string]string{{"role": "user", "content": prompt}}}
	if stream {
		m["stream_options"] = map[string]any{"include_usage": true}
	}
	b, _ := json.Marshal(m)
	return string(b)
}

// usageOf returns the usage of a whole or streamed answer.
func usageOf(t testing.TB, body string) (prompt, cached, completion int) {
	t.Helper()
	var u struct {
		Usage *struct {
			PromptTokens     int `json:"prompt_tokens"`
			CompletionTokens int `json:"completion_tokens"`
			Details          *struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	chunks := []string{body}
	if strings.HasPrefix(body, "data:") {
		chunks = nil
		sc := bufio.NewScanner(strings.NewReader(body))
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok && d != "[DONE]" {
				chunks = append(chunks, d)
			}
		}
	}
	for _, c := range chunks {
		u.Usage = nil
		if err := json.Unmarshal([]byte(c), &u); err != nil {
			t.Fatalf("answer chunk %q: %v", c, err)
		}
		if u.Usage != nil {
			if u.Usage.Details != nil {
				cached = u.Usage.Details.Cached
			}
			return u.Usage.PromptTokens, cached, u.Usage.CompletionTokens
		}
	}
	t.Fatalf("no usage in %q", body)
	return
}

func pdDecisions(t testing.TB, h *harness, decision string) float64 {
	return counterValue(t, h.reg, "kvroute_pd_decisions_total", map[string]string{"decision": decision})
}

// TestPDvLLMHandsTheKVToTheDecodePod: a long new prompt is prefilled on the
// prefill pod, and the decode pod really pulls its KV from the pod the
// reference names, computing nothing of it — completions and chat,
// streaming or not.
func TestPDvLLMHandsTheKVToTheDecodePod(t *testing.T) {
	prefillPod, purl, pPrefilled := simPod(t, sim.RolePrefill)
	decodePod, durl, dPrefilled := simPod(t, sim.RoleDecode)
	h := startPD(t, Options{}, pdPools{prefill: []string{purl}, decode: []string{durl}})
	for i, tc := range []struct {
		name string
		path string
		body string
	}{
		{"completions stream", "/v1/completions", pdCompletion(promptWords("a", 3000), true, `"stream_options":{"include_usage":true},"min_tokens":2`)},
		{"completions whole", "/v1/completions", pdCompletion(promptWords("b", 3000), false, "")},
		{"chat stream", "/v1/chat/completions", pdChat(promptWords("c", 3000), true)},
		{"chat whole", "/v1/chat/completions", pdChat(promptWords("d", 3000), false)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p0, d0 := pPrefilled.Load(), dPrefilled.Load()
			resp := post(t, h.url+tc.path, tc.body, "X-Request-Id", "pd-"+tc.name)
			body := readAll(t, resp)
			if resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
			if stream := strings.Contains(tc.body, `"stream":true`); stream != strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
				t.Errorf("content type %q for stream=%v", resp.Header.Get("Content-Type"), stream)
			}
			prompt, cached, completion := usageOf(t, body)
			if completion != 8 || cached != prompt-1 {
				t.Errorf("usage: prompt %d cached %d completion %d; want the decode pod to have pulled all but the last token, and 8 tokens", prompt, cached, completion)
			}
			if got := pPrefilled.Load() - p0; got < int64(prompt)-64 { // a chat template's start may be cached
				t.Errorf("prefill pod computed %d prompt tokens of %d", got, prompt)
			}
			if got := dPrefilled.Load() - d0; got != 0 {
				t.Errorf("decode pod computed %d prompt tokens itself", got)
			}
			if id := resp.Header.Get("X-Request-Id"); id != "pd-"+tc.name {
				t.Errorf("X-Request-Id %q", id)
			}
			if n := pdDecisions(t, h, routing.PDSplit); n != float64(i+1) {
				t.Errorf("disaggregated decisions %v, want %d", n, i+1)
			}
		})
	}
	hits := counterValue(t, decodePod.Registry(), "vllm:external_prefix_cache_hits_total", nil)
	failed := counterValue(t, decodePod.Registry(), "vllm:nixl_num_failed_transfers", nil)
	if hits < 4*2900 || failed != 0 {
		t.Errorf("decode pod: %v tokens pulled, %v failed transfers", hits, failed)
	}
	if st := prefillPod.Stats(); st.HeldBlocks != 0 {
		t.Errorf("prefill pod still holds %d blocks: a reference was never pulled", st.HeldBlocks)
	}
	h.waitIdle(t)
	if n := counterValue(t, h.reg, "kvroute_pd_stranded_prefills_total", nil); n != 0 {
		t.Errorf("%v stranded prefills", n)
	}
	if n := counterValue(t, h.reg, "llm_prefill_queue_seconds", nil); n != 4 {
		t.Errorf("llm_prefill_queue_seconds has %v samples, want 4", n)
	}
	if n := counterValue(t, h.reg, "kvroute_pd_decode_first_byte_seconds", nil); n != 4 {
		t.Errorf("kvroute_pd_decode_first_byte_seconds has %v samples, want 4", n)
	}
}

// TestPDShortOrCachedPromptsStayOnTheDecodePod: below the threshold of
// uncached tokens — a short prompt, or a long one the decode pod pulled
// before — no prefill pod is touched.
func TestPDShortOrCachedPromptsStayOnTheDecodePod(t *testing.T) {
	_, purl, pPrefilled := simPod(t, sim.RolePrefill)
	_, durl, _ := simPod(t, sim.RoleDecode)
	h := startPD(t, Options{}, pdPools{prefill: []string{purl}, decode: []string{durl}})

	short := post(t, h.url+"/v1/completions", pdCompletion(promptWords("s", 100), false, ""))
	if b := readAll(t, short); short.StatusCode != 200 {
		t.Fatalf("%d %s", short.StatusCode, b)
	}
	if pPrefilled.Load() != 0 || pdDecisions(t, h, routing.PDShort) != 1 {
		t.Fatalf("a 100-token prompt reached the prefill pod (%d tokens) or was not decode_only", pPrefilled.Load())
	}
	// 8 KiB of rendering and 100 bytes: 8 whole blocks and a part.
	long := strings.Repeat("0123456789abcdef", 520)[:8*1024+100]
	for i := range 2 {
		resp := post(t, h.url+"/v1/completions", pdCompletion(long, true, ""))
		if b := readAll(t, resp); resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
		}

	}
	if split, short := pdDecisions(t, h, routing.PDSplit), pdDecisions(t, h, routing.PDShort); split != 1 || short != 2 {
		t.Errorf("decisions: %v disaggregated, %v decode_only; want the repeat of the long prompt decode_only", split, short)
	}

	// A pinned threshold above the prompt keeps it on the decode pod.
	h2 := startPD(t, Options{PD: PDOptions{Decider: routing.PDDecider{MinUncachedTokens: 1 << 20}}},
		pdPools{prefill: []string{purl}, decode: []string{durl}})
	before := pPrefilled.Load()
	resp := post(t, h2.url+"/v1/completions", pdCompletion(promptWords("p", 3000), false, ""))
	if b := readAll(t, resp); resp.StatusCode != 200 || pPrefilled.Load() != before {
		t.Errorf("pinned threshold: %d %s; prefill pod computed %d tokens", resp.StatusCode, b, pPrefilled.Load()-before)
	}
}

// recorder is a fake engine that records what it received and answers
// with answer (a status and a body).
type recorder struct {
	mu     sync.Mutex
	bodies []map[string]json.RawMessage
	hdrs   []http.Header
	srv    *httptest.Server
}

func newRecorder(t testing.TB, answer func(w http.ResponseWriter, body []byte)) *recorder {
	t.Helper()
	r := &recorder{}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		b, _ := io.ReadAll(req.Body)
		var m map[string]json.RawMessage
		_ = json.Unmarshal(b, &m)
		r.mu.Lock()
		r.bodies, r.hdrs = append(r.bodies, m), append(r.hdrs, req.Header.Clone())
		r.mu.Unlock()
		answer(w, b)
	}))
	t.Cleanup(r.srv.Close)
	return r
}

func (r *recorder) got() ([]map[string]json.RawMessage, []http.Header) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]map[string]json.RawMessage(nil), r.bodies...), append([]http.Header(nil), r.hdrs...)
}

func answerWith(code int, body string) func(http.ResponseWriter, []byte) {
	return func(w http.ResponseWriter, _ []byte) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		_, _ = io.WriteString(w, body)
	}
}

// wirePrefill is a real vLLM prefill answer (../shared/vllm-wire), or a
// reference of the same shape when that folder is absent.
func wirePrefill(t testing.TB) string {
	if b, err := os.ReadFile(filepath.Join("..", "..", "shared", "vllm-wire", "pd-prefill-response.json")); err == nil {
		return string(b)
	}
	return `{"id":"cmpl-1","object":"text_completion","model":"m","choices":[{"index":0,"text":"x","finish_reason":"length"}],` +
		`"usage":{"prompt_tokens":25,"total_tokens":26,"completion_tokens":1},` +
		`"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2],"remote_engine_id":"f2e8","remote_host":"10.9.8.7","remote_port":5557,"tp_size":1}}`
}

// TestPDvLLMLegsOnTheWire checks both legs byte for byte against REFERENCE
// §3: the prefill leg's rewrite, the reference passed verbatim and opaque
// (its host is not kvroute's business), one request id and trace on both
// legs.
func TestPDvLLMLegsOnTheWire(t *testing.T) {
	answer := wirePrefill(t)
	var ans map[string]json.RawMessage
	if err := json.Unmarshal([]byte(answer), &ans); err != nil {
		t.Fatal(err)
	}
	pre := newRecorder(t, answerWith(200, answer))
	dec := newRecorder(t, answerWith(200, `{"id":"cmpl-2","choices":[{"text":"ok"}]}`))
	h := startPD(t, Options{PD: PDOptions{Decider: routing.PDDecider{MinUncachedTokens: 1}}},
		pdPools{prefill: []string{pre.srv.URL}, decode: []string{dec.srv.URL}})
	body := `{"model":"m","prompt":"` + promptWords("w", 400) + `","stream":true,"stream_options":{"include_usage":true},` +
		`"max_tokens":64,"max_completion_tokens":64,"min_tokens":4,"min_completion_tokens":4,"temperature":0.5}`
	resp := post(t, h.url+"/v1/completions", body, "X-Request-Id", "rid-7",
		"traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	if b := readAll(t, resp); resp.StatusCode != 200 || !strings.Contains(b, `"ok"`) {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	pb, ph := pre.got()
	db, dh := dec.got()
	if len(pb) != 1 || len(db) != 1 {
		t.Fatalf("%d prefill and %d decode legs", len(pb), len(db))
	}
	p, d := pb[0], db[0]
	want := map[string]string{"stream": "false", "max_tokens": "1", "max_completion_tokens": "1", "temperature": "0.5",
		"kv_transfer_params": `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`}
	for k, v := range want {
		if string(p[k]) != v {
			t.Errorf("prefill leg %s = %s, want %s", k, p[k], v)
		}
	}
	for _, k := range []string{"stream_options", "min_tokens", "min_completion_tokens"} {
		if _, ok := p[k]; ok {
			t.Errorf("prefill leg kept %s", k)
		}
	}
	if string(d["kv_transfer_params"]) != string(ans["kv_transfer_params"]) {
		t.Errorf("decode leg reference %s, want the prefill's verbatim %s", d["kv_transfer_params"], ans["kv_transfer_params"])
	}
	for _, k := range []string{"stream", "stream_options", "max_tokens", "min_tokens", "min_completion_tokens", "temperature", "prompt"} {
		var orig map[string]json.RawMessage
		_ = json.Unmarshal([]byte(body), &orig)
		if string(d[k]) != string(orig[k]) {
			t.Errorf("decode leg %s = %s, want the client's %s", k, d[k], orig[k])
		}
	}
	for i, hd := range []http.Header{ph[0], dh[0]} {
		if hd.Get("X-Request-Id") != "rid-7" || !strings.HasPrefix(hd.Get("Traceparent"), "00-4bf92f3577b34da6a3ce929d0e0e4736-") {
			t.Errorf("leg %d: X-Request-Id %q, traceparent %q", i, hd.Get("X-Request-Id"), hd.Get("Traceparent"))
		}
	}
	if ph[0].Get("Traceparent") == dh[0].Get("Traceparent") {
		t.Error("both legs carry the same span id")
	}
}

// TestPDSeveralPromptsGoToTheDecodePodAlone: a batch (or n > 1) cannot be
// handed over as one sequence; it is served by the decode pod alone.
func TestPDSeveralPromptsGoToTheDecodePodAlone(t *testing.T) {
	pre := newRecorder(t, answerWith(200, wirePrefill(t)))
	dec := newRecorder(t, answerWith(200, `{"id":"x","choices":[]}`))
	h := startPD(t, Options{PD: PDOptions{Decider: routing.PDDecider{MinUncachedTokens: 1}}},
		pdPools{prefill: []string{pre.srv.URL}, decode: []string{dec.srv.URL}})
	long := promptWords("n", 500)
	for _, body := range []string{
		`{"model":"m","prompt":["` + long + `","` + long + `x"]}`,
		`{"model":"m","prompt":"` + long + `","n":2}`,
	} {
		resp := post(t, h.url+"/v1/completions", body)
		if b := readAll(t, resp); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
	}
	if pb, _ := pre.got(); len(pb) != 0 {
		t.Errorf("%d prefill legs for batched requests", len(pb))
	}
	if db, _ := dec.got(); len(db) != 2 || db[0]["kv_transfer_params"] != nil {
		t.Errorf("decode pod got %d requests (first %v)", len(db), db)
	}
	if n := pdDecisions(t, h, routing.PDSingleOnly); n != 2 {
		t.Errorf("single_only decisions %v", n)
	}
}

// TestPDClientKVParamsRefused: a client may not steer a KV transfer unless
// the operator trusts it; then its fields pass untouched, with no prefill
// leg.
func TestPDClientKVParamsRefused(t *testing.T) {
	pre := newRecorder(t, answerWith(200, wirePrefill(t)))
	dec := newRecorder(t, answerWith(200, `{"id":"x","choices":[]}`))
	pools := pdPools{prefill: []string{pre.srv.URL}, decode: []string{dec.srv.URL}}
	bodies := []string{
		`{"model":"m","prompt":"hi","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"169.254.169.254","remote_port":80}}`,
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"bootstrap_room":7}`,
		`{"model":"m","prompt":"hi","bootstrap_host":"10.0.0.1"}`,
	}
	h := startPD(t, Options{}, pools)
	for i, b := range bodies {
		path := "/v1/completions"
		if strings.Contains(b, "messages") {
			path = "/v1/chat/completions"
		}
		assertOpenAIError(t, post(t, h.url+path, b), http.StatusBadRequest)
		if pb, _ := pre.got(); len(pb) != 0 {
			t.Fatalf("body %d reached the prefill pod", i)
		}
	}
	if db, _ := dec.got(); len(db) != 0 {
		t.Fatalf("refused bodies reached the decode pod")
	}
	// Also without any PD pool: a mixed vLLM pod with a KV connector would
	// honour the fields too.
	mixed := newRecorder(t, answerWith(200, `{}`))
	hm := startPD(t, Options{}, pdPools{mixed: []string{mixed.srv.URL}})
	assertOpenAIError(t, post(t, hm.url+"/v1/completions", bodies[0]), http.StatusBadRequest)

	ht := startPD(t, Options{PD: PDOptions{TrustClientKV: true, Decider: routing.PDDecider{MinUncachedTokens: 1}}}, pools)
	resp := post(t, ht.url+"/v1/completions", bodies[0])
	if b := readAll(t, resp); resp.StatusCode != 200 {
		t.Fatalf("trusted: %d %s", resp.StatusCode, b)
	}
	db, _ := dec.got()
	if pb, _ := pre.got(); len(pb) != 0 || len(db) != 1 || !strings.Contains(string(db[0]["kv_transfer_params"]), "169.254.169.254") {
		t.Errorf("trusted client's parameters: %d prefill legs, decode got %v", len(pb), db)
	}
}

// TestPDPrefillFailures: a prefill pod that refuses connections, answers
// 5xx or times out is replaced by another, then the decode pod computes
// alone; a 4xx is the client's answer; an answer without a reference
// leaves the decode pod the plain body.
func TestPDPrefillFailures(t *testing.T) {
	long := promptWords("f", 600)
	body := `{"model":"m","prompt":"` + long + `","max_tokens":4}`
	decodeOK := `{"id":"d","choices":[{"text":"decoded"}]}`
	// A stalled prefill pod answers only when its test ends: a request
	// that finishes at all got past it by the prefill timeout.
	stalled := func(t *testing.T) string {
		released := make(chan struct{})
		r := newRecorder(t, func(http.ResponseWriter, []byte) { <-released })
		t.Cleanup(func() { close(released) }) // before the recorder closes
		return r.srv.URL
	}
	for _, tc := range []struct {
		name       string
		prefills   func(t *testing.T) []string
		status     int
		want       string // in the client's answer
		decodeRef  bool   // the decode leg carries the reference
		decision   string
		prefillSet func(*PDOptions)
	}{
		{name: "refused then another pod", prefills: func(t *testing.T) []string {
			return []string{closedAddr(t), newRecorder(t, answerWith(200, wirePrefill(t))).srv.URL}
		}, status: 200, want: "decoded", decodeRef: true, decision: routing.PDSplit},
		{name: "5xx everywhere", prefills: func(t *testing.T) []string {
			return []string{newRecorder(t, answerWith(500, `{"error":{"message":"boom"}}`)).srv.URL}
		}, status: 200, want: "decoded", decision: routing.PDPrefillFailed},
		{name: "timeout", prefills: func(t *testing.T) []string {
			return []string{stalled(t)}
		}, status: 200, want: "decoded", decision: routing.PDPrefillFailed,
			prefillSet: func(o *PDOptions) { o.PrefillTimeout = 200 * time.Millisecond }},
		{name: "4xx passed on", prefills: func(t *testing.T) []string {
			return []string{newRecorder(t, answerWith(404, `{"error":{"message":"The model `+"`m`"+` does not exist.","type":"NotFoundError","param":null,"code":404}}`)).srv.URL}
		}, status: 404, want: "does not exist", decision: routing.PDSplit},
		{name: "no reference", prefills: func(t *testing.T) []string {
			return []string{newRecorder(t, answerWith(200, `{"id":"p","choices":[{"text":"x","finish_reason":"stop"}]}`)).srv.URL}
		}, status: 200, want: "decoded", decision: routing.PDNoReference},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dec := newRecorder(t, answerWith(200, decodeOK))
			opt := Options{PD: PDOptions{Decider: routing.PDDecider{MinUncachedTokens: 1}}}
			if tc.prefillSet != nil {
				tc.prefillSet(&opt.PD)
			}
			h := startPD(t, opt, pdPools{prefill: tc.prefills(t), decode: []string{dec.srv.URL}})
			resp := post(t, h.url+"/v1/completions", body)
			got := readAll(t, resp)
			if resp.StatusCode != tc.status || !strings.Contains(got, tc.want) {
				t.Fatalf("%d %s, want %d with %q", resp.StatusCode, got, tc.status, tc.want)
			}

			db, _ := dec.got()
			if tc.status != 200 {
				if len(db) != 0 {
					t.Errorf("the decode pod got a request after the prefill's %d", tc.status)
				}
				return
			}
			if len(db) != 1 || (db[0]["kv_transfer_params"] != nil) != tc.decodeRef {
				t.Errorf("decode leg %v, want reference %v", db, tc.decodeRef)
			}
			if n := pdDecisions(t, h, tc.decision); n != 1 {
				t.Errorf("decision %s counted %v times", tc.decision, n)
			}
		})
	}
}

// TestPDNoPrefillPod: without a prefill pod (none discovered, or none
// usable) the decode pod serves alone.
func TestPDNoPrefillPod(t *testing.T) {
	dec := newRecorder(t, answerWith(200, `{"id":"d"}`))
	h := startPD(t, Options{PD: PDOptions{Decider: routing.PDDecider{MinUncachedTokens: 1}}},
		pdPools{decode: []string{dec.srv.URL}})
	resp := post(t, h.url+"/v1/completions", `{"model":"m","prompt":"`+promptWords("z", 300)+`"}`)
	if b := readAll(t, resp); resp.StatusCode != 200 || pdDecisions(t, h, routing.PDNoPrefill) != 1 {
		t.Fatalf("%d %s; no_prefill %v", resp.StatusCode, b, pdDecisions(t, h, routing.PDNoPrefill))
	}
}

// TestPDDecodeFailureBeforeTheFirstByte: a decode pod failing before its
// first byte is replaced by another with the same reference once, then the
// request gets a fresh prefill; the abandoned reference is counted.
func TestPDDecodeFailureBeforeTheFirstByte(t *testing.T) {
	_, purl, _ := simPod(t, sim.RolePrefill)
	_, durl, _ := simPod(t, sim.RoleDecode)
	failing := func() (*recorder, string) {
		r := newRecorder(t, answerWith(500, `{"error":{"message":"decode failed"}}`))
		return r, r.srv.URL
	}
	f1, u1 := failing()
	f2, u2 := failing()
	// The two failing decode pods are picked first, then the good one.
	h := startPD(t, Options{Picker: decodeFirst{}, Limits: Limits{Retries: 3},
		PD: PDOptions{Decider: routing.PDDecider{MinUncachedTokens: 1}}},
		pdPools{prefill: []string{purl}, decode: []string{u1, u2, durl}})
	url, reg := h.url, h.reg
	resp := post(t, url+"/v1/completions", pdCompletion(promptWords("r", 2000), true, `"stream_options":{"include_usage":true}`))
	body := readAll(t, resp)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if _, cached, _ := usageOf(t, body); cached == 0 {
		t.Errorf("the good decode pod computed the prompt itself: %s", body)
	}
	b1, _ := f1.got()
	b2, _ := f2.got()
	if len(b1) != 1 || len(b2) != 1 || string(b1[0]["kv_transfer_params"]) != string(b2[0]["kv_transfer_params"]) {
		t.Fatalf("the second decode pod did not get the first's reference: %v / %v", b1, b2)
	}
	prefills := counterValue(t, reg, "kvroute_pd_prefill_leg_seconds", nil)
	stranded := counterValue(t, reg, "kvroute_pd_stranded_prefills_total", nil)
	if prefills != 2 || stranded != 1 {
		t.Errorf("%v prefill legs and %v stranded references; want a fresh prefill after two failed decodes, and the first reference counted", prefills, stranded)
	}
}

// TestPDStreamCutAfterTheFirstByte: once the decode pod streamed, a cut
// ends the client's stream with an error event and [DONE], no retry.
func TestPDStreamCutAfterTheFirstByte(t *testing.T) {
	_, purl, _ := simPod(t, sim.RolePrefill)
	_, durl, _ := simPod(t, sim.RoleDecode, func(c *sim.Config) { c.Faults.DropAfterTokens = 3 })
	h := startPD(t, Options{}, pdPools{prefill: []string{purl}, decode: []string{durl}})
	resp := post(t, h.url+"/v1/completions", pdCompletion(promptWords("cut", 3000), true, ""))
	body := readAll(t, resp)
	if resp.StatusCode != 200 || !strings.Contains(body, "upstream_stream_cut") || !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Fatalf("%d %q", resp.StatusCode, body)
	}
	if n := counterValue(t, h.reg, "kvroute_retries_total", nil); n != 0 {
		t.Errorf("%v retries after the first byte", n)
	}
}

// TestPDClientLeavingCancelsThePrefillLeg: the watcher closes the prefill
// leg's connection when the client goes.
func TestPDClientLeavingCancelsThePrefillLeg(t *testing.T) {
	cancelled, started := make(chan struct{}), make(chan struct{})
	pre := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		close(started)
		select {
		case <-r.Context().Done():
			close(cancelled)
		case <-time.After(10 * time.Second):
		}
	}))
	t.Cleanup(pre.Close)
	dec := newRecorder(t, answerWith(200, `{}`))
	h := startPD(t, Options{PD: PDOptions{Decider: routing.PDDecider{MinUncachedTokens: 1}}},
		pdPools{prefill: []string{pre.URL}, decode: []string{dec.srv.URL}})
	ctx, leave := context.WithCancel(context.Background())
	go func() { // the client leaves once the prefill leg is at its engine
		select {
		case <-started:
		case <-time.After(5 * time.Second):
		}
		leave()
	}()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, h.url+"/v1/completions",
		strings.NewReader(`{"model":"m","prompt":"`+promptWords("q", 300)+`"}`))
	if _, err := http.DefaultClient.Do(req); err == nil {
		t.Fatal("the request did not end with the client leaving")
	}
	select {
	case <-cancelled:
	case <-time.After(3 * time.Second):
		t.Fatal("the prefill leg was not cancelled after the client left")
	}
	h.waitIdle(t)
	if db, _ := dec.got(); len(db) != 0 {
		t.Errorf("a decode leg was sent for a client that left")
	}
}

// TestPDSGLangConcurrentLegs: the SGLang protocol sends the same body with
// bootstrap fields to both pods at once; the decode pod gets the KV from
// the prefill pod's bootstrap server.
func TestPDSGLangConcurrentLegs(t *testing.T) {
	prefillPod, purl, _ := simPod(t, sim.RolePrefill)
	_, durl, dPrefilled := simPod(t, sim.RoleDecode)
	port := prefillPod.SideChannelAddr()[strings.LastIndexByte(prefillPod.SideChannelAddr(), ':')+1:]
	h := startPD(t, Options{PD: PDOptions{Protocol: ProtocolSGLang, BootstrapPort: 8998}},
		pdPools{prefill: []string{purl + "#bootstrap=" + port}, decode: []string{durl}})
	for _, tc := range []struct{ path, body string }{
		{"/v1/completions", pdCompletion(promptWords("g", 2000), true, `"stream_options":{"include_usage":true}`)},
		{"/v1/chat/completions", pdChat(promptWords("h", 2000), false)},
		{"/v1/completions", pdCompletion("short", false, "")}, // sglang: every request gets its prefill leg
		{"/v1/completions", `{"model":"m","max_tokens":4,"prompt":["` + promptWords("b1", 800) + `","` + promptWords("b2", 800) + `"]}`},
	} {
		resp := post(t, h.url+tc.path, tc.body)
		body := readAll(t, resp)
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		batch := strings.Contains(tc.body, `"prompt":[`)
		want, uncached := 8, 1
		if batch {
			want, uncached = 8, 2 // 4 tokens for each of two prompts, each recomputing its last token
		}
		if prompt, cached, completion := usageOf(t, body); completion != want || prompt > 100 && cached < prompt-uncached {
			t.Errorf("usage %d/%d/%d: the decode pod did not pull the prompt", prompt, cached, completion)
		}
	}
	if d := dPrefilled.Load(); d != 0 {
		t.Errorf("decode pod computed %d prompt tokens", d)
	}
	if n := pdDecisions(t, h, routing.PDSplit); n != 4 {
		t.Errorf("%v disaggregated", n)
	}
}

// TestPDSGLangFailedPrefillFailsTheRequest: the prefill leg's failure is
// the request's, and the decode leg waiting for the KV is cancelled.
func TestPDSGLangFailedPrefillFailsTheRequest(t *testing.T) {
	var legs sync.Map
	// The prefill leg fails once the decode leg is at its engine, waiting
	// for the KV as an SGLang decode engine does.
	decodeStarted := make(chan struct{})
	pre := newRecorder(t, func(w http.ResponseWriter, b []byte) {
		select {
		case <-decodeStarted:
		case <-time.After(5 * time.Second):
		}
		answerWith(500, `{"error":{"message":"prefill crashed"}}`)(w, b)
	})
	decodeCancelled := make(chan struct{}, 1)
	dec := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		legs.Store("decode", string(b))
		close(decodeStarted)
		select {
		case <-r.Context().Done():
			decodeCancelled <- struct{}{}
		case <-time.After(10 * time.Second):
		}
	}))
	t.Cleanup(dec.Close)
	h := startPD(t, Options{PD: PDOptions{Protocol: ProtocolSGLang, BootstrapPort: 8998}},
		pdPools{prefill: []string{pre.srv.URL}, decode: []string{dec.URL}})
	resp := post(t, h.url+"/v1/completions", pdCompletion(promptWords("x", 500), true, ""))
	assertOpenAIError(t, resp, http.StatusBadGateway) // before the decode engine's 10 s: it was cancelled
	select {
	case <-decodeCancelled:
	case <-time.After(3 * time.Second):
		t.Fatal("the decode leg was not cancelled")
	}
	pb, _ := pre.got()
	d, _ := legs.Load("decode")
	var db map[string]json.RawMessage
	_ = json.Unmarshal([]byte(d.(string)), &db)
	if len(pb) != 1 || string(pb[0]["bootstrap_room"]) != string(db["bootstrap_room"]) || len(db["bootstrap_room"]) == 0 ||
		string(db["bootstrap_port"]) != "8998" || string(db["bootstrap_host"]) != `"127.0.0.1"` {
		t.Errorf("legs: prefill %v, decode %v", pb, db)
	}
}

// decodeFirst picks untried decode endpoints before mixed ones, and
// prefill endpoints in order.
type decodeFirst struct{}

func (decodeFirst) Pick(r *routing.Request, set *discovery.Set) routing.Decision {
	groups := [][]*discovery.Endpoint{set.Decode, set.Mixed}
	if r.Prefill {
		groups = [][]*discovery.Endpoint{set.Prefill}
	}
	for _, g := range groups {
		for _, e := range g {
			if !slices.Contains(r.Tried, e) {
				return routing.Decision{Endpoint: e, Reason: "fixed", Prefill: r.PromptTokens}
			}
		}
	}
	return routing.Decision{}
}

// TestPDRetryOnAMixedPodSendsTheClientsBody: after a failed decode leg, a
// mixed pod gets the client's own body, and the unused reference is
// counted as stranded.
func TestPDRetryOnAMixedPodSendsTheClientsBody(t *testing.T) {
	pre := newRecorder(t, answerWith(200, wirePrefill(t)))
	dec := newRecorder(t, answerWith(500, `{"error":{"message":"decode failed"}}`))
	mixed := newRecorder(t, answerWith(200, `{"id":"m","choices":[{"text":"mixed"}]}`))
	h := startPD(t, Options{Picker: decodeFirst{}, PD: PDOptions{Decider: routing.PDDecider{MinUncachedTokens: 1}}},
		pdPools{prefill: []string{pre.srv.URL}, decode: []string{dec.srv.URL}, mixed: []string{mixed.srv.URL}})
	url, reg := h.url, h.reg
	resp := post(t, url+"/v1/completions", `{"model":"m","prompt":"`+promptWords("m", 300)+`"}`)
	if b := readAll(t, resp); resp.StatusCode != 200 || !strings.Contains(b, "mixed") {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	mb, _ := mixed.got()
	if db, _ := dec.got(); len(db) != 1 || db[0]["kv_transfer_params"] == nil || len(mb) != 1 || mb[0]["kv_transfer_params"] != nil {
		t.Errorf("decode got %v; mixed got %v", db, mb)
	}
	if n := counterValue(t, reg, "kvroute_pd_stranded_prefills_total", map[string]string{"cause": "superseded"}); n != 1 {
		t.Errorf("superseded references %v, want 1", n)
	}
}

// TestPDSGLangFailedDecodeCancelsThePrefillLeg: a decode leg that fails
// cancels its concurrent prefill leg, whose KV nobody would pull.
func TestPDSGLangFailedDecodeCancelsThePrefillLeg(t *testing.T) {
	cancelled := make(chan struct{}, 1)
	prefillStarted := make(chan struct{})
	pre := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		close(prefillStarted)
		select {
		case <-r.Context().Done():
			cancelled <- struct{}{}
		case <-time.After(10 * time.Second):
		}
	}))
	t.Cleanup(pre.Close)
	// The decode leg fails once the prefill leg is at its engine.
	dec := newRecorder(t, func(w http.ResponseWriter, b []byte) {
		select {
		case <-prefillStarted:
		case <-time.After(5 * time.Second):
		}
		answerWith(500, `{"error":{"message":"decode failed"}}`)(w, b)
	})
	h := startPD(t, Options{PD: PDOptions{Protocol: ProtocolSGLang, BootstrapPort: 8998}},
		pdPools{prefill: []string{pre.URL}, decode: []string{dec.srv.URL}})
	assertOpenAIError(t, post(t, h.url+"/v1/completions", pdCompletion(promptWords("y", 300), false, "")), http.StatusBadGateway)
	select {
	case <-cancelled:
	case <-time.After(3 * time.Second):
		t.Fatal("the prefill leg outlived its failed decode leg")
	}
	h.waitIdle(t)
	if n := counterValue(t, h.reg, "kvroute_upstream_errors_total", map[string]string{"kind": "prefill"}); n != 0 {
		t.Errorf("the cancelled prefill leg counted as %v prefill failures", n)
	}
}
