package proxy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// The bad-input corpus (testdata/bad, described in its README.md): every
// case is sent as raw bytes over its own TCP connection to a kvroute proxy
// on 127.0.0.1 in front of a fake vLLM engine on 127.0.0.1.
const (
	badDir = "../testdata/bad"
	// badSecret is in the Authorization header of every request; no
	// response may contain it.
	badSecret = "sk-kvroute-badinput-4f0c2b7e9a1d3c5b8e6f0a2d4c6b8e0a"
	// badCanary marks request lines, header names and values and paths of
	// the .http files; no response may contain it either.
	badCanary = "c4n4ry"
	// The router's limits for the corpus (the manifest's messages and the
	// generators assume them).
	badMaxBodyBytes     = 256 << 10
	badMaxHeaderBytes   = 16 << 10
	badMaxPromptTokens  = 16
	badServedModel      = "m"
	badCaseTimeout      = 10 * time.Second
	contextLengthPrompt = 40 // token ids of the context-length case
	badBackendHeaderKey = "X-Backend"
)

// badCase is one line of testdata/bad/cases.jsonl.
type badCase struct {
	Name string `json:"name"`
	// One of File (a *.json body POSTed to Path, or a raw *.http request)
	// and Gen (a generator of badGenerators).
	File string `json:"file"`
	Gen  string `json:"gen"`
	Path string `json:"path"`
	// Expect lists the accepted outcomes: a status; "closed", the
	// connection closed without a response; "NNN+close", status NNN and
	// then the connection closed.
	Expect []any `json:"expect"`
	// Backend is whether the engine sees the request: "never" (kvroute
	// answers itself), "once", "at-most-once" or "any".
	Backend string `json:"backend"`
	// Message, when set, is a regexp kvroute's error.message must match.
	Message string `json:"message"`
	Note    string `json:"note"`
}

func loadBadCases(t *testing.T) []badCase {
	t.Helper()
	raw := readFile(t, filepath.Join(badDir, "cases.jsonl"))
	var cases []badCase
	listed := map[string]bool{}
	for i, line := range strings.Split(string(raw), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		dec := json.NewDecoder(strings.NewReader(line))
		dec.DisallowUnknownFields()
		var c badCase
		if err := dec.Decode(&c); err != nil {
			t.Fatalf("cases.jsonl:%d: %v", i+1, err)
		}
		switch {
		case c.Name == "" || len(c.Expect) == 0:
			t.Fatalf("cases.jsonl:%d: name and expect are required", i+1)
		case (c.File == "") == (c.Gen == ""):
			t.Fatalf("cases.jsonl:%d: want exactly one of file and gen", i+1)
		case c.Gen != "" && badGenerators[c.Gen] == nil:
			t.Fatalf("cases.jsonl:%d: unknown generator %q", i+1, c.Gen)
		case strings.HasSuffix(c.File, ".json") && c.Path == "":
			t.Fatalf("cases.jsonl:%d: a JSON body needs a path", i+1)
		case !slices.Contains([]string{"never", "once", "at-most-once", "any"}, c.Backend):
			t.Fatalf("cases.jsonl:%d: backend %q: want never, once, at-most-once or any", i+1, c.Backend)
		}
		for _, e := range c.Expect {
			if f, ok := e.(float64); !(ok && f >= 100 && f < 600 || e == "closed" || outcomeRE.MatchString(fmt.Sprint(e))) {
				t.Fatalf("cases.jsonl:%d: expect %v: want statuses, \"closed\" or \"NNN+close\"", i+1, e)
			}
		}
		if listed[c.Name] || (c.File != "" && listed[c.File]) {
			t.Fatalf("cases.jsonl:%d: %s listed twice", i+1, c.Name)
		}
		listed[c.Name], listed[c.File] = true, true
		cases = append(cases, c)
	}
	// Every body and request file of the directory is a listed case.
	for _, pat := range []string{"*.json", "*.http"} {
		files, _ := filepath.Glob(filepath.Join(badDir, pat))
		for _, f := range files {
			if !listed[filepath.Base(f)] {
				t.Errorf("%s is not in cases.jsonl", f)
			}
		}
	}
	return cases
}

var outcomeRE = regexp.MustCompile(`^[1-5][0-9][0-9]\+close$`)

