// Package hop measures what one proxy hop costs, side by side in one run:
// wrk drives an instant loopback backend directly, through kvroute (its
// binary, default flags), through a bare fasthttp proxy (bare.go), through
// nginx and through HAProxy (both as the equivalent reverse proxy:
// keep-alive upstream connections, no buffering), alternating target by
// target in rounds, and reports throughput and latency as ratios to nginx.
// It drives the real binaries (wrk, nginx, haproxy, kvroute, and kvhop
// itself for the bare proxy), each in its own process.
package hop

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvroute/kvroute/bench/proc"
)

// Config configures Run.
type Config struct {
	// Kvroute is the kvroute binary.
	Kvroute string
	// Dir holds the proxies' configuration, bodies and logs.
	Dir string
	// Rounds is how many times every measurement is repeated; each round
	// visits every target in turn.
	Rounds int
	// Duration is one wrk measurement.
	Duration time.Duration
	// Events is the number of SSE events of a streamed answer.
	Events int
	// Log receives progress lines (nil: none).
	Log io.Writer
	// Only, when set, keeps the cases whose name and connection count
	// ("completion-1KiB/32") or name it lists, and Targets the targets it
	// lists (nil: all).
	Only, Targets []string
	// Kvroutes, when set, are further kvroute binaries measured as extra
	// targets named "kvroute-<i>" (an A/B of builds in one run).
	Kvroutes []string
	// KVEvents adds the target EventsTarget (events.go): kvroute on engine
	// truth, the backend publishing KV events and answering /tokenize.
	KVEvents bool
	// Gossip adds the target GossipTarget: kvroute gossiping with a
	// second kvroute process (--peers), each placement sent to it.
	Gossip bool
	// Bare is the command that serves the bare proxy (BareTarget) when
	// given "bare-proxy --listen ADDR --backend ADDR" (kvhop itself); empty:
	// that target is not measured.
	Bare string
}

// Case is one workload: a body, its path, a connection count, and
// whether the answer streams.
type Case struct {
	Name   string `json:"name"`
	Path   string `json:"path"`
	Conns  int    `json:"connections"`
	Stream bool   `json:"stream"`
	body   []byte
}

// Measure is one wrk run's figures.
type Measure struct {
	RPS   float64 `json:"requests_per_s"`
	P50us float64 `json:"p50_us"`
	P99us float64 `json:"p99_us"`
	Errs  int     `json:"errors"`
	// The proxy's own cost per request (its process and children, from
	// /proc): CPU time and system calls; zero for direct.
	// FirstEventUs: for a stream at one connection, the median time from
	// sending the request to the first event's bytes (firstEvents).
	FirstEventUs float64 `json:"first_event_p50_us,omitempty"`
	CPUus        float64 `json:"cpu_us_per_request,omitempty"`
	SysUs        float64 `json:"system_cpu_us_per_request,omitempty"` // of CPUus, in the kernel
	Syscalls     float64 `json:"syscalls_per_request,omitempty"`
	requests     float64
}

// Row is one case's median figures per target over the rounds.
type Row struct {
	Case    Case               `json:"case"`
	Targets map[string]Measure `json:"targets"`
}

// Report is a run's outcome.
type Report struct {
	Started  time.Time `json:"started"`
	Rounds   int       `json:"rounds"`
	Duration string    `json:"duration"`
	Events   int       `json:"events"`
	Versions []string  `json:"versions"`
	Rows     []Row     `json:"rows"`
	// Targets are the targets measured, in order.
	Targets []string `json:"targets"`
}

// Targets in the order they are measured within a round.
var Targets = []string{"direct", "kvroute", BareTarget, "nginx", "haproxy"}

// Cases returns the measured cases: a 1 KiB completion and a 128 KiB chat
// body at 1, 32 and 256 connections, and a streamed completion of events
// SSE events at 1 and 32.
func Cases() []Case {
	var out []Case
	for _, b := range []struct {
		name, path string
		body       []byte
	}{{"completion-1KiB", "/v1/completions", completionBody(1<<10, false)}, {"chat-128KiB", "/v1/chat/completions", chatBody(128 << 10)}} {
		for _, c := range []int{1, 32, 256} {
			out = append(out, Case{Name: b.name, Path: b.path, Conns: c, body: b.body})
		}
	}
	for _, c := range []int{1, 32} {
		out = append(out, Case{Name: "stream-1KiB", Path: "/v1/completions", Conns: c, Stream: true, body: completionBody(1<<10, true)})
	}
	return out
}

