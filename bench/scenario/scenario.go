// Package scenario runs kvbench's policy comparisons: a simulated fleet
// (bench/sim) behind a fresh in-process kvroute per routing policy, the same
// seeded workload and load driven through each (bench/load), and the
// built-in presets, the demo and the router-overhead measurement. It owns
// the policy table, the router wiring, the fitting of loads to engine
// profiles (Sizing) and the matrix's choice of workloads, profiles and
// policies; rendering results is bench/report's.
package scenario

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/kvroute/kvroute/app"
	"github.com/kvroute/kvroute/bench/llmd"
	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/localengine"
	"github.com/kvroute/kvroute/bench/proc"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/bench/workload"
)

// ErrConfig is wrapped by every configuration error.
var ErrConfig = errors.New("scenario: invalid config")

// Scenario is one comparison: a simulated fleet, a workload and a load,
// run once per policy on a fresh fleet (cold caches) behind a fresh
// in-process kvroute.
type Scenario struct {
	Name        string `json:"name"`
	Description string `json:"description"`
	// Pods is the fleet size.
	Pods int `json:"pods"`
	// Engine names the pods' engine (Engines): "" or EngineKVSim for
	// bench/sim, EngineLLMD for the llm-d simulator with settings derived
	// from the same configs (LLMDSettings), EngineOllama or EngineLlamaCpp
	// for real local servers (Sim then unused).
	Engine string `json:"engine,omitempty"`
	// Local are the real local servers' flags (Engine is taken from
	// Engine); nil: the engine's defaults.
	Local *localengine.Settings `json:"-"`
	// Profile names the pods' engine profile (sim.Profiles); "" runs Sim
	// as it is.
	Profile string `json:"profile,omitempty"`
	// Sim is every pod's configuration (pod i gets Seed+i); with a Profile
	// its zero engine fields come from the profile's engines (see
	// PodConfigs).
	Sim sim.Config `json:"-"`
	// Sizing says how the load was fitted to the profile (nil: not fitted).
	Sizing *Sizing `json:"sizing,omitempty"`
	// WorkingSet is the workload's prefix working set in tokens, the
	// figure the pods' KV capacity was sized against (0: not sized).
	WorkingSet int             `json:"working_set_tokens,omitempty"`
	API        workload.API    `json:"api"`
	Workload   workload.Config `json:"workload"`
	Load       load.Load       `json:"load"`
	SLO        load.SLO        `json:"slo,omitzero"`
	Timeout    time.Duration   `json:"timeout,omitempty"`
	Seed       uint64          `json:"seed"`
	Fleet      FleetDescriptor `json:"fleet"`
	// Policies names the policies compared when the caller picks none
	// (RunOptions.Policies nil); nil: every policy of Policies().
	Policies []string `json:"policies,omitempty"`

	// zmqEndpoint, when set, is where llm-d pods publish their KV events
	// (a policy's router listening there; runPolicy sets it).
	zmqEndpoint string
	// fanout, when set, passes the llm-d pods' KV events on to each of a
	// policy's router replicas (runPolicy sets it).
	fanout *llmd.Fanout
	// llmdMaxWaiting > 0 bounds llm-d pods' waiting queues (429 beyond).
	llmdMaxWaiting int
}

// FleetDescriptor is the part of a scenario's sim.Config worth recording:
// pod 0's, and the engine of every pod.
type FleetDescriptor struct {
	// Engines names each pod's engine (sim.Engine.Name) when the scenario
	// has a profile.
	Engines             []string `json:"engines,omitempty"`
	Model               string   `json:"model"`
	TimeScale           float64  `json:"time_scale"`
	BlockSize           int      `json:"block_size"`
	NumGPUBlocks        int      `json:"num_gpu_blocks"`
	KVTokensPerPod      int      `json:"kv_tokens_per_pod"`
	MaxNumSeqs          int      `json:"max_num_seqs"`
	MaxNumBatchedTokens int      `json:"max_num_batched_tokens"`
	// WorkingSetShare is the prefix working set ÷ the fleet's KV tokens.
	WorkingSetShare float64 `json:"working_set_share,omitempty"`
	// LLMD is pod 0's llm-d simulator settings (engine llm-d only).
	LLMD *llmd.Settings `json:"llmd,omitempty"`
	// Local is the real local servers' engine and flags (engines ollama
	// and llamacpp only; Model is then localengine.Model, TimeScale 1).
	Local *localengine.Settings `json:"local,omitempty"`
}

