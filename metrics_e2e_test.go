package main

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvroute/kvroute/bench/sim"
)

// goldenMetric is one line of testdata/metrics.golden.
type goldenMetric struct{ typ, labels string }

func readGolden(t *testing.T) map[string]goldenMetric {
	t.Helper()
	f, err := os.Open("testdata/metrics.golden")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string]goldenMetric{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		f := strings.Fields(l)
		if len(f) != 3 {
			t.Fatalf("golden line %q: want name type labels", l)
		}
		out[f[0]] = goldenMetric{f[1], f[2]}
	}
	return out
}

// exported returns the families of a /metrics text as golden lines,
// leaving out the Go runtime's and the process's.
func exported(t *testing.T, text string) map[string]goldenMetric {
	t.Helper()
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]goldenMetric{}
	for name, mf := range mfs {
		if strings.HasPrefix(name, "go_") || strings.HasPrefix(name, "process_") || strings.HasPrefix(name, "promhttp_") {
			continue
		}
		var labels []string
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if !slices.Contains(labels, l.GetName()) {
					labels = append(labels, l.GetName())
				}
			}
		}
		slices.Sort(labels)
		l := strings.Join(labels, ",")
		if l == "" {
			l = "-"
		}
		out[name] = goldenMetric{strings.ToLower(dto.MetricType_name[int32(mf.GetType())]), l}
	}
	return out
}

// TestMetricsGolden runs kvroute over a mixed pool (found through DNS) and
// a prefill and a decode pool, sends traffic of every kind (disaggregated, streamed,
// refused), and checks that /metrics exports exactly the families of
// testdata/metrics.golden, with their types and label names; then that a
// real Prometheus's promtool accepts the exposition.
func TestMetricsGolden(t *testing.T) {
	fleet, err := sim.StartFleetOf(sim.Config{TimeScale: 100, Model: "m"},
		sim.Config{TimeScale: 100, Role: sim.RolePrefill, Model: "m", Seed: 1},
		sim.Config{TimeScale: 100, Role: sim.RoleDecode, Model: "m", Seed: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fleet.Close() })
	// The mixed pool through DNS (a headless Service's name on a DNS
	// server on loopback), the others static.
	_, port, _ := net.SplitHostPort(strings.TrimPrefix(fleet.URL(0), "http://"))
	_, dnsAddr := startZone(t, "vllm.llm.svc.cluster.local", "127.0.0.1")
	addrs, stop := startKvroute(t, "--service", "vllm.llm.svc.cluster.local:"+port, "--dns-server", dnsAddr,
		"--prefill-backends", fleet.URL(1), "--decode-backends", fleet.URL(2), "--scrape-interval", "100ms")
	defer stop()

	api := "http://" + addrs.API
	long := strings.Repeat("a long prompt that no pod has seen ", 300)
	for _, c := range []struct {
		path, body string
		code       int
	}{
		{"/v1/completions", `{"model":"m","max_tokens":4,"prompt":"` + long + `"}`, 200},
		{"/v1/chat/completions", `{"model":"m","max_tokens":8,"stream":true,"messages":[{"role":"user","content":"hello"}]}`, 200},
		{"/v1/completions", `{"model":"m","max_tokens":8,"stream":true,"prompt":"tell me"}`, 200},
		{"/v1/completions", `{"model":"no-such-model","prompt":"x"}`, 404},
		{"/v1/completions", `{"model":`, 400},
	} {
		resp, err := http.Post(api+c.path, "application/json", strings.NewReader(c.body))
		if err != nil {
			t.Fatal(err)
		}
		var b bytes.Buffer
		_, _ = b.ReadFrom(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.code {
			t.Fatalf("%s %s: %d %s, want %d", c.path, c.body[:min(40, len(c.body))], resp.StatusCode, b.String(), c.code)
		}
	}

	// Whether a request is disaggregated depends on the pool its prompt's
	// home is in (a hash of the pods' addresses, random ports): new long
	// prompts until one went to the decode pool (each does with about
	// even odds).
	for i := 0; !strings.Contains(scrapeText(t, "http://"+addrs.Admin+"/metrics"), "kvroute_pd_decisions_total{"); i++ {
		if i == 30 {
			t.Fatal("30 new prompts and none went to the decode pool")
		}
		resp, err := http.Post(api+"/v1/completions", "application/json",
			strings.NewReader(fmt.Sprintf(`{"model":"m","max_tokens":4,"prompt":"%d %s"}`, i, long)))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("a new long prompt: %d", resp.StatusCode)
		}
	}

	golden := readGolden(t)
	var text string
	var got map[string]goldenMetric
	for deadline := time.Now().Add(10 * time.Second); ; {
		text = scrapeText(t, "http://"+addrs.Admin+"/metrics")
		got = exported(t, text)
		if len(got) >= len(golden) || time.Now().After(deadline) {
			break // the scraped and learned series appear after a scrape
		}
		time.Sleep(100 * time.Millisecond)
	}
	for name, g := range golden {
		switch e, ok := got[name]; {
		case !ok:
			t.Errorf("%s (%s %s) is in testdata/metrics.golden but not exported", name, g.typ, g.labels)
		case e != g:
			t.Errorf("%s is exported as %s %s, golden says %s %s", name, e.typ, e.labels, g.typ, g.labels)
		}
	}
	for name, e := range got {
		if _, ok := golden[name]; !ok {
			t.Errorf("%s %s %s is exported but not in testdata/metrics.golden (add it, deliberately)", name, e.typ, e.labels)
		}
	}
	if !strings.Contains(text, `kvroute_build_info{goversion="go`) {
		t.Errorf("no kvroute_build_info with the Go version:\n%s", grepLines(text, "build_info"))
	}

	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool not found (Debian package prometheus; .ci/run installs it): the exposition was not checked by Prometheus")
	}
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = strings.NewReader(text)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("promtool check metrics: %v\n%s", err, out)
	}
}
