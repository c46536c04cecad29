package sim

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/bench/leakcheck"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

func TestMain(m *testing.M) {
	if os.Getenv(cpuChildEnv) != "" {
		cpuChild()
		os.Exit(0)
	}
	leakcheck.VerifyTestMain(m)
}

type dtoFamily = dto.MetricFamily

const dtoHistogram = dto.MetricType_HISTOGRAM

// fastConfig is a small, fast pod for tests: 1000× real time.
func fastConfig() Config {
	return Config{TimeScale: 1000, Seed: 1}
}

// servePod serves a pod on loopback for the test's lifetime.
func servePod(t *testing.T, cfg Config) (*Pod, string) {
	t.Helper()
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- p.Serve(ln) }()
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
		if err := <-served; err != ErrClosed {
			t.Errorf("serve returned %v, want ErrClosed", err)
		}
	})
	return p, "http://" + ln.Addr().String()
}

// newClient returns an HTTP client whose idle connections close with the test.
func newClient(t *testing.T) *http.Client {
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// post sends a JSON body and returns status, headers and body.
func post(t *testing.T, c *http.Client, url string, body any, hdr ...string) (int, http.Header, []byte) {
	t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case string:
		rd = strings.NewReader(b)
	case []byte:
		rd = bytes.NewReader(b)
	default:
		buf, err := json.Marshal(b)
		if err != nil {
			t.Fatal(err)
		}
		rd = bytes.NewReader(buf)
	}
	req, err := http.NewRequest(http.MethodPost, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header, out
}

func get(t *testing.T, c *http.Client, url string) (int, []byte) {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, b
}

// sseEvents splits an SSE body into its data payloads, failing on any line
// that is not `data: ...` followed by a blank line.
func sseEvents(t *testing.T, body []byte) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	expectBlank := false
	for sc.Scan() {
		line := sc.Text()
		if expectBlank {
			if line != "" {
				t.Fatalf("SSE event not followed by a blank line: %q", line)
			}
			expectBlank = false
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("SSE line without data prefix: %q", line)
		}
		out = append(out, data)
		expectBlank = true
	}
	return out
}

// usageOf decodes the usage object of a JSON response or chunk.
type usageJSON struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func (u usageJSON) cached() int {
	if u.PromptTokensDetails == nil {
		return -1
	}
	return u.PromptTokensDetails.CachedTokens
}

type completionJSON struct {
	ID      string `json:"id"`
	Choices []struct {
		Index        int     `json:"index"`
		Text         string  `json:"text"`
		FinishReason *string `json:"finish_reason"`
		Message      struct {
			Content string `json:"content"`
		} `json:"message"`
	} `json:"choices"`
	Usage            usageJSON       `json:"usage"`
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
}

func decodeCompletion(t *testing.T, body []byte) completionJSON {
	t.Helper()
	var c completionJSON
	if err := json.Unmarshal(body, &c); err != nil {
		t.Fatalf("decode %s: %v", body, err)
	}
	return c
}

// scrape fetches /metrics and parses it.
func scrape(t *testing.T, c *http.Client, url string) map[string]*dto.MetricFamily {
	t.Helper()
	code, body := get(t, c, url+"/metrics")
	if code != 200 {
		t.Fatalf("/metrics: %d", code)
	}
	return parseMetrics(t, body)
}

func parseMetrics(t *testing.T, body []byte) map[string]*dto.MetricFamily {
	t.Helper()
	p := expfmt.NewTextParser(model.LegacyValidation)
	mfs, err := p.TextToMetricFamilies(bytes.NewReader(body))
	if err != nil {
		t.Fatalf("parse metrics: %v", err)
	}
	return mfs
}

// metricValue returns the value of the only series of a counter or gauge,
// or a histogram's sum.
func metricValue(t *testing.T, mfs map[string]*dto.MetricFamily, name string) float64 {
	t.Helper()
	mf, ok := mfs[name]
	if !ok || len(mf.GetMetric()) == 0 {
		t.Fatalf("metric %s missing", name)
	}
	m := mf.GetMetric()[0]
	switch {
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	case m.Histogram != nil:
		return m.GetHistogram().GetSampleSum()
	case m.Untyped != nil:
		return m.GetUntyped().GetValue()
	}
	t.Fatalf("metric %s has no value", name)
	return 0
}

func histCount(t *testing.T, mfs map[string]*dto.MetricFamily, name string) uint64 {
	t.Helper()
	mf, ok := mfs[name]
	if !ok || len(mf.GetMetric()) == 0 {
		t.Fatalf("metric %s missing", name)
	}
	return mf.GetMetric()[0].GetHistogram().GetSampleCount()
}

// wireDir returns the directory of wire samples: shared/vllm-wire (the
// real captures) when the checkout has it above the package directory,
// else the module's own testdata/wire, which keeps their shapes.
func wireDir(t *testing.T) string {
	t.Helper()
	if dir := sharedWireDir(t); dir != "" {
		return dir
	}
	return ownWireDir(t)
}

// sharedWireDir returns shared/vllm-wire above the package directory, or
// "" when there is none.
func sharedWireDir(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		cand := filepath.Join(dir, "shared", "vllm-wire")
		if st, err := os.Stat(cand); err == nil && st.IsDir() {
			return cand
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return ""
		}
		dir = parent
	}
}

// ownWireDir returns the module's testdata/wire.
func ownWireDir(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs(filepath.Join("..", "..", "testdata", "wire"))
	if err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		t.Fatalf("testdata/wire not found: %v", err)
	}
	return dir
}

// tokenPrompt returns n consecutive token ids from first (wrapping below
// the vocabulary size), as a JSON-able slice.
func tokenPrompt(first, n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = (first + i) % 128000
	}
	return out
}
