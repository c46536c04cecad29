package hop

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvroute/kvroute/bench/proc"
)

// Memory per stream and per idle connection: kvroute (its binary, default
// flags) in front of backendPods instant pods, n SSE streams held open
// through it, then n idle keep-alive connections; kvroute's resident
// memory (VmRSS) is read before and with them open.

// MemoryReport is what MeasureMemory found. Per one stream or connection:
// the growth of kvroute's RSS, and of the Go heap and goroutine stacks in
// use (go_memstats_*_inuse_bytes from its /metrics), which say where the
// RSS went.
type MemoryReport struct {
	Streams        int     `json:"streams"`
	BaseRSSKiB     int     `json:"base_rss_kib"`
	StreamsRSSKiB  int     `json:"streams_rss_kib"`
	PerStreamKiB   float64 `json:"per_stream_kib"`
	StreamHeapKiB  float64 `json:"per_stream_heap_inuse_kib"`
	StreamStackKiB float64 `json:"per_stream_stack_inuse_kib"`
	IdleConns      int     `json:"idle_conns"`
	IdleRSSKiB     int     `json:"idle_rss_kib"`
	PerIdleConnKiB float64 `json:"per_idle_conn_kib"`
	IdleHeapKiB    float64 `json:"per_idle_conn_heap_inuse_kib"`
	IdleStackKiB   float64 `json:"per_idle_conn_stack_inuse_kib"`
	Note           string  `json:"note"`
}

// memSample is kvroute's memory at one moment, in KiB.
type memSample struct{ rss, heap, stack float64 }

// per is the growth from a to b, per one of n.
func per(a, b memSample, n int) memSample {
	d := float64(n)
	return memSample{(b.rss - a.rss) / d, (b.heap - a.heap) / d, (b.stack - a.stack) / d}
}

// backendPods spreads the streams so that no pod needs more upstream
// connections than kvroute's default --max-conns-per-endpoint (4096).
const backendPods = 4

// holdBackend answers a streamed request with one event and holds the
// stream open until release is closed; other requests get a small JSON.
type holdBackend struct {
	srvs    []*fasthttp.Server
	addrs   []string
	release chan struct{}
}

func startHoldBackend(pods int) (*holdBackend, error) {
	b := &holdBackend{release: make(chan struct{})}
	for range pods {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.close()
			return nil, err
		}
		s := &fasthttp.Server{Handler: b.handle, NoDefaultDate: true, ReadBufferSize: 4 << 10, WriteBufferSize: 4 << 10,
			Concurrency: 1 << 20}
		go func() { _ = s.Serve(ln) }()
		b.srvs, b.addrs = append(b.srvs, s), append(b.addrs, ln.Addr().String())
	}
	return b, nil
}

