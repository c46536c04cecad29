package proxy

import (
	"bufio"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"
)

// checkEnvelope fails unless body is the OpenAI error envelope kvroute
// answers with: one "error" object with exactly message (non-empty),
// type (non-empty), param (null, or the offending field) and code (a
// non-empty string) — the keys of vLLM's nested envelope.
func checkEnvelope(t *testing.T, body []byte, param *string) {
	t.Helper()
	var top map[string]json.RawMessage
	if err := json.Unmarshal(body, &top); err != nil || len(top) != 1 || top["error"] == nil {
		t.Fatalf("not an error envelope: %s", body)
	}
	var inner map[string]json.RawMessage
	if err := json.Unmarshal(top["error"], &inner); err != nil {
		t.Fatalf("error is not an object: %s", body)
	}
	keys := make([]string, 0, len(inner))
	for k := range inner {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	if want := []string{"code", "message", "param", "type"}; !slices.Equal(keys, want) {
		t.Errorf("error keys %v, want %v: %s", keys, want, body)
	}
	var e struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    string  `json:"code"`
	}
	if err := json.Unmarshal(top["error"], &e); err != nil {
		t.Fatalf("error fields of the wrong type: %v: %s", err, body)
	}
	if e.Message == "" || e.Type == "" || e.Code == "" {
		t.Errorf("empty message, type or code: %s", body)
	}
	switch {
	case param == nil && e.Param != nil:
		t.Errorf("param %q, want null: %s", *e.Param, body)
	case param != nil && (e.Param == nil || *e.Param != *param):
		t.Errorf("param %s, want %q: %s", inner["param"], *param, body)
	}
}

func ptr(s string) *string { return &s }

// TestErrorResponsesCarryRequestID: every error kvroute answers itself
// (400 bad bodies and malformed requests, 413, 429, 500, 502, 503, 504)
// carries X-Request-Id — the client's when it sent one, a fresh one
// otherwise — and the OpenAI error envelope, with param naming the
// offending field of a 400 when there is one. (431 is answered by the
// same code as the malformed request; a client cannot reliably read it,
// as kvroute closes the connection on a header block it did not read
// whole.)
func TestErrorResponsesCarryRequestID(t *testing.T) {
	const ok = `{"model":"m","prompt":"hi"}`
	release := make(chan struct{})
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(func() { close(release); slow.Close() })
	busy, _ := statusBackend(t, 503)
	good, goodHits := echoBackend(t, "good")

	plain := startProxy(t, nil, Options{Limits: Limits{MaxBodyBytes: 4096}}, good.URL)
	refused := startProxy(t, fixedOrder{}, Options{Limits: Limits{Retries: 1}}, closedAddr(t), closedAddr(t))
	empty := startProxy(t, nil, Options{})
	timeout := startProxy(t, nil, Options{Limits: Limits{ResponseHeaderTimeout: 100 * time.Millisecond}}, slow.URL)
	panicky := startProxy(t, panicOnRetry{}, Options{Limits: Limits{Retries: 1}}, busy.URL)
	full := startFullProxy(t)

	cases := []errorResponseCase{
		{"malformed JSON", plain.url, "/v1/completions", `{"model":`, 400, nil},
		{"messages not an array", plain.url, "/v1/chat/completions", `{"model":"m","messages":"hi"}`, 400, ptr("messages")},
		{"prompt missing", plain.url, "/v1/completions", `{"model":"m"}`, 400, ptr("prompt")},
		{"negative token id", plain.url, "/v1/completions", `{"model":"m","prompt":[1,-2]}`, 400, ptr("prompt")},
		{"stream not a boolean", plain.url, "/v1/completions", `{"model":"m","prompt":"x","stream":"yes"}`, 400, ptr("stream")},
		{"oversized body", plain.url, "/v1/completions", `{"model":"m","prompt":"` + strings.Repeat("x", 8192) + `"}`, 413, nil},
		{"every endpoint refuses", refused.url, "/v1/completions", ok, 502, nil},
		{"no endpoint", empty.url, "/v1/completions", ok, 503, nil},
		{"response header timeout", timeout.url, "/v1/completions", ok, 504, nil},
		{"internal error", panicky.url, "/v1/completions", ok, 500, nil},
		{"no endpoint, other path", empty.url, "/v1/models", "", 503, nil},
		{"overloaded", full.url, "/v1/completions", ok, 429, nil},
	}
	seen := map[string]string{} // generated id → the case it answered
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Run("generated id", func(t *testing.T) { tc.check(t, "", seen) })
			t.Run("client's id", func(t *testing.T) { tc.check(t, "client-id-"+strings.ReplaceAll(tc.name, " ", "-"), seen) })
		})
	}
	if goodHits.Load() != 0 {
		t.Errorf("%d bad requests reached the backend", goodHits.Load())
	}

	t.Run("malformed HTTP", func(t *testing.T) { checkMalformedHTTP(t, plain.url) })
}

