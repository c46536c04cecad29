package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/kvroute/kvroute/bench/sim"
)

// zone is a DNS server on 127.0.0.1 answering A queries for one name from
// a record list that tests change.
type zone struct {
	mu   sync.Mutex
	name string
	ips  []string
	srv  *dns.Server
}

func startZone(t *testing.T, name string, ips ...string) (*zone, string) {
	t.Helper()
	z := &zone{name: dns.Fqdn(name), ips: ips}
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	mux := dns.NewServeMux()
	mux.HandleFunc(".", z.serve)
	z.srv = &dns.Server{PacketConn: pc, Handler: mux}
	started := make(chan struct{})
	z.srv.NotifyStartedFunc = func() { close(started) }
	go func() { _ = z.srv.ActivateAndServe() }()
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the DNS server did not start")
	}
	t.Cleanup(func() { _ = z.srv.Shutdown() })
	return z, pc.LocalAddr().String()
}

func (z *zone) set(ips ...string) {
	z.mu.Lock()
	z.ips = ips
	z.mu.Unlock()
}

func (z *zone) serve(w dns.ResponseWriter, req *dns.Msg) {
	m := new(dns.Msg)
	m.SetReply(req)
	z.mu.Lock()
	defer z.mu.Unlock()
	for _, q := range req.Question {
		if q.Name != z.name {
			m.Rcode = dns.RcodeNameError
			continue
		}
		if q.Qtype != dns.TypeA {
			continue
		}
		for _, ip := range z.ips {
			m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 1},
				A: net.ParseIP(ip)})
		}
	}
	_ = w.WriteMsg(m)
}

// startLoopbackPods starts a simulated pod on 127.0.0.2 and one on
// 127.0.0.3, on the same port (as the pods of a Service are), and returns
// the port, the pods by address and the model they serve. It skips the
// test where those addresses are not usable.
func startLoopbackPods(t *testing.T) (int, map[string]*sim.Pod, string) {
	ln2, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Skipf("127.0.0.2 not usable here: %v", err)
	}
	port := ln2.Addr().(*net.TCPAddr).Port
	ln3, err := net.Listen("tcp", "127.0.0.3:"+strconv.Itoa(port))
	if err != nil {
		ln2.Close()
		t.Skipf("127.0.0.3:%d not usable here: %v", port, err)
	}
	cfg := sim.DefaultConfig()
	cfg.TimeScale = 100
	pods := map[string]*sim.Pod{}
	for ip, ln := range map[string]net.Listener{"127.0.0.2": ln2, "127.0.0.3": ln3} {
		c := cfg
		c.Seed = uint64(len(pods))
		p, err := sim.New(c)
		if err != nil {
			t.Fatal(err)
		}
		go func() { _ = p.Serve(ln) }()
		t.Cleanup(func() { _ = p.Close() })
		pods[ip] = p
	}
	return port, pods, cfg.Model
}

// waitReady waits until kvroute's /readyz on admin answers 200 (once the
// first resolution found endpoints), failing after 10 s.
func waitReady(t *testing.T, admin string) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := http.Get("http://" + admin + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode == 200 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("never ready")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// kvroute follows a headless Service: pods on 127.0.0.2 and 127.0.0.3 (the
// same port, as pods of a Service are) take traffic; after the Service
// drops one of them, traffic moves to the other within about a DNS
// interval. (Draining of in-flight streams is tested in discovery/.)
func TestFollowsHeadlessServiceDNS(t *testing.T) {
	port, pods, model := startLoopbackPods(t)
	z, dnsAddr := startZone(t, "vllm.llm.svc.cluster.local", "127.0.0.2", "127.0.0.3")

	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan readyAddrs, 1)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
			"--service", "vllm.llm.svc.cluster.local:" + strconv.Itoa(port), "--dns-server", dnsAddr,
			"--dns-interval", "200ms", "--policy", "round-robin", "--log-level", "error"}, io.Discard, io.Discard, ready)
	}()
	var addrs readyAddrs
	select {
	case addrs = <-ready:
	case err := <-done:
		cancel()
		t.Fatal(err)
	case <-time.After(10 * time.Second):
		cancel()
		t.Fatal("kvroute did not start")
	}
	defer func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("run: %v", err)
			}
		case <-time.After(45 * time.Second): // above the 30 s drain timeout: a deadlock guard
			t.Error("run did not return")
		}
	}()
	served := func() map[string]float64 {
		out := map[string]float64{}
		for ip, p := range pods {
			out[ip] = podRequests(t, p)
		}
		return out
	}
	complete := func(maxTokens int) {
		body := fmt.Sprintf(`{"model":%q,"prompt":"hello","max_tokens":%d}`, model, maxTokens)
		resp, err := http.Post("http://"+addrs.API+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
	}
	waitReady(t, addrs.Admin)
	deadline := time.Now().Add(10 * time.Second)
	// Both pods serve (round-robin).
	for s := served(); s["127.0.0.2"] == 0 || s["127.0.0.3"] == 0; s = served() {
		if time.Now().After(deadline) {
			t.Fatalf("both pods never served: %v", s)
		}
		complete(2)
	}

	z.set("127.0.0.2") // scale down: .3 leaves the Service
	changed := time.Now()
	for {
		before := served()
		for i := 0; i < 4; i++ {
			complete(2)
		}
		after := served()
		if after["127.0.0.3"] == before["127.0.0.3"] {
			break
		}
		if time.Since(changed) > 10*time.Second {
			t.Fatal("traffic never left the removed pod")
		}
	}
	t.Logf("traffic left the removed pod %v after the DNS change (interval 200ms)", time.Since(changed).Round(time.Millisecond))
}

// podRequests is the pod's vllm:request_success_total, summed.
func podRequests(t *testing.T, p *sim.Pod) float64 {
	mfs, err := p.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	var n float64
	for _, mf := range mfs {
		if mf.GetName() == "vllm:request_success_total" {
			for _, m := range mf.GetMetric() {
				n += m.GetCounter().GetValue()
			}
		}
	}
	return n
}