func (b *holdBackend) handle(ctx *fasthttp.RequestCtx) {
	if !bytes.Contains(ctx.PostBody(), []byte(`"stream":true`)) {
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"id":"cmpl-0","choices":[{"index":0,"text":" ok","finish_reason":"length"}]}`)
		return
	}
	ctx.SetContentType("text/event-stream")
	ctx.SetBodyStreamWriter(func(w *bufio.Writer) {
		_, _ = w.WriteString("data: {\"id\":\"cmpl-0\",\"choices\":[{\"index\":0,\"text\":\" first\"}]}\n\n")
		if w.Flush() != nil {
			return
		}
		<-b.release
		_, _ = w.WriteString("data: [DONE]\n\n")
		_ = w.Flush()
	})
}

func (b *holdBackend) close() {
	select {
	case <-b.release:
	default:
		close(b.release)
	}
	for _, s := range b.srvs {
		_ = s.Shutdown()
	}
}

// rssKiB reads a process's VmRSS.
func rssKiB(pid int) (int, error) {
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(st), "\n") {
		if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			return strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
		}
	}
	return 0, errors.New("no VmRSS")
}

// openConns opens n connections to addr, each sending req and reading its
// answer up to (and including) the first occurrence of until; it returns
// them open. Dials go 100 at a time.
func openConns(ctx context.Context, addr string, n int, req []byte, until []byte) ([]net.Conn, error) {
	conns := make([]net.Conn, n)
	var mu sync.Mutex
	var firstErr error
	sem := make(chan struct{}, 100)
	var wg sync.WaitGroup
	for i := range n {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			c, err := (&net.Dialer{Timeout: 10 * time.Second}).DialContext(ctx, "tcp", addr)
			if err == nil {
				_ = c.SetDeadline(time.Now().Add(30 * time.Second))
				if _, err = c.Write(req); err == nil {
					err = readUntil(c, until)
				}
				_ = c.SetDeadline(time.Time{})
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if c != nil {
					c.Close()
				}
				if firstErr == nil {
					firstErr = fmt.Errorf("connection %d: %w", i, err)
				}
				return
			}
			conns[i] = c
		}()
	}
	wg.Wait()
	if firstErr != nil {
		closeAll(conns)
		return nil, firstErr
	}
	return conns, nil
}

// readUntil reads c until until has been seen.
func readUntil(c net.Conn, until []byte) error {
	var got []byte
	buf := make([]byte, 4096)
	for !bytes.Contains(got, until) {
		n, err := c.Read(buf)
		if err != nil {
			return err
		}
		got = append(got, buf[:n]...)
	}
	return nil
}

func closeAll(conns []net.Conn) {
	for _, c := range conns {
		if c != nil {
			c.Close()
		}
	}
}

func httpPost(path, body string) []byte {
	return []byte("POST " + path + " HTTP/1.1\r\nHost: kvroute\r\nContent-Type: application/json\r\nContent-Length: " +
		strconv.Itoa(len(body)) + "\r\n\r\n" + body)
}

// MeasureMemory runs the measurement with n streams, then n idle
// connections, each through a fresh kvroute process.
func MeasureMemory(ctx context.Context, kvroute, dir string, n int) (*MemoryReport, error) {
	be, err := startHoldBackend(backendPods)
	if err != nil {
		return nil, err
	}
	defer be.close()
	rep := &MemoryReport{Streams: n, IdleConns: n,
		Note: "VmRSS of the kvroute process (Go heap, stacks, buffers of both sides in user space) and the Go runtime's heap and stack figures, each measurement in a fresh process after a warm-up; kernel socket buffers are not in it"}
	stream := httpPost("/v1/completions", `{"model":"m","prompt":"hold this stream open","stream":true}`)
	before, with, err := memWith(ctx, kvroute, dir, be, n, stream, []byte("data: "), "streams")
	if err != nil {
		return nil, fmt.Errorf("streams: %w", err)
	}
	one := per(before, with, n)
	rep.BaseRSSKiB, rep.StreamsRSSKiB = int(before.rss), int(with.rss)
	rep.PerStreamKiB, rep.StreamHeapKiB, rep.StreamStackKiB = one.rss, one.heap, one.stack
	idle := httpPost("/v1/completions", `{"model":"m","prompt":"one request, then idle"}`)
	if before, with, err = memWith(ctx, kvroute, dir, be, n, idle, []byte(`finish_reason`), "idle"); err != nil {
		return nil, fmt.Errorf("idle connections: %w", err)
	}
	one = per(before, with, n)
	rep.IdleRSSKiB = int(with.rss)
	rep.PerIdleConnKiB, rep.IdleHeapKiB, rep.IdleStackKiB = one.rss, one.heap, one.stack
	return rep, nil
}

// memWith starts kvroute in front of be, warms it up, and returns its
// memory before and with n connections open that each sent req and read
// until. With KVHOP_HEAP_PROFILE=P, the heap profile with them open is
// saved to P-phase.
func memWith(ctx context.Context, kvroute, dir string, be *holdBackend, n int, req, until []byte, phase string) (before, with memSample, err error) {
	port, err := proc.FreePort()
	if err != nil {
		return before, with, err
	}
	admin, err := proc.FreePort()
	if err != nil {
		return before, with, err
	}
	var urls []string
	for _, a := range be.addrs {
		urls = append(urls, "http://"+a)
	}
	p, err := startProxyArgs(ctx, "kvroute", dir, port, kvroute, "--listen", fmt.Sprintf("127.0.0.1:%d", port),
		"--admin-listen", fmt.Sprintf("127.0.0.1:%d", admin), "--backends", strings.Join(urls, ","), "--admin-token", profileToken)
	if err != nil {
		return before, with, err
	}
	defer p.stop()
	addr, pid := strings.TrimPrefix(p.url, "http://"), p.cmd.Process.Pid
	warm, err := openConns(ctx, addr, 50, req, until)
	if err != nil {
		return before, with, err
	}
	closeAll(warm)
	time.Sleep(time.Second)
	metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", admin)
	if before, err = sampleMem(pid, metricsURL); err != nil {
		return before, with, err
	}
	conns, err := openConns(ctx, addr, n, req, until)
	if err != nil {
		return before, with, err
	}
	defer closeAll(conns)
	time.Sleep(2 * time.Second)
	if with, err = sampleMem(pid, metricsURL); err != nil {
		return before, with, err
	}
	if path := os.Getenv("KVHOP_HEAP_PROFILE"); path != "" {
		err = saveProfile(fmt.Sprintf("http://127.0.0.1:%d/debug/pprof/heap", admin), path+"-"+phase)
	}
	return before, with, err
}

// sampleMem reads the process's VmRSS and the Go heap and stacks in use
// from its /metrics.
func sampleMem(pid int, metricsURL string) (memSample, error) {
	rss, err := rssKiB(pid)
	if err != nil {
		return memSample{}, err
	}
	m := memSample{rss: float64(rss)}
	body, err := get(metricsURL)
	if err != nil {
		return m, err
	}
	for _, l := range strings.Split(string(body), "\n") {
		name, v, ok := strings.Cut(l, " ")
		if !ok {
			continue
		}
		f, _ := strconv.ParseFloat(v, 64)
		switch name {
		case "go_memstats_heap_inuse_bytes":
			m.heap = f / 1024
		case "go_memstats_stack_inuse_bytes":
			m.stack = f / 1024
		}
	}
	if m.heap == 0 || m.stack == 0 {
		return m, errors.New("no go_memstats_heap_inuse_bytes or go_memstats_stack_inuse_bytes in " + metricsURL)
	}
	return m, nil
}

// profileToken is the benchmark kvroute's admin token (its admin
// listener is on loopback and lives for one measurement).
const profileToken = "kvhop"

// saveProfile saves the pprof profile at url to path (KVHOP_HEAP_PROFILE:
// the heap with the connections open, to see where their memory goes).
func saveProfile(url, path string) error {
	body, err := get(url)
	if err != nil {
		return err
	}
	return os.WriteFile(path, body, 0o644)
}

// get fetches url from kvroute's admin listener.
func get(url string) ([]byte, error) {
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI(url)
	req.Header.Set("Authorization", "Bearer "+profileToken)
	if err := fasthttp.DoTimeout(req, resp, 30*time.Second); err != nil {
		return nil, err
	}
	if resp.StatusCode() != 200 {
		return nil, fmt.Errorf("%s: %d", url, resp.StatusCode())
	}
	return append([]byte(nil), resp.Body()...), nil
}
