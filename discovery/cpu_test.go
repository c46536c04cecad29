//go:build unix

package discovery

import (
	"bufio"
	"bytes"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// cpuHelperEnv makes the test binary serve /metrics for
// TestScrapeCPU100Pods instead of running tests.
const cpuHelperEnv = "KVROUTE_DISCOVERY_METRICS_PODS"

// scrapeText is a realistic vLLM scrape: the shared vLLM 0.19 sample
// (56 KB) when present, else the module's own sample of the same shape
// (testdata/wire) grown to the same size with more histogram series.
func scrapeText() []byte {
	if b := sharedSample("vllm-metrics.txt"); b != nil {
		return b
	}
	b, err := os.ReadFile("../testdata/wire/vllm-metrics.txt")
	if err != nil {
		panic(err)
	}
	var buf bytes.Buffer
	buf.Write(b)
	for i := 0; buf.Len() < 56<<10; i++ {
		fmt.Fprintf(&buf, "vllm:request_prefill_kv_computed_tokens_bucket{engine=\"%d\",le=\"%d.0\",model_name=\"Qwen/Qwen2.5-7B-Instruct\"} %d.0\n", i/12+1, i%12, i*7)
	}
	return buf.Bytes()
}

// serveMetricsForever serves scrapeText on N loopback listeners, prints
// their addresses, then serves until killed.
func serveMetricsForever() {
	n, _ := strconv.Atoi(os.Getenv(cpuHelperEnv))
	text := scrapeText()
	h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		_, _ = w.Write(text)
	})
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			panic(err)
		}
		fmt.Println(ln.Addr().String())
		go func() { _ = http.Serve(ln, h) }()
	}
	fmt.Println("ready")
	select {}
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestScrapeCPU100Pods measures the CPU kvroute spends scraping 100 pods
// at the default interval. The pods run in a child process, so getrusage
// of this process counts the scraper only. It runs for seconds, so only on
// demand:
//
//	KVROUTE_SCRAPE_CPU=10s go test -run TestScrapeCPU100Pods -v ./discovery/
func TestScrapeCPU100Pods(t *testing.T) {
	window, err := time.ParseDuration(os.Getenv("KVROUTE_SCRAPE_CPU"))
	if err != nil {
		t.Skip("set KVROUTE_SCRAPE_CPU to a duration (e.g. 10s) to measure scrape CPU")
	}
	const pods = 100
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), cpuHelperEnv+"="+strconv.Itoa(pods))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	var targets []string
	sc := bufio.NewScanner(out)
	for sc.Scan() && sc.Text() != "ready" {
		targets = append(targets, "http://"+strings.TrimSpace(sc.Text()))
	}
	if len(targets) != pods {
		t.Fatalf("%d pods started", len(targets))
	}

	o := DefaultOptions()
	o.Health.Disabled = true
	f, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	var scrapes, failures atomic.Int64
	f.trace = func(ev string, _ *Endpoint) {
		switch ev {
		case "scrape":
			scrapes.Add(1)
		case "scrape-fail":
			failures.Add(1)
		}
	}
	if err := f.AddStatic(RoleMixed, targets); err != nil {
		t.Fatal(err)
	}
	run(t, f)
	for scrapes.Load() < 2*pods { // warm up: connections open, buffers grown
		time.Sleep(50 * time.Millisecond)
	}
	s0, c0, w0 := scrapes.Load(), cpuTime(), time.Now()
	time.Sleep(window)
	s1, c1, w1 := scrapes.Load(), cpuTime(), time.Now()
	wall := w1.Sub(w0).Seconds()
	cpu := (c1 - c0).Seconds()
	t.Logf("%d pods × %d B every %v: %.0f scrapes/s, %d failures; CPU %.3f s over %.1f s wall = %.4f CPU-seconds per second (%.1f µs per scrape)",
		pods, len(scrapeText()), o.Scrape.Interval, float64(s1-s0)/wall, failures.Load(), cpu, wall, cpu/wall,
		cpu/float64(s1-s0)*1e6)
}
