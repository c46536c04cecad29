package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/bench/leakcheck"
	"github.com/kvroute/kvroute/bench/sim"
)

func TestMain(m *testing.M) {
	leakcheck.VerifyTestMain(m)
}

func TestRun(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		wantErr string
		pods    int
	}{
		{name: "two pods", args: []string{"--pods", "2", "--port", "0", "--time-scale", "100", "--prefill-pods", "1"}, pods: 2},
		{name: "mixed profile", args: []string{"--pods", "2", "--port", "0", "--time-scale", "100", "--profile", "mixed"}, pods: 2},
		{name: "KV events and CPU tier", args: []string{"--pods", "2", "--port", "0", "--kv-events-port", "-1", "--kv-events-replay-port", "-1",
			"--kv-events-topic", "kv@{addr}@{model}", "--cpu-blocks", "1000"}, pods: 2},
		{name: "replay without events", args: []string{"--kv-events-replay-port", "5558"}, wantErr: "without a KV events port"},
		{name: "bad role", args: []string{"--role", "both"}, wantErr: "unknown role"},
		{name: "bad prefill count", args: []string{"--pods", "1", "--prefill-pods", "2"}, wantErr: "prefill-pods"},
		{name: "bad config", args: []string{"--block-size", "-1"}, wantErr: "block size"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			pr, pw := io.Pipe()
			errc := make(chan error, 1)
			go func() {
				err := run(ctx, tc.args, pw)
				pw.CloseWithError(io.EOF)
				errc <- err
			}()
			sc := bufio.NewScanner(pr)
			var urls []string
			for len(urls) < tc.pods && sc.Scan() {
				urls = append(urls, sc.Text())
			}
			if tc.wantErr != "" {
				go io.Copy(io.Discard, pr)
				if err := <-errc; err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("run: %v, want error containing %q", err, tc.wantErr)
				}
				return
			}
			if len(urls) != tc.pods {
				t.Fatalf("printed %d URLs, want %d", len(urls), tc.pods)
			}
			tr := &http.Transport{}
			c := &http.Client{Transport: tr}
			for _, u := range urls {
				resp, err := c.Get(u + "/health")
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				if resp.StatusCode != 200 {
					t.Errorf("%s/health: %d", u, resp.StatusCode)
				}
			}
			tr.CloseIdleConnections()
			cancel()
			if err := <-errc; err != nil {
				t.Fatalf("run: %v", err)
			}
		})
	}
}

// --profile sets the engine; pod flags given explicitly win over it.
func TestParseProfile(t *testing.T) {
	_, cfgs, err := parse([]string{"--pods", "3", "--profile", "mixed", "--max-num-seqs", "32", "--seed", "5", "--port", "0"})
	if err != nil {
		t.Fatal(err)
	}
	p, _ := sim.LookupProfile(sim.ProfileMixed)
	for i, c := range cfgs {
		if c.MaxNumSeqs != 32 || c.Seed != 5+uint64(i) || c.MemBandwidth != p.Engine(i).MemBandwidth ||
			c.NumGPUBlocks != p.Engine(i).NumGPUBlocks || c.Model != "meta-llama/Llama-3.1-8B-Instruct" {
			t.Errorf("pod %d: %+v", i, c)
		}
	}
	_, cfgs, err = parse([]string{"--profile", "slow-large", "--model", "m", "--mem-bandwidth", "1e12"})
	if err != nil {
		t.Fatal(err)
	}
	if c := cfgs[0]; c.Model != "m" || c.MemBandwidth != 1e12 || c.MaxNumSeqs != 8 || c.PrefillTokensPerSec != 2200 {
		t.Errorf("slow-large with overrides: %+v", c)
	}
	_, cfgs, err = parse(nil)
	if err != nil || !reflect.DeepEqual(cfgs[0], sim.DefaultConfig()) {
		t.Errorf("no flags: %+v, %v; want DefaultConfig", cfgs, err)
	}
	if _, _, err := parse([]string{"--profile", "tpu"}); err == nil || !strings.Contains(err.Error(), "unknown profile") {
		t.Errorf("unknown profile: %v", err)
	}
}

// The KV event flags reach every pod; pod i binds the ports +i.
func TestParseKVEvents(t *testing.T) {
	_, cfgs, err := parse([]string{"--pods", "3", "--kv-events-port", "5557", "--kv-events-replay-port", "5657",
		"--kv-events-host", "0.0.0.0", "--kv-events-topic", "kv@{addr}@{model}", "--kv-events-array-encoding",
		"--cpu-blocks", "4096", "--cpu-bandwidth", "5e10"})
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range cfgs {
		if c.KVEventsPort != 5557+i || c.KVEventsReplayPort != 5657+i || c.KVEventsHost != "0.0.0.0" ||
			c.KVEventsTopic != "kv@{addr}@{model}" || !c.KVEventsArrayEncoding || c.CPUBlocks != 4096 || c.CPUBandwidth != 5e10 {
			t.Errorf("pod %d: %+v", i, c)
		}
	}
}
