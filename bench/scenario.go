package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"runtime"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute/bench/peers"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/metrics"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/proxy"
	"github.com/kvroute/kvroute/routing"
)

// Policy is a routing policy under comparison: a name and a constructor
// that builds it for one kvroute instance over that instance's pool.
type Policy struct {
	Name string
	// About says what the policy stands for in the comparison.
	About string
	New   func(pool *discovery.Pool) proxy.Picker
	// Configure, when set, adjusts the router's options after the
	// runner's defaults (e.g. the prefix hashing a policy needs); nil
	// leaves them.
	Configure func(*proxy.Options)
	// Replicas > 1 runs that many independent routers with this policy,
	// each given a random share of the traffic (no shared state).
	Replicas int
}

// Baseline is the policy results are compared against: round-robin is what
// a Kubernetes ClusterIP Service does.
const Baseline = "round-robin"

// Policies returns the table of policies a scenario compares, baseline
// first. A new policy (the prefix-aware one, a peer router's algorithm) is
// one more entry here; the runner reads nothing else.
func Policies() []Policy {
	return []Policy{
		{Name: Baseline, About: "what a ClusterIP Service does",
			New: func(*discovery.Pool) proxy.Picker { return routing.NewRoundRobin() }},
		{Name: "random", About: "uniform random pick",
			New: func(*discovery.Pool) proxy.Picker { return routing.NewRandom(seededIntn(policySeed)) }},
		{Name: "least-request", About: "fewer in-flight of two random pods",
			New: func(*discovery.Pool) proxy.Picker { return routing.NewLeastRequest(seededIntn(policySeed)) }},
		{Name: "prefix", About: "kvroute: prefix-aware, sticky until saturated", New: newPrefixPolicy},
		{Name: "prefix-3-replicas", About: "three independent kvroute replicas (prefix), a random third of the traffic each",
			Replicas: 3, New: newPrefixPolicy},
		{Name: "sglang-cache-aware", About: "SGLang router cache_aware (emulated)",
			New: func(*discovery.Pool) proxy.Picker { return peers.NewCacheAware() }},
		{Name: "gie-blend", About: "GIE classic scorer blend (emulated)",
			New: func(*discovery.Pool) proxy.Picker { return peers.NewBlend(policySeed) }},
		{Name: "llm-d-sticky", About: "llm-d sticky-until-saturated (emulated)",
			New: func(*discovery.Pool) proxy.Picker { return peers.NewSticky(1024, 1760) }},
	}
}

// newPrefixPolicy is the prefix policy with main's defaults (its index
// capacity follows the engines' scraped KV capacity once the router runs).
func newPrefixPolicy(*discovery.Pool) proxy.Picker {
	idx := prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: 1760, MaxEntries: 4_000_000, TTL: 30 * time.Minute})
	params, _ := PrefixParams() // checked by kvbench at start-up
	return routing.NewPrefix(idx, 1024, params)
}

// PrefixParams are the prefix policy's parameters in the benchmark: the
// defaults, overridden by KVBENCH_PREFIX_PARAMS (the JSON of
// routing.PrefixParams, any subset), so parameters can be explored without
// a rebuild.
// kvbench checks the variable at start-up; the policy table then uses the
// defaults if it is invalid.
func PrefixParams() (routing.PrefixParams, error) {
	p := routing.DefaultPrefixParams()
	if js := os.Getenv("KVBENCH_PREFIX_PARAMS"); js != "" {
		if err := json.Unmarshal([]byte(js), &p); err != nil {
			return routing.DefaultPrefixParams(), fmt.Errorf("KVBENCH_PREFIX_PARAMS: %w", err)
		}
		if err := p.Validate(); err != nil {
			return routing.DefaultPrefixParams(), fmt.Errorf("KVBENCH_PREFIX_PARAMS: %w", err)
		}
	}
	return p, nil
}

// policySeed seeds the randomised policies, so that a rerun draws the same
// picks for the same order of requests.
const policySeed = 0x6b76726f757465

// seededIntn returns a reproducible source of random ints, safe for
// concurrent use (one mutex; fine for a benchmark's router).
func seededIntn(seed uint64) func(int) int {
	var mu sync.Mutex
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	return func(n int) int {
		mu.Lock()
		defer mu.Unlock()
		return r.IntN(n)
	}
}

// SelectPolicies returns the policies of Policies() named in names, in
// table order; no names means all.
func SelectPolicies(names []string) ([]Policy, error) {
	all := Policies()
	if len(names) == 0 {
		return all, nil
	}
	want := make(map[string]bool, len(names))
	for _, n := range names {
		want[n] = true
	}
	var out []Policy
	for _, p := range all {
		if want[p.Name] {
			out = append(out, p)
			delete(want, p.Name)
		}
	}
	if len(want) > 0 {
		known := make([]string, len(all))
		for i, p := range all {
			known[i] = p.Name
		}
		for n := range want {
			return nil, fmt.Errorf("%w: unknown policy %q (known: %v)", ErrConfig, n, known)
		}
	}
	return out, nil
}

