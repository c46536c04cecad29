package sim

import (
	"errors"
	"fmt"
	"net"
	"sync"
)

// Fleet is a set of pods serving on loopback, for tests, benchmarks and the
// demo. Safe for concurrent use.
type Fleet struct {
	mu   sync.Mutex
	pods []*Pod
	cfgs []Config
	urls []string
	addr []string
	wg   sync.WaitGroup
}

// StartFleet starts n pods of cfg on 127.0.0.1:0; pod i gets Seed cfg.Seed+i
// (and its own engine id) and, when they are set, KV event ports
// cfg.KVEventsPort+i and cfg.KVEventsReplayPort+i.
func StartFleet(n int, cfg Config) (*Fleet, error) {
	cfgs := make([]Config, n)
	for i := range cfgs {
		cfgs[i] = cfg.forPod(i)
	}
	return StartFleetOf(cfgs...)
}

// StartFleetOf starts one pod per config on 127.0.0.1:0.
func StartFleetOf(cfgs ...Config) (*Fleet, error) {
	addrs := make([]string, len(cfgs))
	for i := range addrs {
		addrs[i] = "127.0.0.1:0"
	}
	return StartFleetAt(addrs, cfgs)
}

// StartFleetAt starts pod i of cfgs listening on addrs[i] (host:port; port 0
// picks a free one). On error every pod started so far is closed.
func StartFleetAt(addrs []string, cfgs []Config) (*Fleet, error) {
	if len(addrs) != len(cfgs) {
		return nil, fmt.Errorf("%w: %d addresses for %d pods", ErrConfig, len(addrs), len(cfgs))
	}
	f := &Fleet{}
	for i, cfg := range cfgs {
		if err := f.add(addrs[i], cfg); err != nil {
			f.Close()
			return nil, fmt.Errorf("sim: pod %d: %w", i, err)
		}
	}
	return f, nil
}

func (f *Fleet) add(addr string, cfg Config) error {
	p, ln, err := startPod(addr, cfg)
	if err != nil {
		return err
	}
	f.mu.Lock()
	f.pods = append(f.pods, p)
	f.cfgs = append(f.cfgs, cfg)
	f.addr = append(f.addr, ln.Addr().String())
	f.urls = append(f.urls, "http://"+ln.Addr().String())
	f.mu.Unlock()
	f.serve(p, ln)
	return nil
}

func startPod(addr string, cfg Config) (*Pod, net.Listener, error) {
	p, err := New(cfg)
	if err != nil {
		return nil, nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		p.Close()
		return nil, nil, err
	}
	return p, ln, nil
}

func (f *Fleet) serve(p *Pod, ln net.Listener) {
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		_ = p.Serve(ln) // returns ErrClosed after Close
	}()
}

// Len returns the number of pods.
func (f *Fleet) Len() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.pods)
}

// URLs returns the pods' base URLs (http://127.0.0.1:port), in pod order.
func (f *Fleet) URLs() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.urls...)
}

// URL returns pod i's base URL.
func (f *Fleet) URL(i int) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.urls[i]
}

// Pod returns pod i (a new *Pod after Restart).
func (f *Fleet) Pod(i int) *Pod {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pods[i]
}

// Restart closes pod i and starts a fresh one with the same config on the
// same address: new start time and engine id, empty cache, zeroed metrics.
func (f *Fleet) Restart(i int) error {
	f.mu.Lock()
	old, cfg, addr := f.pods[i], f.cfgs[i], f.addr[i]
	f.mu.Unlock()
	if err := old.Close(); err != nil {
		return err
	}
	p, ln, err := startPod(addr, cfg)
	if err != nil {
		return fmt.Errorf("sim: restart pod %d: %w", i, err)
	}
	f.mu.Lock()
	f.pods[i] = p
	f.mu.Unlock()
	f.serve(p, ln)
	return nil
}

// Close closes every pod (concurrently) and waits for them.
func (f *Fleet) Close() error {
	f.mu.Lock()
	pods := append([]*Pod(nil), f.pods...)
	f.mu.Unlock()
	errs := make([]error, len(pods))
	var wg sync.WaitGroup
	for i, p := range pods {
		wg.Go(func() { errs[i] = p.Close() })
	}
	wg.Wait()
	f.wg.Wait()
	return errors.Join(errs...)
}