// describeFleet fills sc.Fleet from sc.Sim and the profile.
func (sc *Scenario) describeFleet() {
	cfg := sc.Sim
	if cfgs, err := sc.PodConfigs(); err == nil && len(cfgs) > 0 {
		cfg = cfgs[0]
	}
	_ = cfg.Validate() // fills defaults; errors surface when the fleet starts
	kv := cfg.NumGPUBlocks * cfg.BlockSize
	sc.Fleet = FleetDescriptor{Engines: sc.engineNames(),
		Model: cfg.Model, TimeScale: cfg.TimeScale, BlockSize: cfg.BlockSize,
		NumGPUBlocks: cfg.NumGPUBlocks, KVTokensPerPod: kv,
		MaxNumSeqs: cfg.MaxNumSeqs, MaxNumBatchedTokens: cfg.MaxNumBatchedTokens,
	}
	if s, ok := sc.localSettings(); ok {
		sc.Fleet.Local, sc.Fleet.Model, sc.Fleet.TimeScale = &s, localengine.Model, 1
	}
	if sc.engineName() == EngineLLMD {
		prompt, output := meanRequest(sc.Workload)
		s := LLMDSettings(cfg, prompt, output)
		sc.Fleet.LLMD = &s
	}
	if sc.WorkingSet > 0 && kv > 0 && sc.Pods > 0 {
		sc.Fleet.WorkingSetShare = float64(sc.WorkingSet) / float64(kv*sc.Pods)
	}
}

// profileNote is " (profile NAME)" for a profile other than the default,
// and the engine when it is not bench/sim.
func (sc *Scenario) profileNote() string {
	note := ""
	if sc.Profile != "" && sc.Profile != sim.DefaultProfile {
		note = " (profile " + sc.Profile + ")"
	}
	if e := sc.engineName(); e != EngineKVSim {
		note += " on " + e
	}
	return note
}

// engineNames returns each pod's engine name, nil without a profile.
func (sc *Scenario) engineNames() []string {
	p, err := sim.LookupProfile(sc.Profile)
	if sc.Profile == "" || err != nil {
		return nil
	}
	names := make([]string, sc.Pods)
	for i := range names {
		names[i] = p.Engine(i).Name
	}
	return names
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
	Scenario     Scenario       `json:"scenario"`
	Machine      Machine        `json:"machine"`
	Started      time.Time      `json:"started"`
	WallSeconds  float64        `json:"wall_s"`
	IdealHitRate float64        `json:"ideal_hit_rate"`
	Runs         []*load.Result `json:"runs"`
	// Learned is, per policy, what the router had learned of each pod at
	// the end of its run (one router; none for replicated policies).
	Learned map[string][]Learned `json:"learned,omitempty"`
	// NearMisses is, per policy, kvroute's near-identical prompt count and
	// the workload's truth (only where either is not zero).
	NearMisses map[string]NearMisses `json:"near_misses,omitempty"`
	// Rollouts are, per policy with a rolling update of its replicas
	// (Policy.Rolling), what the update did.
	Rollouts map[string]*Rollout `json:"rollouts,omitempty"`
	// Rounds are each round's own figures when there were several (Runs
	// then pools them); Learned, NearMisses and Rollouts are the first
	// round's.
	Rounds []Round `json:"rounds,omitempty"`
}