// startFullProxy returns a proxy whose only endpoint is saturated: it
// admits one request in flight, and one is held there (a stream the
// backend does not end) until the test ends.
func startFullProxy(t *testing.T) *harness {
	t.Helper()
	hold := make(chan struct{})
	held := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = w.Write([]byte("data: {}\n\n"))
		w.(http.Flusher).Flush()
		select {
		case <-hold:
		case <-r.Context().Done():
		}
	}))
	full := startProxy(t, nil, Options{Limits: Limits{MaxInFlightPerEndpoint: 1, QueueTimeout: 0}}, held.URL)
	holding := make(chan error, 1)
	go func() {
		resp, err := testClient.Post(full.url+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"m","prompt":"hold","stream":true}`))
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		holding <- err
	}()
	t.Cleanup(func() {
		close(hold)
		select {
		case <-holding:
		case <-time.After(guardWait):
			t.Error("the held request did not end")
		}
		held.Close()
	})
	for deadline := time.Now().Add(guardWait); full.inFlight() != 1; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the holding request never went in flight")
		}
	}
	return full
}

// errorResponseCase is a request (body to url+path) that kvroute answers
// itself with status, and the param its error envelope names (nil: none).
type errorResponseCase struct {
	name, url, path, body string
	status                int
	param                 *string
}

// check sends tc's request with clientID as X-Request-Id ("": none) and
// checks the answer: tc's status, the error envelope, and one request id,
// the client's or a generated one no earlier answer in seen carried.
func (tc errorResponseCase) check(t *testing.T, clientID string, seen map[string]string) {
	var hdr []string
	if clientID != "" {
		hdr = []string{"X-Request-Id", clientID}
	}
	resp := post(t, tc.url+tc.path, tc.body, hdr...)
	body := readAll(t, resp)
	if resp.StatusCode != tc.status {
		t.Fatalf("status %d, want %d: %s", resp.StatusCode, tc.status, body)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("content type %q", ct)
	}
	checkEnvelope(t, []byte(body), tc.param)
	ids := resp.Header.Values("X-Request-Id")
	switch {
	case len(ids) != 1 || ids[0] == "":
		t.Errorf("X-Request-Id %q (client sent %q), want one", ids, clientID)
	case clientID != "" && ids[0] != clientID:
		t.Errorf("X-Request-Id %q, want the client's %q", ids[0], clientID)
	case clientID == "":
		if other, dup := seen[ids[0]]; dup {
			t.Errorf("generated X-Request-Id %q also answered %q", ids[0], other)
		}
		seen[ids[0]] = tc.name
	}
}

// checkMalformedHTTP sends the proxy at url a request fasthttp cannot
// parse: no client id can be read, so a fresh one is generated, on a 400
// with the error envelope.
func checkMalformedHTTP(t *testing.T, url string) {
	c, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(guardWait))
	if _, err := c.Write([]byte("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nonsense\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	body := readAll(t, resp)
	if resp.StatusCode != 400 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	checkEnvelope(t, []byte(body), nil)
	if id := resp.Header.Get("X-Request-Id"); id == "" {
		t.Error("no X-Request-Id")
	}
}
