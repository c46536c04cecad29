package scenario

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/routing"
)

// A rolling update of kvroute under load (Policy.Rolling), as Kubernetes
// runs one for a Deployment with maxSurge 1 and maxUnavailable 0: for each
// replica in turn a new one starts, joins its peers' gossip and reports
// ready (/readyz), the Service adds it and takes the old one out, and the
// old one drains. In front of the replicas is the scenario's own Service
// (service): each request to a random ready replica, as kube-proxy picks.

// service is the Service in front of a policy's replicas: a reverse proxy
// sending each request to a random replica of its current set.
type service struct {
	URL     string
	mu      sync.Mutex
	targets []*url.URL
	intn    func(int) int
	// sent counts the requests received.
	sent atomic.Int64
	srv  *httptest.Server
}

// startService starts a Service in front of urls on a loopback port.
func startService(urls []string) (*service, error) {
	s := &service{intn: seededIntn(policySeed ^ 1)}
	if err := s.set(urls); err != nil {
		return nil, err
	}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			s.sent.Add(1)
			pr.SetURL(s.pick())
		},
		FlushInterval: -1, // streams pass through as they come
		Transport:     &http.Transport{MaxIdleConnsPerHost: 1024, DisableCompression: true},
		ErrorHandler: func(w http.ResponseWriter, _ *http.Request, err error) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadGateway)
			fmt.Fprintf(w, `{"error":{"message":%q,"type":"bad_gateway"}}`, "service: "+err.Error())
		},
	}
	s.srv = httptest.NewServer(rp)
	s.URL = s.srv.URL
	return s, nil
}

// set makes urls the replicas new requests go to.
func (s *service) set(urls []string) error {
	ts := make([]*url.URL, len(urls))
	for i, u := range urls {
		var err error
		if ts[i], err = url.Parse(u); err != nil {
			return err
		}
	}
	s.mu.Lock()
	s.targets = ts
	s.mu.Unlock()
	return nil
}

func (s *service) pick() *url.URL {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.targets[s.intn(len(s.targets))]
}

// Close stops the Service (requests in flight are cut).
func (s *service) Close() { s.srv.Close() }

// Rollout is what a rolling update of a policy's replicas did to its run.
// Times are modelled seconds from the run's start.
type Rollout struct {
	// Replaced is how many replicas were replaced (each once, in turn).
	Replaced int `json:"replaced"`
	// StartS is when the first new replica started, EndS when the last
	// one's first window (New) ended.
	StartS float64 `json:"start_s"`
	EndS   float64 `json:"end_s"`
	// ReadyMs is each new replica's start to ready (/readyz 200), in wall
	// milliseconds: its join and pull of a peer's state included.
	ReadyMs []float64 `json:"ready_ms"`
	// Before, During and After are the requests sent in the rollout's span
	// (During) and in spans as long just before and after it.
	Before Window `json:"before"`
	During Window `json:"during"`
	After  Window `json:"after"`
	// New is each new replica over its first window: from when the
	// Service added it until the next replacement began (the last: for as
	// long again).
	New []ReplicaWindow `json:"new"`
}

// Window is the requests sent in a span of a run.
type Window struct {
	FromS    float64 `json:"from_s"`
	ToS      float64 `json:"to_s"`
	Requests int     `json:"requests"`
	Failed   int     `json:"failed"`
	// CachedRate is cached ÷ prompt tokens as the engines reported them.
	CachedRate float64 `json:"cached_rate"`
	TTFTMean   float64 `json:"ttft_mean_ms"`
	TTFTP90    float64 `json:"ttft_p90_ms"`
}

// window summarises the requests of rs sent in [from, to).
func window(rs []load.RequestResult, from, to float64) Window {
	var in []load.RequestResult
	for _, r := range rs {
		if r.Start >= from && r.Start < to {
			in = append(in, r)
		}
	}
	s := load.Summarize(in, load.SLO{}, to-from)
	return Window{FromS: from, ToS: to, Requests: s.Requests, Failed: s.Failed, CachedRate: s.CachedRate,
		TTFTMean: s.TTFT.Mean, TTFTP90: s.TTFT.P90}
}

