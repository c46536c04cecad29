package soak

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvroute/kvroute/bench/proc"
)

// kvroute's metrics the samples read (metrics/metrics.go, and the Go and
// process collectors app.New registers).
const (
	MetricGoroutines   = "go_goroutines"
	MetricHeapInuse    = "go_memstats_heap_inuse_bytes"
	MetricInFlight     = "kvroute_in_flight_requests"
	MetricIndexEntries = "kvroute_prefix_index_entries"
	MetricIndexBytes   = "kvroute_prefix_index_bytes"
	MetricCPU          = "process_cpu_seconds_total"
	// MetricQueued is the requests kvroute holds while every endpoint is
	// saturated; newer builds only.
	MetricQueued = "kvroute_queued_requests"
)

// router is the kvroute child process.
type router struct {
	cmd      *exec.Cmd
	pid      int
	api      string // base URL of the API listener
	admin    string // base URL of the admin listener
	logFile  *os.File
	done     chan struct{} // closed when the process exited
	exitCode int
	exitErr  error
	hc       *http.Client
	// token is the admin token kvsoak gives its kvroute (the environment's
	// KVROUTE_ADMIN_TOKEN), which opens /debug/pprof/ on builds that guard
	// it; older builds ignore it.
	token string
}

// startRouter runs bin with static backends and its own loopback
// listeners, logging to logPath; extra arguments come last.
func startRouter(bin string, backends []string, extra []string, logPath string) (*router, error) {
	if _, err := os.Stat(bin); err != nil {
		return nil, fmt.Errorf("kvroute binary: %w (build it with `make build`)", err)
	}
	api, err := proc.FreeLoopback()
	if err != nil {
		return nil, err
	}
	admin, err := proc.FreeLoopback()
	if err != nil {
		return nil, err
	}
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	args := append([]string{"--listen", api, "--admin-listen", admin, "--backends", strings.Join(backends, ",")}, extra...)
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	var tok [16]byte
	_, _ = rand.Read(tok[:])
	token := hex.EncodeToString(tok[:])
	cmd.Env = append(withoutKVRouteEnv(os.Environ()), "KVROUTE_ADMIN_TOKEN="+token)
	setParentDeath(cmd)
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start kvroute: %w", err)
	}
	r := &router{cmd: cmd, pid: cmd.Process.Pid, api: "http://" + api, admin: "http://" + admin, logFile: logf,
		done: make(chan struct{}), exitCode: -1, hc: &http.Client{Timeout: 5 * time.Second}, token: token}
	go func() {
		err := cmd.Wait()
		r.exitErr = err
		r.exitCode = cmd.ProcessState.ExitCode()
		close(r.done)
	}()
	return r, nil
}

// withoutKVRouteEnv drops KVROUTE_* variables: kvroute runs with its
// defaults and the flags given.
func withoutKVRouteEnv(env []string) []string {
	out := env[:0:0]
	for _, e := range env {
		if !strings.HasPrefix(e, "KVROUTE_") {
			out = append(out, e)
		}
	}
	return out
}

// waitReady polls /readyz until 200, the process exits or d passes.
func (r *router) waitReady(ctx context.Context, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		resp, err := r.hc.Get(r.admin + "/readyz")
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-r.done:
			return fmt.Errorf("kvroute exited (code %d) before it was ready; see its log", r.exitCode)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kvroute not ready after %s (last: %v)", d, err)
		}
	}
}

// terminate sends SIGTERM and waits up to timeout for the exit; it returns
// the exit code and how long the exit took. A process still running is
// killed (code -1).
func (r *router) terminate(timeout time.Duration) (code int, took time.Duration, err error) {
	start := time.Now()
	select {
	case <-r.done:
		return r.exitCode, 0, fmt.Errorf("kvroute had already exited: %v", r.exitErr)
	default:
	}
	if err := r.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		return -1, 0, err
	}
	select {
	case <-r.done:
		return r.exitCode, time.Since(start), nil
	case <-time.After(timeout):
		_ = r.cmd.Process.Kill()
		<-r.done
		return -1, time.Since(start), fmt.Errorf("kvroute did not exit within %s of SIGTERM; killed", timeout)
	}
}