// Scenario is one comparison: a simulated fleet, a workload and a load,
// run once per policy on a fresh fleet (cold caches) behind a fresh
// in-process kvroute.
type Scenario struct {
	Name        string `json:"name"`
	Description string `json:"description"`
	// Pods is the fleet size.
	Pods int `json:"pods"`
	// Sim is every pod's configuration (pod i gets Seed+i).
	Sim sim.Config `json:"-"`
	// WorkingSet is the workload's prefix working set in tokens, the
	// figure the pods' KV capacity was sized against (0: not sized).
	WorkingSet int             `json:"working_set_tokens,omitempty"`
	API        API             `json:"api"`
	Workload   WorkloadConfig  `json:"workload"`
	Load       Load            `json:"load"`
	SLO        SLO             `json:"slo,omitzero"`
	Timeout    time.Duration   `json:"timeout,omitempty"`
	Seed       uint64          `json:"seed"`
	Fleet      FleetDescriptor `json:"fleet"`
}

// FleetDescriptor is the part of a scenario's sim.Config worth recording.
type FleetDescriptor struct {
	Model               string  `json:"model"`
	TimeScale           float64 `json:"time_scale"`
	BlockSize           int     `json:"block_size"`
	NumGPUBlocks        int     `json:"num_gpu_blocks"`
	KVTokensPerPod      int     `json:"kv_tokens_per_pod"`
	MaxNumSeqs          int     `json:"max_num_seqs"`
	MaxNumBatchedTokens int     `json:"max_num_batched_tokens"`
	// WorkingSetShare is the prefix working set ÷ the fleet's KV tokens.
	WorkingSetShare float64 `json:"working_set_share,omitempty"`
}

// describeFleet fills sc.Fleet from sc.Sim.
func (sc *Scenario) describeFleet() {
	cfg := sc.Sim
	_ = cfg.Validate() // fills defaults; errors surface when the fleet starts
	kv := cfg.NumGPUBlocks * cfg.BlockSize
	sc.Fleet = FleetDescriptor{
		Model: cfg.Model, TimeScale: cfg.TimeScale, BlockSize: cfg.BlockSize,
		NumGPUBlocks: cfg.NumGPUBlocks, KVTokensPerPod: kv,
		MaxNumSeqs: cfg.MaxNumSeqs, MaxNumBatchedTokens: cfg.MaxNumBatchedTokens,
	}
	if sc.WorkingSet > 0 && kv > 0 && sc.Pods > 0 {
		sc.Fleet.WorkingSetShare = float64(sc.WorkingSet) / float64(kv*sc.Pods)
	}
}

// Machine describes where a report was produced.
type Machine struct {
	CPU        string `json:"cpu"`
	Cores      int    `json:"cores"`
	GOMAXPROCS int    `json:"gomaxprocs"`
	GoVersion  string `json:"go_version"`
	OS         string `json:"os"`
}

// ThisMachine describes the running machine.
func ThisMachine() Machine {
	m := Machine{Cores: runtime.NumCPU(), GOMAXPROCS: runtime.GOMAXPROCS(0),
		GoVersion: runtime.Version(), OS: runtime.GOOS + "/" + runtime.GOARCH}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := bytes.Cut(sc.Bytes(), []byte(":")); ok && string(bytes.TrimSpace(k)) == "model name" {
				m.CPU = string(bytes.TrimSpace(v))
				break
			}
		}
		f.Close()
	}
	return m
}

// Report is a scenario's outcome: one Result per policy.
type Report struct {
	Scenario     Scenario  `json:"scenario"`
	Machine      Machine   `json:"machine"`
	Started      time.Time `json:"started"`
	WallSeconds  float64   `json:"wall_s"`
	IdealHitRate float64   `json:"ideal_hit_rate"`
	Runs         []*Result `json:"runs"`
}

// RunOptions tune RunScenario.
type RunOptions struct {
	// Policies to compare; nil means Policies().
	Policies []Policy
	// Progress receives each policy's live status line (nil: quiet).
	Progress io.Writer
	// Log receives one line per policy as it starts (nil: quiet).
	Log io.Writer
}

// RunScenario runs sc once per policy, each time on a fresh simulated fleet
// behind a fresh in-process kvroute, with the same seeded workload, and
// returns the report. When ctx ends it returns what finished with ctx's
// error.
func RunScenario(ctx context.Context, sc Scenario, opt RunOptions) (*Report, error) {
	if sc.Pods < 1 {
		return nil, fmt.Errorf("%w: scenario %s: pods must be ≥ 1", ErrConfig, sc.Name)
	}
	sc.describeFleet()
	pols := opt.Policies
	if pols == nil {
		pols = Policies()
	}
	wl, err := sc.Workload.Build()
	if err != nil {
		return nil, fmt.Errorf("scenario %s: %w", sc.Name, err)
	}
	sc.Workload = wl.Config
	rep := &Report{Scenario: sc, Machine: ThisMachine(), Started: time.Now()}
	defer func() { rep.WallSeconds = time.Since(rep.Started).Seconds() }()
	for _, p := range pols {
		if opt.Log != nil {
			fmt.Fprintf(opt.Log, "%s: %s on %d simulated pods behind kvroute\n", sc.Name, p.Name, sc.Pods)
		}
		res, err := runPolicy(ctx, sc, wl, p, opt.Progress)
		if res != nil {
			rep.Runs = append(rep.Runs, res)
			rep.IdealHitRate = res.IdealHitRate
		}
		if err != nil {
			return rep, fmt.Errorf("scenario %s, policy %s: %w", sc.Name, p.Name, err)
		}
	}
	return rep, nil
}