func completionBody(n int, stream bool) []byte {
	prompt := strings.Repeat("The quick brown fox jumps over the lazy dog. ", n/45+1)[:n-80]
	b, _ := json.Marshal(map[string]any{"model": "m", "prompt": prompt, "max_tokens": 16, "stream": stream})
	return b
}

func chatBody(n int) []byte {
	sys := strings.Repeat("You are a helpful assistant. Follow the policy below exactly. ", n/62+1)[:n-200]
	b, _ := json.Marshal(map[string]any{"model": "m", "max_tokens": 64, "stream": false,
		"messages": []map[string]any{{"role": "system", "content": sys}, {"role": "user", "content": "Summarise the policy."}}})
	return b
}

// backend is the instant backend: a vLLM-shaped completion for a whole
// answer, or events SSE events written and flushed one by one.
type backend struct {
	srv    *fasthttp.Server
	addr   string
	full   []byte
	event  []byte
	events int
	kv     *kvPub // nil unless Config.KVEvents
}

func startBackend(events int, kvEvents bool) (*backend, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	b := &backend{addr: ln.Addr().String(), events: events,
		full:  []byte(`{"id":"cmpl-0","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":" a b c d e f g h i j k l m n o p","logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":{"prompt_tokens":256,"total_tokens":272,"completion_tokens":16}}`),
		event: []byte(`data: {"id":"cmpl-0","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":" word","logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}` + "\n\n")}
	if kvEvents {
		text, err := promptText(chatBody(128 << 10))
		if err == nil {
			b.kv, err = startKVPub(fakeTokens(text)[:kvChainBlocks*kvBlockTokens])
		}
		if err != nil {
			ln.Close()
			return nil, err
		}
	}
	b.srv = &fasthttp.Server{Handler: b.handle, NoDefaultDate: true, ReadBufferSize: 16 << 10, MaxRequestBodySize: 1 << 20}
	go func() { _ = b.srv.Serve(ln) }()
	return b, nil
}

func (b *backend) close() {
	_ = b.srv.Shutdown()
	if b.kv != nil {
		b.kv.close()
	}
}

func (b *backend) handle(ctx *fasthttp.RequestCtx) {
	if string(ctx.Path()) == "/tokenize" {
		tokenize(ctx)
		return
	}
	if !bytes.Contains(ctx.PostBody(), []byte(`"stream":true`)) {
		ctx.SetContentType("application/json")
		ctx.SetBody(b.full)
		return
	}
	ctx.SetContentType("text/event-stream")
	ctx.SetBodyStreamWriter(func(w *bufio.Writer) {
		for range b.events {
			_, _ = w.Write(b.event)
			if w.Flush() != nil {
				return
			}
		}
		_, _ = w.WriteString("data: [DONE]\n\n")
		_ = w.Flush()
	})
}

// nginxConf is nginx as a reverse proxy the way an operator would run it
// in front of engines: keep-alive upstream connections, request and
// response buffering off (streams pass event by event), an access log.
const nginxConf = `worker_processes 2;
daemon off;
pid {{dir}}/nginx.pid;
error_log {{dir}}/nginx-error.log warn;
events { worker_connections 8192; }
http {
  access_log {{dir}}/nginx-access.log;
  client_body_temp_path {{dir}}/nginx-body;
  proxy_temp_path {{dir}}/nginx-proxy;
  upstream engines { server {{backend}}; keepalive 1024; }
  server {
    listen 127.0.0.1:{{port}} backlog=4096;
    client_max_body_size 1m;
    client_body_buffer_size 256k;
    keepalive_requests 1000000;
    location / {
      proxy_pass http://engines;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }
  }
}
`