// ReplicaWindow is one new replica's first window beside its peers': the
// engines' cached tokens over the prompt tokens each routed
// (kvroute_prefix_engine_cached_tokens_total ÷
// kvroute_routed_prompt_tokens_total, as an operator reads them).
// Cold counts its decisions for a prefix it had never seen (reason cold):
// with its peers' state pulled, none for a prefix they had placed.
type ReplicaWindow struct {
	Decisions      int     `json:"decisions"`
	Cold           int     `json:"cold"`
	HitRate        float64 `json:"hit_rate"`
	PeersHitRate   float64 `json:"peers_hit_rate"`
	PeersDecisions int     `json:"peers_decisions"`
}

// tokens is a replica's counters at one moment.
type tokens struct{ cached, prompt, decisions, cold float64 }

func (r *Router) tokens() tokens {
	mfs := r.gather()
	byReason := sumBy(mfs, "kvroute_routing_decisions_total", "reason")
	t := tokens{cached: sumBy(mfs, "kvroute_prefix_engine_cached_tokens_total", "")[""],
		prompt: sumBy(mfs, "kvroute_routed_prompt_tokens_total", "")[""], cold: byReason[routing.ReasonCold]}
	for _, n := range byReason {
		t.decisions += n
	}
	return t
}

func (t tokens) add(u tokens) tokens {
	return tokens{t.cached + u.cached, t.prompt + u.prompt, t.decisions + u.decisions, t.cold + u.cold}
}

func (t tokens) sub(u tokens) tokens {
	return tokens{t.cached - u.cached, t.prompt - u.prompt, t.decisions - u.decisions, t.cold - u.cold}
}

func (t tokens) rate() float64 {
	if t.prompt <= 0 {
		return 0
	}
	return t.cached / t.prompt
}

// Ready reports whether the router would answer /readyz with 200 (its
// endpoints probed, a replica's gossip joined), else why not.
func (r *Router) Ready() error {
	rec := httptest.NewRecorder()
	r.rt.AdminHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	if rec.Code != http.StatusOK {
		return fmt.Errorf("not ready: %d %s", rec.Code, rec.Body.String())
	}
	return nil
}

// readyTimeout bounds a new replica's wait for /readyz.
const readyTimeout = 30 * time.Second

// rollout replaces the replicas of p behind svc one at a time while a run
// sends total requests (≤ 0: unknown, no rollout): the first replacement
// when a third of them has reached the Service, the others spread over
// the next third. The replicas are the routers of slots, gossiping at
// addrs (slot i at addrs[i]); new ones take their places.
type rollout struct {
	p       Policy
	pods    []string
	engines []sim.Config
	svc     *service
	slots   []*Router
	addrs   []string
	// retired are the replaced routers, closing; closing their errors.
	retired sync.WaitGroup
	errs    chan error
	rep     Rollout
	// walls are the wall times of rep's events: each replacement's start
	// and the end of the last window.
	walls []time.Time
}

func newRollout(p Policy, pods []string, engines []sim.Config, svc *service, slots []*Router, addrs []string) *rollout {
	return &rollout{p: p, pods: pods, engines: engines, svc: svc, slots: slots, addrs: addrs,
		errs: make(chan error, len(slots))}
}

// run drives the rollout until it is done or ctx ends; it returns the
// first error that stopped it.
func (ro *rollout) run(ctx context.Context, total int) error {
	n := len(ro.slots)
	if total <= 0 || n == 0 {
		return nil
	}
	// Replacement k begins when at[k] requests have reached the Service;
	// at[n] ends the last new replica's window.
	at := make([]int64, n+1)
	for k := range at {
		at[k] = int64(total/3 + k*total/(3*n))
	}
	var open tokens // the window of the replica replaced last: its counters and its peers' at its start
	var openPeers tokens
	for k := 0; k <= n; k++ {
		if err := ro.await(ctx, at[k]); err != nil {
			return err
		}
		ro.walls = append(ro.walls, time.Now())
		if k > 0 {
			ro.closeWindow(k-1, open, openPeers)
		}
		if k == n {
			return nil
		}
		if err := ro.replace(ctx, k); err != nil {
			return err
		}
		open, openPeers = ro.slots[k].tokens(), ro.peers(k)
	}
	return nil
}

