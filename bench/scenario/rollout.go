package scenario

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/proc"
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
// sending each request to a random replica of its current set. It notes
// the replica each request went to and the prompt and cached tokens of its
// answer's usage.
type service struct {
	URL     string
	mu      sync.Mutex
	targets []*url.URL
	served  []served
	intn    func(int) int
	// sent counts the requests received.
	sent atomic.Int64
	srv  *httptest.Server
}

// served is one request the Service passed on, answered.
type served struct {
	host           string // the replica's host:port
	at             time.Time
	prompt, cached int
}

type sentAt struct{}

// startService starts a Service in front of urls on a loopback port.
func startService(urls []string) (*service, error) {
	s := &service{intn: seededIntn(policySeed ^ 1)}
	if err := s.set(urls); err != nil {
		return nil, err
	}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			s.sent.Add(1)
			pr.Out = pr.Out.WithContext(context.WithValue(pr.Out.Context(), sentAt{}, time.Now()))
			pr.SetURL(s.pick())
		},
		ModifyResponse: func(resp *http.Response) error {
			at, _ := resp.Request.Context().Value(sentAt{}).(time.Time)
			host := resp.Request.URL.Host
			resp.Body = &usageTail{ReadCloser: resp.Body, done: func(prompt, cached int) {
				s.mu.Lock()
				s.served = append(s.served, served{host: host, at: at, prompt: prompt, cached: cached})
				s.mu.Unlock()
			}}
			return nil
		},
		FlushInterval: -1, // streams pass through as they come
		Transport:     &http.Transport{MaxIdleConnsPerHost: 1024, DisableCompression: true},
		ErrorHandler: func(w http.ResponseWriter, _ *http.Request, err error) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadGateway)
			fmt.Fprintf(w, `{"error":{"message":%q,"type":"bad_gateway"}}`, "service: "+err.Error())
		},
	}
	s.srv = httptest.NewServer(proc.WholeBody(rp))
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

// Close stops the Service once the requests in flight have been answered.
func (s *service) Close() { s.srv.Close() }

// tokens sums the usage of the requests sent in [from, to) to host (or,
// with other, to every other replica).
func (s *service) tokens(host string, other bool, from, to time.Time) (n int, rate float64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var prompt, cached int
	for _, r := range s.served {
		if (r.host == host) != other && !r.at.Before(from) && r.at.Before(to) {
			n, prompt, cached = n+1, prompt+r.prompt, cached+r.cached
		}
	}
	if prompt > 0 {
		rate = float64(cached) / float64(prompt)
	}
	return n, rate
}

// usageTail passes an answer through and, when it is closed, hands done
// the last prompt_tokens and cached_tokens its final bytes carried (the
// usage of a whole answer or of a stream's last chunk; 0 without).
type usageTail struct {
	io.ReadCloser
	tail []byte
	done func(prompt, cached int)
	once sync.Once
}

// usageTailBytes is how much of an answer's end usageTail keeps: a
// usage chunk is a few hundred bytes.
const usageTailBytes = 4096

var (
	promptTokensRE = regexp.MustCompile(`"prompt_tokens":\s*(\d+)`)
	cachedTokensRE = regexp.MustCompile(`"cached_tokens":\s*(\d+)`)
)

func (u *usageTail) Read(p []byte) (int, error) {
	n, err := u.ReadCloser.Read(p)
	u.tail = append(u.tail, p[:n]...)
	if over := len(u.tail) - usageTailBytes; over > 0 {
		u.tail = append(u.tail[:0], u.tail[over:]...)
	}
	return n, err
}

func (u *usageTail) Close() error {
	u.once.Do(func() {
		last := func(re *regexp.Regexp) int {
			m := re.FindAllSubmatch(u.tail, -1)
			if len(m) == 0 {
				return 0
			}
			v, _ := strconv.Atoi(string(m[len(m)-1][1]))
			return v
		}
		u.done(last(promptTokensRE), last(cachedTokensRE))
	})
	return u.ReadCloser.Close()
}

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
	// (During) and in spans as long just before and after it. A
	// scenario's load may change in between (rising stages): Steady is
	// the same span of a run without the update in the same report (the
	// same replicas gossiping, PrefixGossip), when there is one.
	Before Window  `json:"before"`
	During Window  `json:"during"`
	After  Window  `json:"after"`
	Steady *Window `json:"steady,omitempty"`
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