// haproxyConf is HAProxy's equivalent: HTTP mode, keep-alive on both
// sides with upstream connections reused, responses streamed.
const haproxyConf = `global
  nbthread 2
  maxconn 8000
defaults
  mode http
  timeout connect 5s
  timeout client 60s
  timeout server 60s
  option http-keep-alive
  http-reuse always
frontend api
  bind 127.0.0.1:{{port}}
  default_backend engines
backend engines
  server e1 {{backend}} maxconn 10000
`

// GossipTarget is the target name of kvroute gossiping with a peer.
const GossipTarget = "kvroute+gossip"

// proxyProc is a proxy under test running in its own process.
type proxyProc struct {
	name  string
	url   string
	cmd   *exec.Cmd
	admin string     // kvroute's admin URL, for its profiles
	peer  *proxyProc // the kvroute it gossips with (GossipTarget)
}

func (p *proxyProc) stop() {
	if p.peer != nil {
		defer p.peer.stop()
	}
	if p.cmd != nil && p.cmd.Process != nil {
		_ = p.cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { _ = p.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = p.cmd.Process.Kill()
			<-done
		}
	}
}

// startProxy starts the named proxy in front of backend and waits until it
// answers.
func startProxy(ctx context.Context, name, kvroute, bare, dir string, be *backend) (*proxyProc, error) {
	backend := be.addr
	port, err := proc.FreePort()
	if err != nil {
		return nil, err
	}
	fill := func(tmpl string) string {
		return strings.NewReplacer("{{dir}}", dir, "{{backend}}", backend, "{{port}}", strconv.Itoa(port)).Replace(tmpl)
	}
	switch name {
	case "kvroute", EventsTarget, GossipTarget:
		return startKvroute(ctx, name, kvroute, dir, port, be)
	case BareTarget:
		return startProxyArgs(ctx, name, dir, port, bare, "bare-proxy", "--listen", fmt.Sprintf("127.0.0.1:%d", port), "--backend", backend)
	case "nginx":
		conf := filepath.Join(dir, "nginx.conf")
		if err := os.WriteFile(conf, []byte(fill(nginxConf)), 0o644); err != nil {
			return nil, err
		}
		return startProxyArgs(ctx, name, dir, port, "nginx", "-c", conf, "-p", dir)
	case "haproxy":
		conf := filepath.Join(dir, "haproxy.cfg")
		if err := os.WriteFile(conf, []byte(fill(haproxyConf)), 0o644); err != nil {
			return nil, err
		}
		return startProxyArgs(ctx, name, dir, port, "haproxy", "-db", "-f", conf)
	}
	return &proxyProc{name: name, url: "http://" + backend}, nil
}

// startKvroute starts kvroute as the target name on port in front of be;
// GossipTarget first starts the peer it gossips with.
func startKvroute(ctx context.Context, name, kvroute, dir string, port int, be *backend) (*proxyProc, error) {
	ports := make([]int, 5) // admin; with gossip, both gossip ports and the peer's API and admin
	for i := range ports {
		var err error
		if ports[i], err = proc.FreePort(); err != nil {
			return nil, err
		}
	}
	args := func(port, admin int) []string {
		return []string{"--listen", fmt.Sprintf("127.0.0.1:%d", port), "--admin-listen", fmt.Sprintf("127.0.0.1:%d", admin),
			"--backends", "http://" + be.addr, "--admin-token", profileToken}
	}
	a := args(port, ports[0])
	var peer *proxyProc
	switch name {
	case EventsTarget:
		a = append(a, "--kv-events-port", strconv.Itoa(be.kv.port))
	case GossipTarget:
		peers := fmt.Sprintf("--peers=127.0.0.1:%d,127.0.0.1:%d", ports[1], ports[2])
		var err error
		if peer, err = startProxyArgs(ctx, name+"-peer", dir, ports[3], kvroute,
			append(args(ports[3], ports[4]), peers, fmt.Sprintf("--gossip-listen=127.0.0.1:%d", ports[2]))...); err != nil {
			return nil, err
		}
		a = append(a, peers, fmt.Sprintf("--gossip-listen=127.0.0.1:%d", ports[1]))
	}
	p, err := startProxyArgs(ctx, name, dir, port, kvroute, a...)
	if err != nil {
		if peer != nil {
			peer.stop()
		}
		return nil, err
	}
	p.admin, p.peer = fmt.Sprintf("http://127.0.0.1:%d", ports[0]), peer
	return p, nil
}

