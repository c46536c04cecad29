package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
)

func TestConfigFromFlagsAndEnv(t *testing.T) {
	env := map[string]string{
		"KVROUTE_BACKENDS":      "http://10.0.0.1:8000,http://10.0.0.2:8000",
		"KVROUTE_POLICY":        "random",
		"KVROUTE_RETRIES":       "5",
		"KVROUTE_DRAIN_TIMEOUT": "90s",
	}
	c, err := parseConfig([]string{"--policy", "round-robin", "--backends", "http://a:1", "--backends", "http://b:2"},
		func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.Policy != "round-robin" {
		t.Errorf("the flag must win over the environment: %q", c.Policy)
	}
	if len(c.Backends) != 2 || c.Backends[1] != "http://b:2" {
		t.Errorf("backends %v", c.Backends)
	}
	if c.Retries != 5 || c.DrainTimeout != 90*time.Second {
		t.Errorf("environment not applied: retries %d drain %s", c.Retries, c.DrainTimeout)
	}
	if c.Listen != ":8000" || c.AdminListen != ":9090" {
		t.Errorf("defaults %q %q", c.Listen, c.AdminListen)
	}
	if err := c.Validate(); err != nil {
		t.Errorf("valid config rejected: %v", err)
	}

	_, err = parseConfig(nil, func(k string) string {
		if k == "KVROUTE_RETRIES" {
			return "many"
		}
		return ""
	}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "KVROUTE_RETRIES") {
		t.Errorf("bad environment value: %v", err)
	}
}

func TestValidateReportsEveryProblem(t *testing.T) {
	c, err := parseConfig([]string{"--listen", "nonsense", "--policy", "magic", "--backends", "ftp://x",
		"--retries", "-1", "--log-format", "xml", "--connect-timeout", "-1s", "--engine-dialect", "tgi", "--health-path", "health"},
		func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	err = c.Validate()
	if err == nil {
		t.Fatal("invalid config accepted")
	}
	for _, want := range []string{"--listen", "--policy", "--backends", "--retries", "--log-format", "--connect-timeout",
		"--engine-dialect", "--health-path"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %s:\n%v", want, err)
		}
	}
}

func TestHelpIsGrouped(t *testing.T) {
	var out bytes.Buffer
	_, err := parseConfig([]string{"--help"}, func(string) string { return "" }, &out)
	if !errors.Is(err, pflag.ErrHelp) {
		t.Fatalf("err %v", err)
	}
	for _, want := range []string{"Listeners:", "Backends and routing:", "Upstream connections:", "Operations:", "KVROUTE_", "--backends"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("help lacks %q", want)
		}
	}
}

// SIGTERM (a cancelled context): /readyz turns 503, the open stream
// finishes, run returns nil.
func TestGracefulDrain(t *testing.T) {
	next := make(chan struct{})
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: first\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-next:
		case <-r.Context().Done():
			return
		case <-time.After(30 * time.Second): // a deadlock guard
			return
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}))
	defer backend.Close()

	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan readyAddrs, 1)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
			"--backends", backend.URL, "--drain-timeout", "20s", "--log-level", "warn"}, io.Discard, io.Discard, ready)
	}()
	var addrs readyAddrs
	select {
	case addrs = <-ready:
	case err := <-done:
		t.Fatal(err)
	case <-time.After(10 * time.Second):
		cancel()
		t.Fatal("kvroute did not start")
	}
	get := func(path string) int {
		resp, err := http.Get("http://" + addrs.Admin + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if get("/readyz") != 200 || get("/livez") != 200 || get("/metrics") != 200 {
		t.Fatal("admin endpoints not healthy before the drain")
	}
	mresp, err := http.Get("http://" + addrs.Admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	exposition, _ := io.ReadAll(mresp.Body)
	mresp.Body.Close()
	for _, name := range []string{"kvroute_prefix_index_entries ", "kvroute_prefix_homes ", "kvroute_prefix_foreign_share ", "llm_router_cache_hit_ratio "} {
		if !strings.Contains(string(exposition), name) {
			t.Errorf("/metrics lacks %s", name)
		}
	}

	resp, err := http.Post("http://"+addrs.API+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"m","prompt":"x","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(resp.Body)
	if line, _ := br.ReadString('\n'); line != "data: first\n" {
		t.Fatalf("first line %q", line)
	}
	cancel() // SIGTERM
	deadline := time.Now().Add(10 * time.Second)
	for get("/readyz") != http.StatusServiceUnavailable {
		if time.Now().After(deadline) {
			t.Fatal("/readyz never turned 503")
		}
		time.Sleep(5 * time.Millisecond)
	}
	close(next) // the stream may now finish
	rest, err := io.ReadAll(br)
	resp.Body.Close()
	if err != nil || !strings.Contains(string(rest), "[DONE]") {
		t.Fatalf("stream cut by the drain: %q %v", rest, err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("run did not return after the drain")
	}
}

func TestRunRejectsBadConfig(t *testing.T) {
	err := run(context.Background(), []string{"--policy", "nope"}, io.Discard, io.Discard, nil)
	if err == nil || !strings.Contains(err.Error(), "--policy") || !strings.Contains(err.Error(), "no backends") {
		t.Fatalf("err = %v", err)
	}
}

// A learned constant set by flag or environment is pinned; the others stay
// learned.
func TestSetConstantsArePinned(t *testing.T) {
	c, err := parseConfig([]string{"--backends", "http://a:1", "--prefix-decode-cost", "0.02"}, func(k string) string {
		if k == "KVROUTE_PREFIX_BATCH_LIMIT" {
			return "8"
		}
		return ""
	}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(c.Prefix.Pinned, ","); got != "batch_limit,decode_cost_sec" || c.Prefix.BatchLimit != 8 {
		t.Errorf("pinned %q, batch limit %d", got, c.Prefix.BatchLimit)
	}
	if err := c.Validate(); err != nil {
		t.Error(err)
	}
}

// TestKVEventsListenFlag: --kv-events-listen takes a ZeroMQ endpoint as
// vLLM and llm-d write it (tcp://HOST:PORT) or HOST:PORT, and refuses
// other transports naming what it accepts.
func TestKVEventsListenFlag(t *testing.T) {
	tests := []struct {
		name, listen string
		ok           bool
	}{
		{name: "host:port", listen: "127.0.0.1:5557", ok: true},
		{name: "tcp://", listen: "tcp://127.0.0.1:5557", ok: true},
		{name: "tcp:// every interface", listen: "tcp://*:5557", ok: true},
		{name: "tcp:// IPv6", listen: "tcp://[::]:5557", ok: true},
		{name: "ipc", listen: "ipc:///tmp/kv-events"},
		{name: "inproc", listen: "inproc://kv-events"},
		{name: "no port", listen: "tcp://127.0.0.1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := parseConfig([]string{"--backends", "http://a:1", "--kv-events-listen", tt.listen},
				func(string) string { return "" }, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			err = c.Validate()
			if tt.ok {
				if err != nil {
					t.Fatalf("--kv-events-listen %s refused: %v", tt.listen, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), "--kv-events-listen") || !strings.Contains(err.Error(), "tcp://HOST:PORT or HOST:PORT") {
				t.Fatalf("--kv-events-listen %s: %v, want an error naming the flag and what it accepts", tt.listen, err)
			}
		})
	}
}