// badRequest builds a request with the headers every corpus request
// carries, then extra header lines, then body (with its Content-Length
// unless extra sets the framing).
func badRequest(method, path string, extra []string, body []byte) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "%s %s HTTP/1.1\r\nHost: kvroute.test\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\n", method, path, badSecret)
	framed := false
	for _, h := range extra {
		b.WriteString(h + "\r\n")
		l := strings.ToLower(h)
		framed = framed || strings.HasPrefix(l, "content-length:") || strings.HasPrefix(l, "transfer-encoding:")
	}
	if !framed {
		fmt.Fprintf(&b, "Content-Length: %d\r\n", len(body))
	}
	b.WriteString("\r\n")
	b.Write(body)
	return b.Bytes()
}

func tokenIDsBody(n int) []byte {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = strconv.Itoa(1000 + i)
	}
	return []byte(`{"model":"m","prompt":[` + strings.Join(ids, ",") + `]}`)
}

// badGenerators build the requests too large or too regular to keep as
// files.
var badGenerators = map[string]func(c badCase) []byte{
	"header-block-17k": func(badCase) []byte {
		return badRequest("POST", "/v1/completions", []string{"X-Big: " + strings.Repeat("b", 17<<10)},
			[]byte(`{"model":"m","prompt":"hi","max_tokens":1}`))
	},
	"header-authorization-8k": func(badCase) []byte {
		// A second Authorization field would be ambiguous: replace the
		// standard one with an 8 KiB token that still holds the secret.
		req := badRequest("POST", "/v1/completions", nil, []byte(`{"model":"m","prompt":"hi","max_tokens":1}`))
		return bytes.Replace(req, []byte(badSecret), []byte(badSecret+"."+strings.Repeat("eyJhbGciOiJSUzI1NiJ9", 8<<10/20)), 1)
	},
	"headers-12k-total": func(badCase) []byte {
		var extra []string
		for i := range 12 {
			extra = append(extra, fmt.Sprintf("X-Pad-%02d: %s", i, strings.Repeat("p", 1000)))
		}
		return badRequest("POST", "/v1/completions", extra, []byte(`{"model":"m","prompt":"hi","max_tokens":1}`))
	},
	"json-nesting-100k": func(c badCase) []byte {
		const depth = 100_000
		body := `{"model":"m","prompt":` + strings.Repeat("[", depth) + strings.Repeat("]", depth) + `}`
		return badRequest("POST", c.Path, nil, []byte(body))
	},
	"body-over-limit-content-length": func(badCase) []byte {
		body := `{"model":"m","prompt":"` + strings.Repeat("x", 2*badMaxBodyBytes) + `"}`
		return badRequest("POST", "/v1/completions", nil, []byte(body))
	},
	"body-over-limit-chunked": func(badCase) []byte {
		body := []byte(`{"model":"m","prompt":"` + strings.Repeat("x", 2*badMaxBodyBytes) + `"}`)
		var chunked bytes.Buffer
		for len(body) > 0 {
			n := min(len(body), 16<<10)
			fmt.Fprintf(&chunked, "%x\r\n%s\r\n", n, body[:n])
			body = body[n:]
		}
		chunked.WriteString("0\r\n\r\n")
		return badRequest("POST", "/v1/completions", []string{"Transfer-Encoding: chunked"}, chunked.Bytes())
	},
	"context-length-token-ids": func(c badCase) []byte {
		return badRequest("POST", c.Path, nil, tokenIDsBody(contextLengthPrompt))
	},
	"prompt-at-limit-token-ids": func(c badCase) []byte {
		return badRequest("POST", c.Path, nil, tokenIDsBody(badMaxPromptTokens))
	},
}

// request returns the case's raw request bytes.
func (c badCase) request(t *testing.T) []byte {
	t.Helper()
	if c.Gen != "" {
		return badGenerators[c.Gen](c)
	}
	b := readFile(t, filepath.Join(badDir, c.File))
	if strings.HasSuffix(c.File, ".json") {
		return badRequest("POST", c.Path, nil, b)
	}
	if !bytes.Contains(b, []byte("\r\nAuthorization: Bearer "+badSecret+"\r\n")) || !bytes.Contains(b, []byte("\r\n\r\n")) {
		t.Fatalf("%s: a .http case needs CRLF line endings and the secret's Authorization header", c.File)
	}
	return b
}

// fakeVLLM answers like a vLLM engine serving badServedModel, and records
// the paths it was asked for.
type fakeVLLM struct {
	*httptest.Server
	mu    sync.Mutex
	paths []string
}

func startFakeVLLM(t *testing.T) *fakeVLLM {
	f := &fakeVLLM{}
	f.Server = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.Close)
	return f
}