// kvroute settings of the in-process router: main's defaults.
const (
	routerMaxBody       = 64 << 20
	routerRetries       = 2
	routerConnect       = 5 * time.Second
	routerHeader        = 10 * time.Minute
	routerUpstreamIdle  = 4 * time.Second
	routerClientIdle    = 2 * time.Minute
	routerMaxConns      = 4096
	routerShutdownGrace = 10 * time.Second
)

// Router is an in-process kvroute on a loopback listener.
type Router struct {
	// URL is the router's base URL (http://127.0.0.1:port).
	URL       string
	Pool      *discovery.Pool
	srv       *proxy.Server
	served    chan error
	stopFleet context.CancelFunc
	fleetDone chan struct{}
}

// StartRouter starts kvroute on 127.0.0.1:0 in front of backends with the
// policy p, its own Prometheus registry, and discovery as main wires it:
// a static pool with health probes and engine scraping, whose scraped KV
// capacity sizes a prefix-aware policy's index and whose removals and
// restarts make it forget. Stop it with Close.
func StartRouter(p Policy, backends []string) (*Router, error) {
	var events routing.FleetEvents // the policy is set before the fleet runs
	o := discovery.Options{Logger: zap.NewNop()}
	events.Wire(&o)
	fleet, err := discovery.New(o)
	if err != nil {
		return nil, err
	}
	if err := fleet.AddStatic(discovery.RoleMixed, backends); err != nil {
		return nil, err
	}
	pool := fleet.Pool()
	opt := proxy.Options{
		Picker:                p.New(pool),
		Pool:                  pool,
		Metrics:               metrics.New(prometheus.NewRegistry(), proxy.Classes, nil),
		Logger:                zap.NewNop(),
		MaxBodyBytes:          routerMaxBody,
		Retries:               routerRetries,
		ConnectTimeout:        routerConnect,
		ResponseHeaderTimeout: routerHeader,
		UpstreamIdleTimeout:   routerUpstreamIdle,
		ClientIdleTimeout:     routerClientIdle,
		MaxConnsPerEndpoint:   routerMaxConns,
	}
	if p.Configure != nil {
		p.Configure(&opt)
	}
	if pfx, ok := opt.Picker.(*routing.Prefix); ok {
		events.Set(pfx)
	}
	if l, ok := opt.Picker.(proxy.Learner); ok {
		opt.Learner = l
	}
	srv := proxy.New(opt)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	ctx, stop := context.WithCancel(context.Background())
	r := &Router{URL: "http://" + ln.Addr().String(), Pool: pool, srv: srv, served: make(chan error, 1),
		stopFleet: stop, fleetDone: make(chan struct{})}
	go func() { defer close(r.fleetDone); _ = fleet.Run(ctx) }()
	go func() { r.served <- srv.Serve(ln) }()
	return r, nil
}

// Close drains the router (in-flight streams get 10 s) and waits for it.
func (r *Router) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), routerShutdownGrace)
	defer cancel()
	err := r.srv.Shutdown(ctx)
	err = errors.Join(err, <-r.served)
	r.stopFleet()
	<-r.fleetDone
	return err
}

// runPolicy runs one policy of sc on a fresh fleet and router.
func runPolicy(ctx context.Context, sc Scenario, wl *Workload, p Policy, progress io.Writer) (res *Result, err error) {
	fleet, err := sim.StartFleet(sc.Pods, sc.Sim)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, fleet.Close()) }()
	backends := fleet.URLs()
	if p.Replicas > 1 {
		// Independent replicas, each its own router and state over the
		// fleet; in front of them a random-policy kvroute hands each a
		// random share of the traffic, as a Service in front of several
		// router pods would.
		var replicas []string
		for i := 0; i < p.Replicas; i++ {
			inner, err := StartRouter(p, fleet.URLs())
			if err != nil {
				return nil, err
			}
			defer func() { err = errors.Join(err, inner.Close()) }()
			replicas = append(replicas, inner.URL)
		}
		backends = replicas
		p = Policy{Name: p.Name, New: func(*discovery.Pool) proxy.Picker { return routing.NewRandom(seededIntn(policySeed)) }}
	}
	rt, err := StartRouter(p, backends)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, rt.Close()) }()
	return Run(ctx, Config{
		BaseURL:   rt.URL,
		PodURLs:   fleet.URLs(),
		Model:     sc.Fleet.Model,
		API:       sc.API,
		Workload:  wl,
		Load:      sc.Load,
		SLO:       sc.SLO,
		TimeScale: sc.Fleet.TimeScale,
		Timeout:   sc.Timeout,
		Seed:      sc.Seed,
		Label:     p.Name,
		Progress:  progress,
	})
}