// RunOptions tune Run.
type RunOptions struct {
	// Policies to compare; nil means the scenario's own (Scenario.Policies).
	Policies []Policy
	// Progress receives each policy's live status line (nil: quiet).
	Progress io.Writer
	// Log receives one line per policy as it starts (nil: quiet).
	Log io.Writer
	// LLMDBinary is the llm-d simulator's path for scenarios on that
	// engine ("": found by llmd.Binary).
	LLMDBinary string
	// Rounds runs every policy this many times (0 and 1: once); see Run.
	Rounds int
}

// Run runs sc once per policy, each time on a fresh simulated fleet
// behind a fresh in-process kvroute, with the same seeded workload, and
// returns the report. With opt.Rounds > 1 it does that Rounds times, round
// r with seed Seed+r and the policies in reverse order every other round
// (so that a machine whose speed drifts favours none), and reports each
// policy's rounds pooled (load.Merge) beside each round's own figures.
// When ctx ends it returns what finished with ctx's error.
func Run(ctx context.Context, sc Scenario, opt RunOptions) (*Report, error) {
	if sc.Pods < 1 {
		return nil, fmt.Errorf("%w: scenario %s: pods must be ≥ 1", ErrConfig, sc.Name)
	}
	sc.describeFleet()
	pols := opt.Policies
	if pols == nil {
		var err error
		if pols, err = SelectPolicies(sc.Policies); err != nil {
			return nil, fmt.Errorf("scenario %s: %w", sc.Name, err)
		}
	}
	rounds := max(opt.Rounds, 1)
	if rounds > 1 && len(sc.Load.Stages) > 0 {
		return nil, fmt.Errorf("%w: scenario %s: rounds of a staged load cannot be pooled", ErrConfig, sc.Name)
	}
	rep := &Report{Scenario: sc, Machine: ThisMachine(), Started: time.Now()}
	defer func() { rep.WallSeconds = time.Since(rep.Started).Seconds() }()
	byPolicy := map[string][]*load.Result{}
	var err error
	for r := range rounds {
		rsc := sc
		rsc.Seed += uint64(r)
		rsc.Workload.Seed += uint64(r)
		rsc.Sim.Seed += uint64(r)
		order := slices.Clone(pols)
		if r%2 == 1 {
			slices.Reverse(order)
		}
		var runs []*load.Result
		runs, err = rep.runRound(ctx, rsc, order, opt, r == 0)
		for _, res := range runs {
			byPolicy[res.Label] = append(byPolicy[res.Label], res)
		}
		if rounds > 1 {
			rep.Rounds = append(rep.Rounds, newRound(rsc.Seed, runs))
		}
		if err != nil {
			break
		}
	}
	rep.steadySpans(byPolicy[PrefixGossip], opt.Log)
	for _, p := range pols {
		if runs := byPolicy[p.Name]; len(runs) > 0 {
			pooled, merr := load.Merge(runs, sc.SLO)
			if merr != nil {
				return rep, errors.Join(err, merr)
			}
			rep.Runs = append(rep.Runs, pooled)
		}
	}
	return rep, err
}

// runRound runs sc once per policy of pols, in that order, and returns
// the runs that finished. The first round also sets the report's
// scenario (with its built workload) and ideal hit rate.
func (rep *Report) runRound(ctx context.Context, sc Scenario, pols []Policy, opt RunOptions, first bool) ([]*load.Result, error) {
	wl, err := sc.Workload.Build()
	if err != nil {
		return nil, fmt.Errorf("scenario %s: %w", sc.Name, err)
	}
	sc.Workload = wl.Config
	if first {
		rep.Scenario.Workload = wl.Config
	}
	var runs []*load.Result
	for _, p := range pols {
		if opt.Log != nil {
			front := "behind kvroute"
			if p.Direct {
				front = "sent to directly"
			}
			fmt.Fprintf(opt.Log, "%s: %s on %d pods%s %s (seed %d)\n", sc.Name, p.Name, sc.Pods, sc.profileNote(), front, sc.Seed)
		}
		res, seen, err := runPolicy(ctx, sc, wl, p, opt)
		if res != nil {
			runs = append(runs, res)
			if first {
				rep.IdealHitRate = res.IdealHitRate
				rep.addNearMisses(p, wl, len(res.Requests), seen.nearMisses)
			}
		}
		rep.logSeen(p, seen, opt, first)
		if err != nil {
			return runs, fmt.Errorf("scenario %s, policy %s: %w", sc.Name, p.Name, err)
		}
	}
	return runs, nil
}

