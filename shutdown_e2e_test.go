package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/sim"
)

// serviceLB stands in for a Kubernetes Service in front of kvroute
// replicas: new connections go round-robin to the replicas that were ready
// at its last look, and it looks at every replica's /readyz only every
// probePeriod, so a replica that started shutting down keeps getting new
// connections for a while (as kube-proxy does until the endpoints update).
type serviceLB struct {
	ln       net.Listener
	mu       sync.Mutex
	replicas []*lbReplica
	next     int
	dialErrs atomic.Int64
	stop     chan struct{}
	wg       sync.WaitGroup
}

type lbReplica struct {
	api, admin string
	ready      bool
	served     atomic.Int64 // connections sent to it
}

const probePeriod = 300 * time.Millisecond

func startServiceLB(t *testing.T) *serviceLB {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lb := &serviceLB{ln: ln, stop: make(chan struct{})}
	lb.wg.Add(2)
	go lb.accept()
	go lb.probe()
	t.Cleanup(func() { close(lb.stop); ln.Close(); lb.wg.Wait() })
	return lb
}

func (lb *serviceLB) add(a readyAddrs) *lbReplica {
	r := &lbReplica{api: a.API, admin: a.Admin}
	lb.mu.Lock()
	lb.replicas = append(lb.replicas, r)
	lb.mu.Unlock()
	return r
}

func (lb *serviceLB) probe() {
	defer lb.wg.Done()
	hc := &http.Client{Timeout: time.Second}
	for {
		lb.mu.Lock()
		rs := append([]*lbReplica(nil), lb.replicas...)
		lb.mu.Unlock()
		for _, r := range rs {
			resp, err := hc.Get("http://" + r.admin + "/readyz")
			ok := err == nil && resp.StatusCode == 200
			if err == nil {
				resp.Body.Close()
			}
			lb.mu.Lock()
			r.ready = ok
			lb.mu.Unlock()
		}
		select {
		case <-lb.stop:
			return
		case <-time.After(probePeriod):
		}
	}
}

func (lb *serviceLB) pick() *lbReplica {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	for range lb.replicas {
		r := lb.replicas[lb.next%len(lb.replicas)]
		lb.next++
		if r.ready {
			return r
		}
	}
	return nil
}

func (lb *serviceLB) accept() {
	defer lb.wg.Done()
	for {
		c, err := lb.ln.Accept()
		if err != nil {
			return
		}
		r := lb.pick()
		if r == nil {
			lb.dialErrs.Add(1)
			c.Close()
			continue
		}
		up, err := net.Dial("tcp", r.api)
		if err != nil { // the connection refused that a rollout must not cause
			lb.dialErrs.Add(1)
			c.Close()
			continue
		}
		r.served.Add(1)
		go func() { _, _ = io.Copy(up, c); up.(*net.TCPConn).CloseWrite() }()
		go func() { _, _ = io.Copy(c, up); c.Close(); up.Close() }()
	}
}

// TestRolloutLosesNothing replaces one of two kvroute replicas behind a
// Service-like balancer under a steady load of streamed and whole
// completions: the old replica, shutting down with --shutdown-delay longer
// than the balancer's probe period, keeps serving while the balancer still
// sends to it, so no request fails.
func TestRolloutLosesNothing(t *testing.T) {
	fleet, err := sim.StartFleet(2, sim.Config{TimeScale: 100, Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fleet.Close() })
	args := []string{"--backends", fleet.URL(0) + "," + fleet.URL(1), "--shutdown-delay", (3 * probePeriod).String()}
	lb := startServiceLB(t)
	a, stopA := startKvroute(t, args...)
	old := lb.add(a)
	b, stopB := startKvroute(t, args...)
	defer stopB()
	lb.add(b)
	time.Sleep(2 * probePeriod) // both ready

	ctx, cancel := context.WithCancel(context.Background())
	var ok, failed atomic.Int64
	var mu sync.Mutex
	var failures []string
	var wg sync.WaitGroup
	for w := range 6 {
		wg.Go(func() {
			hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
			defer hc.CloseIdleConnections()
			for i := 0; ctx.Err() == nil; i++ {
				stream := (w+i)%2 == 0
				body := fmt.Sprintf(`{"model":"m","prompt":"request %d of worker %d","max_tokens":6,"stream":%v}`, i, w, stream)
				resp, err := hc.Post("http://"+lb.ln.Addr().String()+"/v1/completions", "application/json", strings.NewReader(body))
				var got []byte
				if err == nil {
					got, err = io.ReadAll(resp.Body)
					resp.Body.Close()
				}
				done := err == nil && resp.StatusCode == 200 &&
					(!stream && strings.Contains(string(got), `"finish_reason"`) || stream && strings.HasSuffix(string(got), "data: [DONE]\n\n"))
				if done {
					ok.Add(1)
					continue
				}
				failed.Add(1)
				mu.Lock()
				failures = append(failures, fmt.Sprintf("%v %s", err, got))
				mu.Unlock()
			}
		})
	}
	time.Sleep(500 * time.Millisecond)
	// The rollout: a new replica starts and becomes ready, then the old one
	// gets SIGTERM.
	c, stopC := startKvroute(t, args...)
	defer stopC()
	fresh := lb.add(c)
	time.Sleep(2 * probePeriod)
	servedBefore := old.served.Load()
	stopA() // returns once the old replica drained and exited
	time.Sleep(500 * time.Millisecond)
	cancel()
	wg.Wait()

	if f := failed.Load(); f > 0 || lb.dialErrs.Load() > 0 {
		t.Errorf("%d of %d requests failed during the rollout, %d connections refused: %v",
			f, f+ok.Load(), lb.dialErrs.Load(), failures[:min(len(failures), 5)])
	}
	if ok.Load() < 50 || servedBefore == 0 || fresh.served.Load() == 0 {
		t.Errorf("load too small to tell: %d requests, old replica %d connections, new one %d",
			ok.Load(), servedBefore, fresh.served.Load())
	}
}