// await waits until the Service has received n requests.
func (ro *rollout) await(ctx context.Context, n int64) error {
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for ro.svc.sent.Load() < n {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}

// peers returns the summed counters of every slot but i.
func (ro *rollout) peers(i int) tokens {
	var s tokens
	for j, r := range ro.slots {
		if j != i {
			s = s.add(r.tokens())
		}
	}
	return s
}

// closeWindow records slot i's first window, which began at start (its
// peers' at peers).
func (ro *rollout) closeWindow(i int, start, peers tokens) {
	own, others := ro.slots[i].tokens().sub(start), ro.peers(i).sub(peers)
	ro.rep.New = append(ro.rep.New, ReplicaWindow{Decisions: int(own.decisions), Cold: int(own.cold), HitRate: own.rate(),
		PeersHitRate: others.rate(), PeersDecisions: int(others.decisions)})
}

// replace starts slot i's successor, waits until it is ready, hands it
// the old one's share of the Service and retires the old one.
func (ro *rollout) replace(ctx context.Context, i int) error {
	addr, err := freeLoopback()
	if err != nil {
		return err
	}
	addrs := slices.Clone(ro.addrs)
	addrs[i] = addr
	begin := time.Now()
	nr, err := StartRouter(gossipReplica(ro.p, addrs, i, 1), ro.pods, ro.engines)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(readyTimeout)
	for {
		err := nr.Ready()
		if err == nil {
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return errors.Join(fmt.Errorf("scenario: new replica %d: %w", i, err), nr.Close())
		}
		time.Sleep(10 * time.Millisecond)
	}
	ro.rep.ReadyMs = append(ro.rep.ReadyMs, float64(time.Since(begin).Microseconds())/1e3)
	old := ro.slots[i]
	ro.slots[i], ro.addrs[i] = nr, addr
	urls := make([]string, len(ro.slots))
	for j, r := range ro.slots {
		urls[j] = r.URL
	}
	if err := ro.svc.set(urls); err != nil {
		return err
	}
	ro.rep.Replaced++
	ro.retired.Add(1)
	go func() {
		defer ro.retired.Done()
		// The Service has stopped picking it; a request picked a moment
		// before still reaches it, then it drains (in-flight streams
		// finish) and leaves the gossip.
		time.Sleep(time.Second)
		ro.errs <- old.Close()
	}()
	return nil
}

// finish waits for the retired replicas, fills in the report's windows
// from res and returns it with the replicas' closing errors.
func (ro *rollout) finish(res *load.Result, scale float64) (*Rollout, error) {
	ro.retired.Wait()
	close(ro.errs)
	var err error
	for e := range ro.errs {
		err = errors.Join(err, e)
	}
	if len(ro.walls) < 2 || res == nil {
		return nil, err
	}
	at := func(t time.Time) float64 { return t.Sub(res.Started).Seconds() * scale }
	rep := ro.rep
	rep.StartS, rep.EndS = at(ro.walls[0]), at(ro.walls[len(ro.walls)-1])
	span := rep.EndS - rep.StartS
	rep.Before = window(res.Requests, rep.StartS-span, rep.StartS)
	rep.During = window(res.Requests, rep.StartS, rep.EndS)
	rep.After = window(res.Requests, rep.EndS, rep.EndS+span)
	return &rep, err
}

// String is the rollout's log line.
func (r *Rollout) String() string {
	s := fmt.Sprintf("rolling update of %d replicas (%.1f–%.1f s), cached rate / TTFT p90 / failed: before %.1f%% / %.0f ms / %d, during %.1f%% / %.0f ms / %d, after %.1f%% / %.0f ms / %d; new replicas ready in %.0f ms",
		r.Replaced, r.StartS, r.EndS, 100*r.Before.CachedRate, r.Before.TTFTP90, r.Before.Failed,
		100*r.During.CachedRate, r.During.TTFTP90, r.During.Failed, 100*r.After.CachedRate, r.After.TTFTP90, r.After.Failed,
		r.ReadyMs)
	for i, w := range r.New {
		s += fmt.Sprintf("; new %d: %.1f%% over %d requests (%d cold), its peers %.1f%%", i, 100*w.HitRate, w.Decisions, w.Cold, 100*w.PeersHitRate)
	}
	return s
}
