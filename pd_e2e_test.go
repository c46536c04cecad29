package main

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/sim"
)

// kvroute starts with only a prefill and a decode pool, given by flags,
// disaggregates a long prompt and reports the PD metrics, the decode pods'
// KV usage among them.
func TestPDFromFlags(t *testing.T) {
	fleet, err := sim.StartFleetOf(sim.Config{TimeScale: 100, Role: sim.RolePrefill, Model: "m"},
		sim.Config{TimeScale: 100, Role: sim.RoleDecode, Model: "m", Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fleet.Close() })
	addrs, stop := startKvroute(t, "--prefill-backends", fleet.URL(0), "--decode-backends", fleet.URL(1),
		"--scrape-interval", "100ms")
	defer stop()

	prompt := strings.Repeat("a long prompt that no pod has seen ", 300)
	resp, err := http.Post("http://"+addrs.API+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"m","max_tokens":4,"prompt":"`+prompt+`"}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"cached_tokens":`) {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		m := scrapeText(t, "http://"+addrs.Admin+"/metrics")
		ok := strings.Contains(m, `kvroute_pd_decisions_total{decision="disaggregated"} 1`) &&
			strings.Contains(m, `llm_decode_kv_cache_usage_percent{endpoint="`+fleet.URL(1)+`"}`) &&
			strings.Contains(m, "llm_prefill_queue_seconds_count 1") && strings.Contains(m, "llm_request_e2e_seconds_count 1")
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/metrics lacks the PD series:\n%s", grepLines(m, "pd_", "llm_"))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestPDConfigValidation(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string // "" → valid
	}{
		{[]string{"--prefill-backends", "http://10.0.0.1:8000", "--decode-backends", "http://10.0.0.2:8000"}, ""},
		{[]string{"--decode-backends", "http://10.0.0.2:8000"}, ""},
		{[]string{"--backends", "http://10.0.0.3:8000", "--prefill-backends", "http://10.0.0.1:8000", "--decode-backends", "http://10.0.0.2:8000"}, ""},
		{[]string{"--prefill-backends", "http://10.0.0.1:8000#bootstrap=9000", "--decode-backends", "http://10.0.0.2:8000", "--pd-protocol", "sglang"}, ""},
		{[]string{"--prefill-backends", "http://10.0.0.1:8000"}, "a prefill pool needs a decode pool"},
		{[]string{"--decode-backends", "http://10.0.0.2:8000", "--pd-protocol", "sglang"}, "needs a prefill pool"},
		{[]string{"--backends", "http://10.0.0.3:8000", "--pd-protocol", "mooncake"}, "--pd-protocol"},
		{[]string{"--backends", "http://10.0.0.3:8000", "--pd-bootstrap-port", "0"}, "--pd-bootstrap-port"},
		{[]string{"--prefill-backends", "http://10.0.0.1:8000#boot=1", "--decode-backends", "http://10.0.0.2:8000"}, "#bootstrap=PORT"},
	} {
		c, err := parseConfig(tc.args, func(string) string { return "" }, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		err = c.Validate()
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%v: %v", tc.args, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%v: error %v, want one mentioning %q", tc.args, err, tc.want)
		}
	}
}

// startKvroute runs kvroute with args on loopback listeners; stop drains
// it and waits for run to return.
func startKvroute(t *testing.T, args ...string) (readyAddrs, func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan readyAddrs, 1)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, append([]string{"--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
			"--drain-timeout", "5s", "--log-level", "error"}, args...), io.Discard, io.Discard, ready)
	}()
	select {
	case a := <-ready:
		return a, func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("run: %v", err)
			}
		}
	case err := <-done:
		cancel()
		t.Fatal(err)
	case <-time.After(10 * time.Second):
		cancel()
		t.Fatal("kvroute did not start")
	}
	return readyAddrs{}, nil
}

func scrapeText(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// grepLines returns the lines of s containing any of subs.
func grepLines(s string, subs ...string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		for _, sub := range subs {
			if strings.Contains(l, sub) {
				out = append(out, l)
				break
			}
		}
	}
	return strings.Join(out, "\n")
}