// brief is w's cached rate, TTFT p90 and failures for a log line.
func (w Window) brief() string {
	return fmt.Sprintf("%.1f%% / %.0f ms / %d", 100*w.CachedRate, w.TTFTP90, w.Failed)
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
// requests each was sent in it and their cached ÷ prompt tokens as the
// engines' usage reported them; Cold counts the new replica's decisions
// for a prefix it had never seen (reason cold): with its peers' state
// pulled, none for a prefix they had placed.
type ReplicaWindow struct {
	Requests      int     `json:"requests"`
	Cold          int     `json:"cold"`
	CachedRate    float64 `json:"cached_rate"`
	PeersRequests int     `json:"peers_requests"`
	PeersRate     float64 `json:"peers_cached_rate"`
}

// cold returns the router's decisions for a prefix warm nowhere so far.
func (r *Router) cold() int {
	return int(sumBy(r.gather(), "kvroute_routing_decisions_total", "reason")[routing.ReasonCold])
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
	// firsts are the new replicas' first windows, whose requests finish
	// counts (rep.New) once they have all been answered.
	firsts []first
}

// first is a new replica's first window and its cold decisions in it.
type first struct {
	host     string
	from, to time.Time
	cold     int
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
	var since time.Time // when the replica replaced last took its share
	var cold int        // its cold decisions then
	for k := 0; k <= n; k++ {
		if err := ro.await(ctx, at[k]); err != nil {
			return err
		}
		now := time.Now()
		ro.walls = append(ro.walls, now)
		if k > 0 {
			nr := ro.slots[k-1]
			ro.firsts = append(ro.firsts, first{host: hostOf(nr.URL), from: since, to: now, cold: nr.cold() - cold})
		}
		if k == n {
			return nil
		}
		if err := ro.replace(ctx, k); err != nil {
			return err
		}
		since, cold = time.Now(), ro.slots[k].cold()
	}
	return nil
}

// hostOf returns the host:port of a router's URL.
func hostOf(u string) string {
	pu, err := url.Parse(u)
	if err != nil {
		return u
	}
	return pu.Host
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

// replace starts slot i's successor, waits until it is ready, hands it
// the old one's share of the Service and retires the old one.
func (ro *rollout) replace(ctx context.Context, i int) error {
	addr, err := proc.FreeLoopback()
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
	rep.New = make([]ReplicaWindow, len(ro.firsts))
	for i, f := range ro.firsts {
		w := &rep.New[i]
		w.Cold = f.cold
		w.Requests, w.CachedRate = ro.svc.tokens(f.host, false, f.from, f.to)
		w.PeersRequests, w.PeersRate = ro.svc.tokens(f.host, true, f.from, f.to)
	}
	rep.StartS, rep.EndS = at(ro.walls[0]), at(ro.walls[len(ro.walls)-1])
	span := rep.EndS - rep.StartS
	rep.Before = window(res.Requests, rep.StartS-span, rep.StartS)
	rep.During = window(res.Requests, rep.StartS, rep.EndS)
	rep.After = window(res.Requests, rep.EndS, rep.EndS+span)
	return &rep, err
}

// String is the rollout's log line.
func (r *Rollout) String() string {
	s := fmt.Sprintf("rolling update of %d replicas (%.1f–%.1f s), cached rate / TTFT p90 / failed: before %s, during %s, after %s",
		r.Replaced, r.StartS, r.EndS, r.Before.brief(), r.During.brief(), r.After.brief())
	s += fmt.Sprintf("; new replicas ready in %.0f ms", r.ReadyMs)
	for i, n := range r.New {
		s += fmt.Sprintf("; new %d: %.1f%% over %d requests (%d cold), its peers %.1f%% over %d", i, 100*n.CachedRate, n.Requests, n.Cold, 100*n.PeersRate, n.PeersRequests)
	}
	return s
}