// startProxyArgs runs bin args as the proxy name listening on port, its
// output in dir/name.log, and waits until it answers a completion.
func startProxyArgs(ctx context.Context, name, dir string, port int, bin string, args ...string) (*proxyProc, error) {
	cmd := exec.CommandContext(ctx, bin, args...)
	logf, err := os.Create(filepath.Join(dir, name+".log"))
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	p := &proxyProc{name: name, url: fmt.Sprintf("http://127.0.0.1:%d", port), cmd: cmd}
	deadline := time.Now().Add(10 * time.Second)
	for {
		req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
		req.SetRequestURI(p.url + "/v1/completions")
		req.Header.SetMethod("POST")
		req.SetBodyString(`{"model":"m","prompt":"ready?"}`)
		err := fasthttp.DoTimeout(req, resp, time.Second)
		ok := err == nil && resp.StatusCode() == 200
		fasthttp.ReleaseRequest(req)
		fasthttp.ReleaseResponse(resp)
		if ok {
			return p, nil
		}
		if time.Now().After(deadline) {
			p.stop()
			return nil, fmt.Errorf("%s did not answer on %s: %v (log: %s)", name, p.url, err, filepath.Join(dir, name+".log"))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// wrkScript posts the body in WRK_BODY_FILE to WRK_PATH.
const wrkScript = `local f = assert(io.open(os.getenv("WRK_BODY_FILE"), "rb"))
wrk.method = "POST"
wrk.path = os.getenv("WRK_PATH")
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"
`

// runWrk runs one wrk measurement of c against url.
func runWrk(ctx context.Context, dir string, c Case, url string, d time.Duration) (Measure, error) {
	bodyFile := filepath.Join(dir, c.Name+".json")
	if err := os.WriteFile(bodyFile, c.body, 0o644); err != nil {
		return Measure{}, err
	}
	script := filepath.Join(dir, "post.lua")
	if err := os.WriteFile(script, []byte(wrkScript), 0o644); err != nil {
		return Measure{}, err
	}
	threads := min(2, c.Conns)
	cmd := exec.CommandContext(ctx, "wrk", "-t", strconv.Itoa(threads), "-c", strconv.Itoa(c.Conns),
		"-d", fmt.Sprintf("%ds", int(d.Seconds())), "--latency", "-s", script, url)
	cmd.Env = append(os.Environ(), "WRK_BODY_FILE="+bodyFile, "WRK_PATH="+c.Path)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return Measure{}, fmt.Errorf("wrk: %v: %s", err, out)
	}
	return parseWrk(string(out))
}

var (
	reRPS    = regexp.MustCompile(`Requests/sec:\s+([0-9.]+)`)
	reLat    = regexp.MustCompile(`(?m)^\s+(50|99)%\s+([0-9.]+)(us|ms|s)\s*$`)
	reReqs   = regexp.MustCompile(`(\d+) requests in`)
	reErrs   = regexp.MustCompile(`Non-2xx or 3xx responses:\s+(\d+)`)
	reSocket = regexp.MustCompile(`Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)`)
)

// parseWrk reads wrk --latency's output.
func parseWrk(out string) (Measure, error) {
	var m Measure
	r := reRPS.FindStringSubmatch(out)
	if r == nil {
		return m, fmt.Errorf("wrk output without Requests/sec: %s", out)
	}
	m.RPS, _ = strconv.ParseFloat(r[1], 64)
	if n := reReqs.FindStringSubmatch(out); n != nil {
		m.requests, _ = strconv.ParseFloat(n[1], 64)
	}
	for _, l := range reLat.FindAllStringSubmatch(out, -1) {
		v, _ := strconv.ParseFloat(l[2], 64)
		switch l[3] {
		case "ms":
			v *= 1e3
		case "s":
			v *= 1e6
		}
		if l[1] == "50" {
			m.P50us = v
		} else {
			m.P99us = v
		}
	}
	if e := reErrs.FindStringSubmatch(out); e != nil {
		m.Errs, _ = strconv.Atoi(e[1])
	}
	if s := reSocket.FindStringSubmatch(out); s != nil {
		for _, x := range s[1:] {
			n, _ := strconv.Atoi(x)
			m.Errs += n
		}
	}
	return m, nil
}

// Run measures every case against every target, cfg.Rounds times, and
// returns the medians.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	targets := Targets
	if cfg.Targets != nil {
		targets = cfg.Targets
	}
	if cfg.KVEvents && !slices.Contains(targets, EventsTarget) {
		targets = slices.Insert(slices.Clone(targets), min(2, len(targets)), EventsTarget)
	}
	if cfg.Gossip && !slices.Contains(targets, GossipTarget) {
		targets = slices.Insert(slices.Clone(targets), min(2, len(targets)), GossipTarget)
	}
	if cfg.Bare == "" {
		targets = slices.DeleteFunc(slices.Clone(targets), func(t string) bool { return t == BareTarget })
	}
	be, err := startBackend(cfg.Events, slices.Contains(targets, EventsTarget))
	if err != nil {
		return nil, err
	}
	defer be.close()
	procs := map[string]*proxyProc{}
	defer func() {
		for _, p := range procs {
			p.stop()
		}
	}()
	for i := range cfg.Kvroutes {
		targets = append(targets, fmt.Sprintf("kvroute-%d", i+1))
	}
	for _, t := range targets {
		kind, bin := t, cfg.Kvroute
		if n, ok := strings.CutPrefix(t, "kvroute-"); ok {
			i, _ := strconv.Atoi(n)
			kind, bin = "kvroute", cfg.Kvroutes[i-1]
		}
		p, err := startProxy(ctx, kind, bin, cfg.Bare, cfg.Dir, be)
		if err != nil {
			return nil, err
		}
		procs[t] = p
	}
	rep := &Report{Started: time.Now(), Rounds: cfg.Rounds, Duration: cfg.Duration.String(), Events: cfg.Events, Versions: versions(cfg.Kvroute)}
	var cases []Case
	for _, c := range Cases() {
		if cfg.Only == nil || slices.Contains(cfg.Only, c.Name) || slices.Contains(cfg.Only, fmt.Sprintf("%s/%d", c.Name, c.Conns)) {
			cases = append(cases, c)
		}
	}
	samples := make([]map[string][]Measure, len(cases))
	for i := range samples {
		samples[i] = map[string][]Measure{}
	}
	for r := range cfg.Rounds {
		// An A/B of two builds run in both orders read the build measured
		// second up to 1.3× faster at one connection, whichever it was, so
		// every other round runs the targets reversed.
		order := slices.Clone(targets)
		if r%2 == 1 {
			slices.Reverse(order)
		}
		for i, c := range cases {
			for _, t := range order {
				prof := cpuProfile(procs[t], r, c, t, cfg.Duration)
				before := procs[t].usage()
				m, err := runWrk(ctx, cfg.Dir, c, procs[t].url, cfg.Duration)
				if perr := <-prof; perr != nil && err == nil {
					err = perr
				}
				if after := procs[t].usage(); before.ok && after.ok && m.requests > 0 {
					m.CPUus = (after.cpu - before.cpu).Seconds() * 1e6 / m.requests
					m.SysUs = (after.sys - before.sys).Seconds() * 1e6 / m.requests
					m.Syscalls = float64(after.syscalls-before.syscalls) / m.requests
				}
				if err == nil && c.Stream && c.Conns == 1 {
					m.FirstEventUs, err = firstEvents(procs[t].url+c.Path, c.body, firstEventSamples)
				}
				if err != nil {
					return nil, fmt.Errorf("%s via %s: %w", c.Name, t, err)
				}
				samples[i][t] = append(samples[i][t], m)
				if cfg.Log != nil {
					fmt.Fprintf(cfg.Log, "round %d %s c=%d %-8s %9.0f req/s  p50 %7.0f µs  p99 %7.0f µs  cpu %5.1f µs/req (%5.1f system)  %4.1f reads+writes/req  errors %d\n",
						r+1, c.Name, c.Conns, t, m.RPS, m.P50us, m.P99us, m.CPUus, m.SysUs, m.Syscalls, m.Errs)
				}
			}
		}
	}
	rep.Targets = targets
	for i, c := range cases {
		row := Row{Case: c, Targets: map[string]Measure{}}
		for _, t := range targets {
			row.Targets[t] = median(samples[i][t])
		}
		rep.Rows = append(rep.Rows, row)
	}
	return rep, nil
}

// cpuProfile, with KVHOP_CPU_PROFILE=P, saves a CPU profile of the
// kvroute target t over the first round's wrk run of c to
// P-t-case-conns; its result arrives on the channel once saved (at
// once when there is nothing to profile).
func cpuProfile(p *proxyProc, round int, c Case, t string, d time.Duration) <-chan error {
	done := make(chan error, 1)
	path := os.Getenv("KVHOP_CPU_PROFILE")
	if path == "" || p.admin == "" || round > 0 || d < 2*time.Second {
		done <- nil
		return done
	}
	go func() {
		url := fmt.Sprintf("%s/debug/pprof/profile?seconds=%d", p.admin, int(d.Seconds())-1)
		done <- saveProfile(url, fmt.Sprintf("%s-%s-%s-%d", path, t, c.Name, c.Conns))
	}()
	return done
}

// firstEventSamples is how many sequential streams firstEvents times.
const firstEventSamples = 300

// firstEvents posts body to url n times, one stream at a time on one
// keep-alive connection, and returns the median time in µs from sending
// the request to reading the first event's first bytes (the rest of each
// stream is read and discarded).
func firstEvents(url string, body []byte, n int) (float64, error) {
	c := &fasthttp.Client{StreamResponseBody: true, MaxConnsPerHost: 1, ReadTimeout: 10 * time.Second, WriteTimeout: 10 * time.Second}
	times := make([]float64, 0, n)
	buf := make([]byte, 4096)
	for range n {
		req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
		req.SetRequestURI(url)
		req.Header.SetMethod("POST")
		req.Header.SetContentType("application/json")
		req.SetBody(body)
		start := time.Now()
		err := c.Do(req, resp)
		if err == nil && resp.StatusCode() != 200 {
			err = fmt.Errorf("status %d", resp.StatusCode())
		}
		if err == nil {
			rd := resp.BodyStream()
			var k int
			k, err = rd.Read(buf)
			if k > 0 {
				times = append(times, float64(time.Since(start).Microseconds()))
				err = nil
			}
			_, _ = io.Copy(io.Discard, rd)
		}
		fasthttp.ReleaseRequest(req)
		fasthttp.ReleaseResponse(resp)
		if err != nil {
			return 0, fmt.Errorf("first event: %w", err)
		}
	}
	slices.Sort(times)
	return times[len(times)/2], nil
}

// median returns the per-figure median of ms (errors summed).
func median(ms []Measure) Measure {
	pick := func(f func(Measure) float64) float64 {
		v := make([]float64, len(ms))
		for i, m := range ms {
			v[i] = f(m)
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	out := Measure{RPS: pick(func(m Measure) float64 { return m.RPS }), P50us: pick(func(m Measure) float64 { return m.P50us }),
		P99us: pick(func(m Measure) float64 { return m.P99us }), CPUus: pick(func(m Measure) float64 { return m.CPUus }),
		FirstEventUs: pick(func(m Measure) float64 { return m.FirstEventUs }),
		SysUs:        pick(func(m Measure) float64 { return m.SysUs }),
		Syscalls:     pick(func(m Measure) float64 { return m.Syscalls })}
	for _, m := range ms {
		out.Errs += m.Errs
	}
	return out
}

// versions returns the tools' version lines.
func versions(kvroute string) []string {
	var out []string
	for _, v := range [][]string{{"wrk", "-v"}, {"nginx", "-v"}, {"haproxy", "-v"}} {
		b, _ := exec.Command(v[0], v[1:]...).CombinedOutput()
		line, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n")
		out = append(out, line)
	}
	return out
}

// Markdown renders the report: per case, each target's throughput and
// latency, and kvroute's and HAProxy's as ratios to nginx; added latency
// is each proxy's p50 minus the direct p50.
func (r *Report) Markdown() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d rounds of %s per measurement, medians; every target visited in turn within a round, in reverse order every other round.\n\n", r.Rounds, r.Duration)
	fmt.Fprintf(&b, "| case | conns | target | req/s | vs nginx | p50 | added p50 | p99 | CPU per request | read/write calls per request | errors |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, row := range r.Rows {
		ng, dir := row.Targets["nginx"], row.Targets["direct"]
		for _, t := range r.Targets {
			m := row.Targets[t]
			rps := fmt.Sprintf("%.0f", m.RPS)
			if row.Case.Stream {
				rps += fmt.Sprintf(" (%.0fk events/s)", m.RPS*float64(r.Events)/1000)
				if m.FirstEventUs > 0 {
					rps += fmt.Sprintf("; first event %.0f µs", m.FirstEventUs)
				}
			}
			// Ratios to nginx and added latency over direct only where
			// those targets ran.
			vsNginx, added := "–", "–"
			if _, ok := row.Targets["nginx"]; ok {
				vsNginx = fmt.Sprintf("%.2f×", m.RPS/ng.RPS)
			}
			if _, ok := row.Targets["direct"]; ok && t != "direct" {
				added = fmt.Sprintf("%+.0f µs", m.P50us-dir.P50us)
				if row.Case.Stream {
					added += fmt.Sprintf(" (%+.1f µs/event)", (m.P50us-dir.P50us)/float64(r.Events))
				}
			}
			cpu, sys := "–", "–"
			if m.CPUus > 0 {
				cpu, sys = fmt.Sprintf("%.1f µs (%.1f system)", m.CPUus, m.SysUs), fmt.Sprintf("%.1f", m.Syscalls)
			}
			fmt.Fprintf(&b, "| %s | %d | %s | %s | %s | %.0f µs | %s | %.0f µs | %s | %s | %d |\n", row.Case.Name, row.Case.Conns, t, rps,
				vsNginx, m.P50us, added, m.P99us, cpu, sys, m.Errs)
		}
	}
	fmt.Fprintf(&b, "\nCPU per request: the proxy's processes' user and system time (system in brackets) over the requests wrk completed. Read/write calls: /proc's syscr + syscw, which count read(2)/write(2)-family calls (Go's), not recv(2)/send(2) (nginx's and HAProxy's reads).\n")
	fmt.Fprintf(&b, "\nTools: %s.\n", strings.Join(r.Versions, "; "))
	return b.String()
}

// procUsage is a process tree's CPU time and system calls so far.
type procUsage struct {
	cpu, sys time.Duration
	syscalls int64
	ok       bool
}

// usage reads p's process and its children's (nginx's workers) CPU time
// and system calls (syscr + syscw) from /proc; not ok without a process
// or /proc.
func (p *proxyProc) usage() procUsage {
	if p.cmd == nil || p.cmd.Process == nil {
		return procUsage{}
	}
	pids := []string{strconv.Itoa(p.cmd.Process.Pid)}
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%s/task/*/children", pids[0]))
	for _, t := range tasks {
		b, _ := os.ReadFile(t)
		pids = append(pids, strings.Fields(string(b))...)
	}
	var u procUsage
	for _, pid := range pids {
		stat, err := os.ReadFile("/proc/" + pid + "/stat")
		if err != nil {
			return procUsage{}
		}
		// Fields after the command's closing parenthesis: utime and
		// stime are the 12th and 13th (clock ticks, 100 a second).
		_, rest, _ := bytes.Cut(stat, []byte(") "))
		f := strings.Fields(string(rest))
		if len(f) < 13 {
			return procUsage{}
		}
		ut, _ := strconv.ParseInt(f[11], 10, 64)
		st, _ := strconv.ParseInt(f[12], 10, 64)
		u.cpu += time.Duration(ut+st) * 10 * time.Millisecond
		u.sys += time.Duration(st) * 10 * time.Millisecond
		io, err := os.ReadFile("/proc/" + pid + "/io")
		if err != nil {
			return procUsage{}
		}
		for _, l := range strings.Split(string(io), "\n") {
			if k, v, ok := strings.Cut(l, ": "); ok && (k == "syscr" || k == "syscw") {
				n, _ := strconv.ParseInt(v, 10, 64)
				u.syscalls += n
			}
		}
	}
	u.ok = true
	return u
}