// logSeen records (first round only) and logs what p's routers learned
// and indexed.
func (rep *Report) logSeen(p Policy, seen routerState, opt RunOptions, first bool) {
	name := rep.Scenario.Name
	if len(seen.learned) > 0 {
		if first {
			if rep.Learned == nil {
				rep.Learned = map[string][]Learned{}
			}
			rep.Learned[p.Name] = seen.learned
		}
		if opt.Log != nil {
			fmt.Fprintf(opt.Log, "%s: %s learned %s\n", name, p.Name, describeLearned(seen.learned))
		}
	}
	if opt.Log != nil && seen.index != "" {
		fmt.Fprintf(opt.Log, "%s: %s %s\n", name, p.Name, seen.index)
	}
	if opt.Log != nil && seen.kvBatches > 0 {
		fmt.Fprintf(opt.Log, "%s: %s was fed %d KV-event batches\n", name, p.Name, seen.kvBatches)
	}
	if seen.rollout != nil {
		if first {
			if rep.Rollouts == nil {
				rep.Rollouts = map[string]*Rollout{}
			}
			rep.Rollouts[p.Name] = seen.rollout
		}
		if opt.Log != nil {
			fmt.Fprintf(opt.Log, "%s: %s %s\n", name, p.Name, seen.rollout)
		}
	}
}

// steadySpans sets each rollout's Steady window from the first of steady,
// the runs of the same replicas without the update, and logs it beside
// the rollout's own line (logSeen's).
func (rep *Report) steadySpans(steady []*load.Result, log io.Writer) {
	if len(steady) == 0 {
		return
	}
	for name, ro := range rep.Rollouts {
		if ro.Replaced == 0 {
			continue
		}
		w := window(steady[0].Requests, ro.StartS, ro.EndS)
		ro.Steady = &w
		if log != nil {
			fmt.Fprintf(log, "%s: %s without the update, the same span of %s: %s\n", rep.Scenario.Name, name, PrefixGossip, w.brief())
		}
	}
}

// Round is one round's own figures (RunOptions.Rounds > 1), per policy in
// the order they ran.
type Round struct {
	Seed uint64     `json:"seed"`
	Runs []RoundRun `json:"runs"`
}

// RoundRun is one policy's figures in one round.
type RoundRun struct {
	Label      string  `json:"label"`
	Requests   int     `json:"requests"`
	Failed     int     `json:"failed"`
	TTFTMean   float64 `json:"ttft_mean_ms"`
	TTFTP90    float64 `json:"ttft_p90_ms"`
	CachedRate float64 `json:"cached_rate"`
	HitRate    float64 `json:"hit_rate,omitempty"`
	// Outside is the run's cores busy outside the benchmark
	// (load.CPUStats.Outside); nil where unknown.
	Outside *float64 `json:"outside_cores,omitempty"`
}

func newRound(seed uint64, runs []*load.Result) Round {
	rd := Round{Seed: seed}
	for _, r := range runs {
		s := &r.Summary
		rr := RoundRun{Label: r.Label, Requests: s.Requests, Failed: s.Failed, TTFTMean: s.TTFT.Mean, TTFTP90: s.TTFT.P90, CachedRate: s.CachedRate}
		if o := r.CPU.Outside; o >= 0 {
			rr.Outside = &o
		}
		if r.Engine != nil {
			rr.HitRate = r.Engine.HitRate
		}
		rd.Runs = append(rd.Runs, rr)
	}
	return rd
}