// kill stops the process at once (an aborted run).
func (r *router) kill() {
	select {
	case <-r.done:
	default:
		_ = r.cmd.Process.Kill()
		<-r.done
	}
	r.logFile.Close()
}

// procStatus reads a process's resident set (bytes) from
// /proc/<pid>/status and counts its open file descriptors.
func procStatus(pid int) (rss int64, fds int, err error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, 0, err
	}
	rss = -1
	for line := range bytes.SplitSeq(b, []byte("\n")) {
		v, ok := bytes.CutPrefix(line, []byte("VmRSS:"))
		if !ok {
			continue
		}
		f := bytes.Fields(v)
		if len(f) >= 1 {
			kb, perr := strconv.ParseInt(string(f[0]), 10, 64)
			if perr == nil {
				rss = kb << 10
			}
		}
	}
	if rss < 0 {
		return 0, 0, errors.New("no VmRSS in /proc status")
	}
	ents, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/fd")
	if err != nil {
		return rss, 0, err
	}
	return rss, len(ents), nil
}

// scrape reads the named gauges and counters from kvroute's admin
// /metrics; names missing from the answer are missing from the map.
func (r *router) scrape(names ...string) (map[string]float64, error) {
	resp, err := r.hc.Get(r.admin + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("admin /metrics: status %d", resp.StatusCode)
	}
	return parseMetrics(resp.Body, names...)
}

// saveGoroutines writes kvroute's goroutine profile (stacks grouped, with
// counts) to path, so that a count that did not return to idle can be
// read against the baseline's.
func (r *router) saveGoroutines(path string) error {
	req, err := http.NewRequest(http.MethodGet, r.admin+"/debug/pprof/goroutine?debug=1", nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+r.token)
	resp, err := r.hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("goroutine profile: status %d", resp.StatusCode)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}

// parseMetrics reads Prometheus text and returns the named metrics, each
// summed over its series.
func parseMetrics(rd io.Reader, names ...string) (map[string]float64, error) {
	tp := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := tp.TextToMetricFamilies(rd)
	if err != nil {
		return nil, err
	}
	out := make(map[string]float64, len(names))
	for _, n := range names {
		if f, ok := fams[n]; ok {
			var sum float64
			for _, m := range f.GetMetric() {
				sum += metricValue(m)
			}
			out[n] = sum
		}
	}
	return out, nil
}

func metricValue(m *dto.Metric) float64 {
	switch {
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	case m.GetUntyped() != nil:
		return m.GetUntyped().GetValue()
	}
	return 0
}

// counters reads kvroute's request, retry, upstream-error and migration
// counters, as "name" or "name{label=value,...}" keys, and the mean
// migration gap in milliseconds.
func (r *router) counters() (map[string]float64, error) {
	resp, err := r.hc.Get(r.admin + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	tp := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := tp.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for name, labels := range map[string][]string{
		"kvroute_requests_total": {"code"}, "kvroute_upstream_errors_total": {"kind"}, "kvroute_retries_total": nil,
		"kvroute_upstream_cancellations_total": nil, "kvroute_retries_budget_exhausted_total": nil,
		"kvroute_overload_rejections_total": nil, "kvroute_migrations_total": {"cause", "outcome"},
	} {
		f, ok := fams[name]
		if !ok {
			continue
		}
		for _, m := range f.GetMetric() {
			var kv []string
			for _, lp := range m.GetLabel() {
				if slices.Contains(labels, lp.GetName()) {
					kv = append(kv, lp.GetName()+"="+lp.GetValue())
				}
			}
			key := name
			if len(kv) > 0 {
				key += "{" + strings.Join(kv, ",") + "}"
			}
			if v := metricValue(m); v > 0 || len(kv) < 2 { // the migration pairs that happened
				out[key] += v
			}
		}
	}
	if f, ok := fams["kvroute_migration_gap_seconds"]; ok {
		for _, m := range f.GetMetric() {
			if h := m.GetHistogram(); h.GetSampleCount() > 0 {
				out["kvroute_migration_gap_seconds (mean, ms)"] = 1000 * h.GetSampleSum() / float64(h.GetSampleCount())
			}
		}
	}
	return out, nil
}