func (f *fakeVLLM) serve(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	f.paths = append(f.paths, r.URL.Path)
	f.mu.Unlock()
	body, _ := io.ReadAll(r.Body)
	w.Header().Set(badBackendHeaderKey, "fake-vllm")
	w.Header().Set("Content-Type", "application/json")
	answer := func(code int, v any) {
		w.WriteHeader(code)
		_ = json.NewEncoder(w).Encode(v)
	}
	vllmError := func(code int, typ, msg string, param any) {
		answer(code, map[string]any{"error": map[string]any{"message": msg, "type": typ, "param": param, "code": code}})
	}
	switch r.URL.Path {
	case "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses":
	case "/v1/models":
		answer(200, map[string]any{"object": "list", "data": []any{map[string]any{"id": badServedModel, "object": "model"}}})
		return
	default:
		answer(404, map[string]any{"detail": "Not Found"}) // FastAPI's unknown route
		return
	}
	if r.Method != http.MethodPost {
		answer(405, map[string]any{"detail": "Method Not Allowed"})
		return
	}
	var req struct {
		Model string `json:"model"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		vllmError(400, "BadRequestError", "invalid JSON", nil)
		return
	}
	if req.Model != badServedModel {
		vllmError(404, "NotFoundError", "The model `"+req.Model+"` does not exist.", "model")
		return
	}
	answer(200, map[string]any{"id": "cmpl-1", "object": "text_completion", "created": 1, "model": badServedModel,
		"choices": []any{map[string]any{"index": 0, "text": " a", "finish_reason": "length"}},
		"usage":   map[string]any{"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}})
}

// seen returns the paths requested since mark.
func (f *fakeVLLM) seen(mark int) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.paths[mark:])
}

func (f *fakeVLLM) mark() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.paths)
}

// badExchange is what came back on one connection.
type badExchange struct {
	raw   []byte         // every byte received
	resp  *http.Response // nil: closed without a response
	body  []byte
	extra int // responses after the first: requests smuggled past the first
}

// exchangeRaw writes req on a new connection to addr, half-closes it, and
// reads the response (and any further ones) until the router closes the
// connection, everything within badCaseTimeout.
func exchangeRaw(addr string, req []byte) (x badExchange, err error) {
	conn, err := net.DialTimeout("tcp", addr, badCaseTimeout)
	if err != nil {
		return x, err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(badCaseTimeout))
	wrote := make(chan struct{})
	go func() { // written concurrently: the router may answer before the end
		defer close(wrote)
		if _, err := conn.Write(req); err == nil {
			_ = conn.(*net.TCPConn).CloseWrite()
		}
	}()
	defer func() { <-wrote }() // bounded by the deadline
	var raw bytes.Buffer
	br := bufio.NewReader(io.TeeReader(conn, &raw))
	defer func() { x.raw = raw.Bytes() }() // on every return
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		if raw.Len() == 0 && closedErr(err) {
			return x, nil // closed without a response
		}
		return x, fmt.Errorf("reading the response: %w (got %q)", err, raw.Bytes())
	}
	x.resp = resp
	if x.body, err = io.ReadAll(resp.Body); err != nil && !closedErr(err) {
		return x, fmt.Errorf("reading the response body: %w", err)
	}
	for {
		r, err := http.ReadResponse(br, nil)
		if err != nil {
			if !closedErr(err) {
				return x, fmt.Errorf("after the response: %w", err)
			}
			return x, nil
		}
		x.extra++
		_, _ = io.Copy(io.Discard, r.Body)
	}
}

// closedErr reports whether err means the peer closed the connection.
func closedErr(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		strings.Contains(err.Error(), "connection reset by peer")
}

// checkOpenAIError checks an OpenAI-style error body:
// {"error":{"message":..,"type":..,"param":..,"code":..}}, and returns its
// message.
func checkOpenAIError(resp *http.Response, body []byte) (string, error) {
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		return "", fmt.Errorf("content type %q, want application/json", ct)
	}
	var env struct {
		Error map[string]json.RawMessage `json:"error"`
	}
	if err := json.Unmarshal(body, &env); err != nil || env.Error == nil {
		return "", fmt.Errorf("not an OpenAI error body: %v", err)
	}
	var msg, typ string
	if err := json.Unmarshal(env.Error["message"], &msg); err != nil || msg == "" {
		return "", errors.New("error.message is not a non-empty string")
	}
	if err := json.Unmarshal(env.Error["type"], &typ); err != nil || typ == "" {
		return msg, errors.New("error.type is not a non-empty string")
	}
	var param *string
	if p, ok := env.Error["param"]; !ok || json.Unmarshal(p, &param) != nil {
		return msg, errors.New("error.param is not a string or null")
	}
	if c := env.Error["code"]; len(c) == 0 || string(c) == "null" {
		return msg, errors.New("error.code is missing")
	}
	return msg, nil
}

// logLine renders a log entry, its fields included.
func logLine(e observer.LoggedEntry) string {
	enc := zapcore.NewMapObjectEncoder()
	for _, f := range e.Context {
		f.AddTo(enc)
	}
	return fmt.Sprintf("%s %v", e.Message, enc.Fields)
}

// TestBadInput sends every case of the bad-input corpus (testdata/bad) to
// a kvroute proxy and checks the outcome, that kvroute's own errors are
// OpenAI-style JSON, that no response echoes the secret or the canary and
// no log line the secret, and whether the engine saw the request.
func TestBadInput(t *testing.T) {
	cases := loadBadCases(t)
	be := startFakeVLLM(t)
	core, logs := observer.New(zapcore.DebugLevel)
	var access lineBuffer
	opt := Options{Limits: Limits{MaxBodyBytes: badMaxBodyBytes, MaxHeaderBytes: badMaxHeaderBytes,
		MaxPromptTokens: badMaxPromptTokens}, Logger: zap.New(core), AccessLog: &access}
	checkLogs := func(t *testing.T) {
		for _, e := range logs.TakeAll() {
			if line := logLine(e); strings.Contains(line, badSecret) {
				t.Errorf("kvroute's log leaks the secret: %s", line)
			}
		}
		if strings.Contains(access.String(), badSecret) {
			t.Errorf("kvroute's access log leaks the secret: %s", access.String())
		}
	}
	// Registered before the proxy, so it runs after the proxy's shutdown,
	// which writes the access lines still queued.
	t.Cleanup(func() { checkLogs(t) })
	h := startProxy(t, nil, opt, be.URL)
	addr := strings.TrimPrefix(h.url, "http://")

	for _, c := range cases {
		t.Run(c.Name, func(t *testing.T) {
			req := c.request(t)
			mark := be.mark()
			x, err := exchangeRaw(addr, req)
			if err != nil {
				t.Fatal(err)
			}
			seen := be.seen(mark)
			for _, p := range seen {
				if strings.Contains(p, "smuggled") {
					t.Errorf("a smuggled request reached the engine: %s", p)
				}
			}
			if x.extra > 0 {
				t.Errorf("%d more responses after the first: a second request was read from the bytes", x.extra)
			}
			for _, s := range []string{badSecret, badCanary} {
				if bytes.Contains(x.raw, []byte(s)) {
					t.Errorf("the response echoes %q: %q", s, x.raw)
				}
			}

			outcome, status := "closed", 0
			if x.resp != nil {
				status = x.resp.StatusCode
				outcome = strconv.Itoa(status)
				if x.resp.Close && x.extra == 0 {
					outcome += "+close"
				}
			}
			ok := false
			for _, e := range c.Expect {
				ok = ok || e == "closed" && x.resp == nil || e == float64(status) && x.resp != nil || e == outcome
			}
			if !ok {
				t.Errorf("got %s, want one of %v (%s); body %q", outcome, c.Expect, c.Note, x.body)
			}

			switch {
			case c.Backend == "never" && len(seen) > 0:
				t.Errorf("the engine saw %v; kvroute must answer this itself", seen)
			case c.Backend == "once" && len(seen) != 1:
				t.Errorf("the engine saw %v, want one request", seen)
			case c.Backend == "at-most-once" && len(seen) > 1:
				t.Errorf("the engine saw %v, want at most one request", seen)
			}
			checkLogs(t)

			if x.resp == nil || status < 400 || x.resp.Header.Get(badBackendHeaderKey) != "" {
				return // closed, a success, or the engine's own answer
			}
			msg, err := checkOpenAIError(x.resp, x.body)
			if err != nil {
				t.Errorf("kvroute's %d: %v: %q", status, err, x.body)
			}
			if c.Message != "" {
				if m := regexp.MustCompile(c.Message).FindStringSubmatch(msg); m == nil {
					t.Errorf("error message %q does not match %q", msg, c.Message)
				} else if n, _ := strconv.Atoi(m[len(m)-1]); c.Gen == "context-length-token-ids" && n < contextLengthPrompt {
					t.Errorf("error message %q: %d tokens requested, the prompt has %d", msg, n, contextLengthPrompt)
				}
			}
		})
	}
}