// NearMisses compares kvroute's near-identical prompt detector with the
// workload's truth for one policy's run.
type NearMisses struct {
	// Counted is kvroute_prompt_near_misses_total at the end of the run
	// (summed over replicas).
	Counted int `json:"counted"`
	// Truth is what the workload sent (workload.NearIdentical for the
	// requests sent, as the policy's router forwarded them).
	Truth int `json:"truth"`
}

// addNearMisses records p's near-miss count beside the truth for the n
// requests sent of wl, when either is not zero.
func (rep *Report) addNearMisses(p Policy, wl *workload.Workload, n int, counted int) {
	truth := wl.NearIdentical(n, routerConfig(p, nil, nil).NormalizePrompts)
	if truth == 0 && counted == 0 {
		return
	}
	if rep.NearMisses == nil {
		rep.NearMisses = map[string]NearMisses{}
	}
	rep.NearMisses[p.Name] = NearMisses{Counted: counted, Truth: truth}
}

// routerState is what runPolicy read from the policy's routers at the end
// of its run.
type routerState struct {
	// learned is what the router learned of each pod (one router only).
	learned []Learned
	// nearMisses is the routers' near-identical prompt count.
	nearMisses int
	// index describes the routers' decisions and indexes (Router.Index),
	// one replica after the other.
	index string
	// kvBatches is the KV-event batches the routers' policies were fed
	// (Router.KVEventBatches).
	kvBatches int
	// rollout is what a rolling update did (Policy.Rolling), nil without.
	rollout *Rollout
}

// runPolicy runs one policy of sc on a fresh fleet and router.
func runPolicy(ctx context.Context, sc Scenario, wl *workload.Workload, p Policy, opt RunOptions) (res *load.Result, seen routerState, err error) {
	cfgs, err := sc.PodConfigs()
	if err != nil {
		return nil, seen, err
	}
	if sc.Sim.CPUBlocks > 0 && sc.engineName() != EngineKVSim {
		return nil, seen, fmt.Errorf("%w: %s: a CPU KV tier runs on %s only", ErrConfig, sc.Name, EngineKVSim)
	}
	if p.PrefillShare > 0 && sc.engineName() != EngineKVSim {
		return nil, seen, fmt.Errorf("%w: %s: disaggregated layouts run on %s only", ErrConfig, p.Name, EngineKVSim)
	}
	p.layOut(cfgs)
	zmq, err := eventsLayout(sc, p, cfgs)
	if err != nil {
		return nil, seen, err
	}
	if zmq != "" {
		sc.zmqEndpoint = "tcp://" + zmq
		if p.Replicas > 1 {
			if sc.fanout, err = llmd.StartFanout(zmq); err != nil {
				return nil, seen, err
			}
			defer func() { err = errors.Join(err, sc.fanout.Close()) }()
		}
	}
	fleet, err := startFleet(ctx, &sc, cfgs, opt.LLMDBinary)
	if err != nil {
		return nil, seen, err
	}
	defer func() { err = errors.Join(err, fleet.Close()) }()
	lc := load.Config{
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
		Progress:  opt.Progress,
		// Real local servers have no vLLM /metrics.
		NoEngineMetrics: IsLocal(sc.engineName()),
	}
	if p.Direct {
		lc.Direct = true
		res, err = load.Run(ctx, lc)
		return res, seen, err
	}
	front, backends := p, fleet.URLs()
	if p.Events {
		if backends, err = eventBackends(fleet, zmq, &p); err != nil {
			return nil, seen, err
		}
		front = p
	}
	if p.Replicas > 0 {
		return sc.runReplicas(ctx, lc, p, backends, cfgs)
	}
	rt, err := StartRouter(front, backends, sc.simEngines(cfgs))
	if err != nil {
		return nil, seen, err
	}
	defer func() { err = errors.Join(err, rt.Close()) }()
	defer func() { seen.learned = rt.Learned() }()
	defer seen.read([]*Router{rt})
	lc.BaseURL = rt.URL
	res, err = load.Run(ctx, lc)
	return res, seen, err
}

// runRolling runs lc through the Service in front of replicas (gossiping
// at addrs) while a rolling update replaces each of them in turn
// (Policy.Rolling), and records in seen what the replicas did; replicas
// ends as the live ones.
func runRolling(ctx context.Context, lc load.Config, p Policy, pods []string, engines []sim.Config, replicas []*Router, addrs []string, seen *routerState) (*load.Result, error) {
	urls := make([]string, len(replicas))
	for i, r := range replicas {
		urls[i] = r.URL
	}
	svc, err := startService(urls)
	if err != nil {
		return nil, err
	}
	ro := newRollout(p, pods, engines, svc, replicas, addrs)
	rctx, stop := context.WithCancel(ctx)
	rolled := make(chan error, 1)
	total := lc.Planned()
	go func() { rolled <- ro.run(rctx, total) }()
	lc.BaseURL = svc.URL
	res, err := load.Run(ctx, lc)
	stop()
	if rerr := <-rolled; rerr != nil && !errors.Is(rerr, context.Canceled) {
		err = errors.Join(err, rerr)
	}
	svc.Close() // waits for the answers it passes on: every one counted
	rep, rerr := ro.finish(res, lc.TimeScale)
	seen.rollout = rep
	seen.read(replicas)
	return res, errors.Join(err, rerr)
}

// read adds what replicas counted and indexed to s.
func (s *routerState) read(replicas []*Router) {
	var idx []string
	for _, r := range replicas {
		s.nearMisses += r.NearMisses()
		s.kvBatches += r.KVEventBatches()
		if i := r.Index(); i != "" {
			idx = append(idx, i)
		}
	}
	s.index = strings.Join(idx, " | ")
}

// eventsLayout readies the pods of a policy fed by KV events (p.Events):
// kvsim's publish on a free port each; llm-d's dial the router, which
// listens on the loopback address zmq it returns ("" otherwise).
func eventsLayout(sc Scenario, p Policy, cfgs []sim.Config) (zmq string, err error) {
	if !p.Events {
		return "", nil
	}
	if p.Direct || p.PrefillShare > 0 {
		return "", fmt.Errorf("%w: %s: KV events need a router in front of mixed pods", ErrConfig, p.Name)
	}
	switch sc.engineName() {
	case EngineKVSim:
		for i := range cfgs {
			cfgs[i].KVEventsPort = -1 // a free port each
		}
	case EngineLLMD:
		if p.Replicas > 1 && p.Rolling {
			return "", fmt.Errorf("%w: %s: a rolling update of replicas fed by the llm-d simulator's KV events is not wired", ErrConfig, p.Name)
		}
		return proc.FreeLoopback()
	}
	return "", nil
}

// eventBackends returns the backends of p's routers when p.Events: on
// kvsim the pods' URLs naming their publishers ("#kv-events=PORT"); on
// llm-d the URLs as they are, p's routers listening at zmq for the pods'
// publishers (p.Configure extended to set KVEventsListen).
func eventBackends(fleet engineFleet, zmq string, p *Policy) ([]string, error) {
	urls := fleet.URLs()
	if zmq != "" {
		*p = p.also(func(c *app.Config) { c.KVEventsListen = zmq })
		return urls, nil
	}
	f, ok := fleet.(*sim.Fleet)
	if !ok {
		return nil, fmt.Errorf("%w: %s: KV events on this engine are not wired", ErrConfig, p.Name)
	}
	out := make([]string, len(urls))
	for i, u := range urls {
		_, port, err := net.SplitHostPort(f.Pod(i).KVEventsAddr())
		if err != nil {
			return nil, fmt.Errorf("scenario: pod %d publishes no KV events: %w", i, err)
		}
		out[i] = u + "#kv-events=" + port
	}
	return out, nil
}

// gossipAddrs returns a loopback gossip address for each of p's replicas
// when they gossip (Policy.Gossip), none otherwise.
func gossipAddrs(p Policy) ([]string, error) {
	if !p.Gossip {
		return nil, nil
	}
	addrs := make([]string, p.Replicas)
	for i := range addrs {
		a, err := proc.FreeLoopback()
		if err != nil {
			return nil, err
		}
		addrs[i] = a
	}
	return addrs, nil
}

// gossipReplica is p for its replica i of generation gen (a rolling
// update's replacements are generation 1): listening at addrs[i] and given
// every replica's address as its peers, as a static deployment lists them
// (p itself without gossip addresses).
func gossipReplica(p Policy, addrs []string, i, gen int) Policy {
	if len(addrs) == 0 {
		return p
	}
	return p.also(func(c *app.Config) {
		c.Peers, c.GossipListen, c.GossipName = addrs, addrs[i], fmt.Sprintf("%s-%d.%d", p.Name, i, gen)
	})
}

// also is p with f applied to its router's configuration after
// p.Configure.
func (p Policy) also(f func(*app.Config)) Policy {
	configure := p.Configure
	p.Configure = func(c *app.Config) {
		if configure != nil {
			configure(c)
		}
		f(c)
	}
	return p
}

// fannedOut is replica p listening for the pods' KV events at an address
// of its own, which sc.fanout passes them on to.
func (sc *Scenario) fannedOut(p Policy) (Policy, error) {
	addr, err := proc.FreeLoopback()
	if err != nil {
		return p, err
	}
	sc.fanout.Add(addr)
	return p.also(func(c *app.Config) { c.KVEventsListen = addr }), nil
}

// policyNamed returns the entry of Policies() called name.
func policyNamed(name string) (Policy, error) {
	ps, err := SelectPolicies([]string{name})
	if err != nil {
		return Policy{}, err
	}
	return ps[0], nil
}

// runReplicas runs lc through p.Replicas independent replicas of p over
// pods, each its own router and state over the fleet; in front of them a
// Service hands each a random share of the traffic, as kube-proxy in front
// of several router pods would (one replica: the same hop in front of it).
// Not a kvroute: it took a replica for one engine, read a pod's /metrics
// through it and held the traffic to one pod's batch (one replica: a third
// of the fleet's throughput on multi-turn).
func (sc *Scenario) runReplicas(ctx context.Context, lc load.Config, p Policy, pods []string, cfgs []sim.Config) (res *load.Result, seen routerState, err error) {
	gossip, err := gossipAddrs(p)
	if err != nil {
		return nil, seen, err
	}
	var replicas []*Router
	// replicas are the live ones at the end (a rolling update replaces
	// them), or those started before one failed to: close those.
	defer func() {
		for _, r := range replicas {
			err = errors.Join(err, r.Close())
		}
	}()
	var backends []string
	for i := 0; i < p.Replicas; i++ {
		rp := gossipReplica(p, gossip, i, 0)
		if sc.fanout != nil {
			if rp, err = sc.fannedOut(rp); err != nil {
				return nil, seen, err
			}
		}
		inner, err := StartRouter(rp, pods, sc.simEngines(cfgs))
		if err != nil {
			return nil, seen, err
		}
		replicas, backends = append(replicas, inner), append(backends, inner.URL)
	}
	if p.Rolling {
		res, err = runRolling(ctx, lc, p, pods, sc.simEngines(cfgs), replicas, gossip, &seen)
		return res, seen, err
	}
	svc, err := startService(backends)
	if err != nil {
		return nil, seen, err
	}
	defer svc.Close()
	defer seen.read(replicas)
	lc.BaseURL = svc.URL
	res, err = load.Run(ctx, lc)
	return res, seen, err
}
