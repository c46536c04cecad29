package scenario

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/kvroute/kvroute/app"
	"github.com/kvroute/kvroute/bench/peers"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/kvevents"
	"github.com/kvroute/kvroute/routing"
)

// The policies under comparison and the in-process kvroute the scenarios
// run behind: the router main builds (app.New with
// app.DefaultConfig), with the peers' policies added to its table and a
// policy's own settings (Policy.Configure) applied.

// Policy is a routing policy under comparison.
type Policy struct {
	Name string
	// About says what the policy stands for in the comparison.
	About string
	// Router is the policy's name in the router's table (Name if empty).
	Router string
	// Replicas > 0 runs that many independent routers with this policy
	// behind the scenario's own Service (rollout.go's service: each
	// request to a random replica, as kube-proxy picks), with no shared
	// state but, with Gossip, what they gossip; one is the replicas'
	// anchor, behind the same hop.
	Replicas int
	// Gossip: the replicas gossip their placements to each other
	// (--peers, on loopback ports of their own).
	Gossip bool
	// Rolling replaces the replicas one at a time during the run
	// (rollout.go).
	Rolling bool
	// Configure, if set, adjusts the router's configuration for this
	// policy after the benchmark's defaults (e.g. a peer's own engine
	// metrics refresh).
	Configure func(*app.Config)
	// Direct runs no router: the client sends each prefix group straight
	// to one pod, group g to pod g mod n (load.Config.Direct), the
	// finite-cache reference.
	Direct bool
	// PrefillShare > 0 lays the fleet out disaggregated: that share of
	// the pods (rounded, at least one, and one decode pod left) serve
	// prefill, the rest decode (PDLayouts).
	PrefillShare float64
	// Events: the policy's router subscribes to the pods' KV-cache events
	// (engine truth): kvroute's prefix policy through its own
	// --kv-events flags, a peer whose picker is a kvevents.Sink (the
	// precise llm-d scorer) through a subscriber StartRouter runs beside
	// the router. runPolicy turns the pods' publishers on for it.
	Events bool
}

// router returns the name of p in the router's policy table.
func (p Policy) router() string {
	if p.Router != "" {
		return p.Router
	}
	return p.Name
}

// Baseline is the policy results are compared against: round-robin is what
// a Kubernetes ClusterIP Service does.
const Baseline = "round-robin"

// Policies returns the policies a scenario compares, baseline first. A new
// policy is one more entry here and, for a peer, one more in policyTable.
func Policies() []Policy {
	return []Policy{
		{Name: Baseline, About: "what a ClusterIP Service does"},
		{Name: "random", About: "uniform random pick"},
		{Name: "least-request", About: "fewer in-flight of two random pods"},
		{Name: "prefix", About: "kvroute: prefix-aware, sticky until saturated"},
		{Name: "prefix-3-replicas", About: "three independent kvroute replicas (prefix), a random third of the traffic each",
			Router: "prefix", Replicas: 3},
		{Name: "sglang-cache-aware", About: "SGLang router cache_aware (emulated)"},
		{Name: "gie-blend", About: "GIE classic scorer blend, engine metrics every 50 ms (emulated)",
			Configure: func(c *app.Config) { c.ScrapeInterval = gieMetricsInterval }},
		{Name: "llm-d-token-load", About: "llm-d token-load: prefix-cache-affinity filter, token-load scorer (emulated)"},
	}
}

// PrefixNormalized is the prefix policy with --normalize-prompts, which
// the near-identical scenario compares with the prefix policy.
const PrefixNormalized = "prefix-normalize-prompts"

// optInPolicies are the policies that run only where a scenario or the
// caller names them, beside Policies() and PDLayouts().
func optInPolicies() []Policy {
	return []Policy{{Name: PrefixNormalized, Router: "prefix",
		About:     "kvroute's prefix policy with --normalize-prompts",
		Configure: func(c *app.Config) { c.NormalizePrompts = true }},
		{Name: FixedAffinity, Direct: true,
			About: "no router: the client sends prefix group g (else session g) straight to pod g mod n"},
		{Name: PrefixEvents, Router: "prefix", Events: true,
			About: "kvroute's prefix policy fed by the engines' KV events"},
		{Name: PrefixEventsGPUOnly, Router: "prefix", Events: true,
			About:     "kvroute's prefix policy fed by the engines' KV events, CPU and storage tiers ignored (--kv-events-tiers=false)",
			Configure: func(c *app.Config) { c.KVEventsTiers = false }},
		{Name: PrefixEvents + "-3-replicas", Router: "prefix", Events: true, Replicas: 3,
			About: "three independent kvroute replicas (prefix fed by KV events), a random third of the traffic each"},
		{Name: PrefixGossip, Router: "prefix", Replicas: 3, Gossip: true,
			About: "three kvroute replicas (prefix) gossiping their placements (--peers), a random third of the traffic each"},
		{Name: PrefixGossip + "-no-load", Router: "prefix", Replicas: 3, Gossip: true,
			About:     "three kvroute replicas (prefix) gossiping their placements but not their requests in flight, a random third of the traffic each",
			Configure: func(c *app.Config) { c.GossipNoLoad = true }},
		{Name: PrefixOneReplica, Router: "prefix", Replicas: 1,
			About: "one kvroute (prefix) behind the replicas' Service: their anchor, with the same hop"},
		{Name: PrefixEvents + "-1-replica", Router: "prefix", Events: true, Replicas: 1,
			About: "one kvroute (prefix fed by KV events) behind the replicas' Service: the events replicas' anchor, with the same hop"},
		{Name: PrefixGossip + "-rolling", Router: "prefix", Replicas: 3, Gossip: true, Rolling: true,
			About: "three kvroute replicas (prefix) gossiping, a random third of the traffic each, replaced one at a time during the run (a rolling update)"},
		{Name: "prefix-2-replicas-gossip", Router: "prefix", Replicas: 2, Gossip: true,
			About: "two kvroute replicas (prefix) gossiping their placements (--peers), a random half of the traffic each"},
		{Name: "prefix-8-replicas-gossip", Router: "prefix", Replicas: 8, Gossip: true,
			About: "eight kvroute replicas (prefix) gossiping their placements (--peers), a random eighth of the traffic each"},
		{Name: PrefixEvents + "-2-replicas-gossip", Router: "prefix", Events: true, Replicas: 2, Gossip: true,
			About: "two kvroute replicas (prefix fed by KV events) gossiping their placements (--peers), a random half of the traffic each"},
		{Name: PrefixEvents + "-3-replicas-gossip", Router: "prefix", Events: true, Replicas: 3, Gossip: true,
			About: "three kvroute replicas (prefix fed by KV events) gossiping their placements (--peers), a random third of the traffic each"},
		{Name: PrefixEvents + "-8-replicas-gossip", Router: "prefix", Events: true, Replicas: 8, Gossip: true,
			About: "eight kvroute replicas (prefix fed by KV events) gossiping their placements (--peers), a random eighth of the traffic each"},
		{Name: LLMDPrecise, Events: true,
			About: "llm-d precise prefix-cache scoring: prefix 2, KV 1, queue 1, max score, fed by KV events, tokenizing every request (emulated)"},
	}
}

// OptInPolicies returns the policies that run only where a scenario or the
// caller names them (kvbench --policies).
func OptInPolicies() []Policy { return optInPolicies() }

// PrefixOneReplica is one router of the prefix policy behind the Service
// the replicas have, the anchor they are compared with.
const PrefixOneReplica = "prefix-1-replica"

// PrefixGossip is three replicas of the prefix policy that gossip their
// placements (Policy.Gossip).
const PrefixGossip = "prefix-3-replicas-gossip"

// The opt-in policies fed by the engines' KV events (Policy.Events).
const (
	PrefixEvents        = "prefix-events"
	PrefixEventsGPUOnly = "prefix-events-gpu-only"
	LLMDPrecise         = "llm-d-precise"
)

// FixedAffinity is the client that routes straight to the pods with
// balanced, fixed affinity, the reference for a finite cache (the pressure
// scenarios compare against it).
const FixedAffinity = "fixed-affinity"

// gieMetricsInterval is GIE's engine metrics refresh
// (--refresh-metrics-interval, default 50 ms, in
// kubernetes-sigs/gateway-api-inference-extension pkg/epp/server/options.go):
// its queue and KV scorers read engine metrics that fresh, where kvroute
// scrapes every second. Discovery withdraws values older than three
// intervals (150 ms).
const gieMetricsInterval = 50 * time.Millisecond

// policyTable is kvroute's table of policies (routing.Policies) with the
// peers' emulations added. engines are the pods' configurations (nil: not
// simulated), for the peers that their guides ask to calibrate per
// deployment.
func policyTable(engines []sim.Config) map[string]routing.NewPolicy {
	t := routing.Policies()
	t["sglang-cache-aware"] = func(routing.PolicyConfig) routing.Picker { return peers.NewCacheAware() }
	t["gie-blend"] = func(c routing.PolicyConfig) routing.Picker { return peers.NewBlend(c.BlockBytes, policySeed) }
	t["llm-d-token-load"] = func(c routing.PolicyConfig) routing.Picker {
		p := peers.NewTokenLoad(c.BlockBytes, c.Index.BlocksPerEndpoint, policySeed)
		if peak := peakPrefill(engines); peak > 0 {
			p.PeakPrefill = peak
		}
		return p
	}
	t[LLMDPrecise] = func(routing.PolicyConfig) routing.Picker { return peers.NewPrecise(policySeed) }
	return t
}

// peakPrefill calibrates llm-d's peak prefill throughput for the pods as
// its guide asks of every deployment: the tokens of one unloaded chunk of
// max_num_batched_tokens over the time it takes, in wall time (the router
// measures wall time), averaged over the pods; 0 without pods.
func peakPrefill(engines []sim.Config) float64 {
	var sum float64
	for _, c := range engines {
		if err := c.Validate(); err != nil {
			return 0
		}
		n := c.MaxNumBatchedTokens
		sum += float64(n) / (c.StepCost(n, n).Seconds() / c.TimeScale)
	}
	if len(engines) == 0 {
		return 0
	}
	return sum / float64(len(engines))
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

// SelectPolicies returns the policies named in names, from Policies(),
// PDLayouts() and the opt-in ones (PrefixNormalized), in that order; no
// names means every policy of Policies().
func SelectPolicies(names []string) ([]Policy, error) {
	all := Policies()
	if len(names) == 0 {
		return all, nil
	}
	all = append(append(all, PDLayouts()...), optInPolicies()...)
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

// routerConfig is the configuration StartRouter builds the router for p
// from.
func routerConfig(p Policy, backends []string, engines []sim.Config) app.Config {
	cfg := app.DefaultConfig()
	cfg.Backends, cfg.Policy, cfg.Policies = backends, p.router(), policyTable(engines)
	if n := p.prefillPods(len(backends)); n > 0 {
		cfg.Backends, cfg.PrefillBackends, cfg.DecodeBackends = nil, backends[:n], backends[n:]
	}
	cfg.Intn = seededIntn(policySeed)
	cfg.AccessLog = false
	cfg.Prefix, _ = PrefixParams() // checked by kvbench at start-up
	if p.Configure != nil {
		p.Configure(&cfg)
	}
	return cfg
}

// routerLog returns the benchmark router's logger: none, or with
// KVBENCH_ACCESS_LOG set to a directory, every line of its log and its
// access log (each request's endpoint, reason, home, matched blocks,
// prefix key, prompt and cached tokens) as JSON in a file of its own
// there, named for the policy and the start time, for diagnosing
// decisions. The file stays open until the process exits (Router.Close).
func routerLog(cfg *app.Config, policy string) (*zap.Logger, error) {
	dir := os.Getenv("KVBENCH_ACCESS_LOG")
	if dir == "" {
		return zap.NewNop(), nil
	}
	f, err := os.Create(filepath.Join(dir, fmt.Sprintf("%s-%d.log", policy, time.Now().UnixNano())))
	if err != nil {
		return nil, fmt.Errorf("KVBENCH_ACCESS_LOG: %w", err)
	}
	w := zapcore.Lock(f) // one writer for both logs: whole lines, never interleaved
	cfg.AccessLog, cfg.AccessLogSample, cfg.AccessLogTo = true, 1, w
	core := zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), w, zap.InfoLevel)
	return zap.New(core), nil
}

// routerShutdownGrace is how long a benchmark router's in-flight streams
// may finish when it closes.
const routerShutdownGrace = 10 * time.Second

// Router is an in-process kvroute on a loopback listener.
type Router struct {
	// URL is the router's base URL (http://127.0.0.1:port).
	URL  string
	rt   *app.Router
	stop context.CancelFunc
	done chan error
	// subDone closes when the KV-event subscriber feeding a peer's picker
	// (Policy.Events) has stopped; nil without one. peerBatches counts the
	// batches it handed the picker.
	subDone     chan struct{}
	peerBatches atomic.Int64
}

// countingSink counts the KV-event batches handed to a sink.
type countingSink struct {
	kvevents.Sink
	n *atomic.Int64
}

func (c countingSink) KVBatch(e *discovery.Endpoint, b *kvevents.Batch) {
	c.n.Add(1)
	c.Sink.KVBatch(e, b)
}

// StartRouter starts kvroute on 127.0.0.1:0 in front of backends with the
// policy p: the router main builds with its default flags (discovery with
// health probes and engine scraping, the prefix index sized by the
// engines' scraped KV capacity), without an access log or an admin
// listener, its randomised policies seeded, then adjusted by
// p.Configure. engines are the simulated pods' configurations (nil when
// the backends are not simulated pods), for the peers calibrated per
// deployment. Stop it with Close.
//
// With p.Events the backends may name their publishers
// ("#kv-events=PORT") and p.Configure may set the router's KV-event flags:
// kvroute's prefix policy subscribes itself; for another policy those are
// taken off the router's configuration (kvroute feeds only its prefix
// index) and, when its picker is a kvevents.Sink, a subscriber of the
// same settings feeds it until Close.
func StartRouter(p Policy, backends []string, engines []sim.Config) (*Router, error) {
	cfg := routerConfig(p, backends, engines)
	lg, err := routerLog(&cfg, p.Name)
	if err != nil {
		return nil, err
	}
	events := kvevents.Config{Port: cfg.KVEventsPort, ReplayPort: cfg.KVEventsReplayPort, Listen: cfg.KVEventsListen}
	var named []string // backends naming their publishers, when taken off cfg
	if p.Events && p.router() != "prefix" {
		cfg.KVEventsPort, cfg.KVEventsReplayPort, cfg.KVEventsListen = 0, 0, ""
		for i, b := range cfg.Backends {
			if u, _, ok := strings.Cut(b, "#"); ok {
				if named == nil {
					named = slices.Clone(cfg.Backends)
					cfg.Backends = slices.Clone(cfg.Backends)
				}
				cfg.Backends[i] = u
			}
		}
	}
	rt, err := app.New(cfg, lg)
	if err != nil {
		return nil, err
	}
	r := &Router{rt: rt, done: make(chan error, 1)}
	var sub *kvevents.Subscriber
	if sink, ok := rt.Picker.(kvevents.Sink); ok && p.Events && rt.Prefix == nil {
		pool := rt.Pool
		if named != nil {
			// The router's endpoints do not name their publishers: the
			// subscriber follows the same endpoints (the same IDs, from
			// the URLs) as configured.
			if pool, err = staticPool(named); err != nil {
				return nil, err
			}
		}
		sub = kvevents.NewSubscriber(events, pool, countingSink{sink, &r.peerBatches}, lg.Named("kvevents"))
	} else if p.Events && rt.Prefix == nil {
		return nil, fmt.Errorf("%w: policy %s takes no KV events", ErrConfig, p.Name)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	ctx, stop := context.WithCancel(context.Background())
	r.URL, r.stop = "http://"+ln.Addr().String(), stop
	if sub != nil {
		r.subDone = make(chan struct{})
		go func() {
			defer close(r.subDone)
			if err := sub.Run(ctx); err != nil {
				lg.Error("KV-event subscriber", zap.Error(err))
			}
		}()
	}
	go func() { r.done <- rt.Run(ctx, ln, nil, routerShutdownGrace) }()
	return r, nil
}

// staticPool returns a pool of the endpoints of urls (role mixed).
func staticPool(urls []string) (*discovery.Pool, error) {
	eps := make([]*discovery.Endpoint, len(urls))
	for i, u := range urls {
		e, err := discovery.NewEndpoint(u, discovery.RoleMixed)
		if err != nil {
			return nil, err
		}
		eps[i] = e
	}
	pool := &discovery.Pool{}
	pool.Publish(eps)
	return pool, nil
}

// Learned is what a router learned of one pod (discovery.Costs) and,
// under the prefix policy, how many prompts its engine keeps warm (0:
// not learned; routing.Prefix.Kept).
type Learned struct {
	Endpoint string           `json:"endpoint"`
	Costs    *discovery.Costs `json:"costs"`
	Kept     int              `json:"kept_prompts,omitempty"`
}

// Learned returns what the router has learned of each pod so far.
func (r *Router) Learned() []Learned {
	var out []Learned
	for _, e := range r.rt.Pool.Load().Endpoints {
		if c := e.Costs(); c != nil {
			l := Learned{Endpoint: e.URL, Costs: c}
			if r.rt.Prefix != nil {
				l.Kept = r.rt.Prefix.Kept(e.ID)
			}
			out = append(out, l)
		}
	}
	return out
}

// describeLearned summarises learned costs for a log line: the range over
// the pods of each constant.
func describeLearned(ls []Learned) string {
	lo, hi := *ls[0].Costs, *ls[0].Costs
	for _, l := range ls[1:] {
		c := l.Costs
		lo.PrefillTokensPerSec, hi.PrefillTokensPerSec = min(lo.PrefillTokensPerSec, c.PrefillTokensPerSec), max(hi.PrefillTokensPerSec, c.PrefillTokensPerSec)
		lo.DecodeStepSec, hi.DecodeStepSec = min(lo.DecodeStepSec, c.DecodeStepSec), max(hi.DecodeStepSec, c.DecodeStepSec)
		lo.BatchLimit, hi.BatchLimit = min(lo.BatchLimit, c.BatchLimit), max(hi.BatchLimit, c.BatchLimit)
		lo.FixedSec, hi.FixedSec = min(lo.FixedSec, c.FixedSec), max(hi.FixedSec, c.FixedSec)
	}
	return fmt.Sprintf("on %d pods: prefill %.0f–%.0f tokens/s, fixed %.0f–%.0f ms, decode step %.1f–%.1f ms, batch limit %d–%d",
		len(ls), lo.PrefillTokensPerSec, hi.PrefillTokensPerSec, 1000*lo.FixedSec, 1000*hi.FixedSec,
		1000*lo.DecodeStepSec, 1000*hi.DecodeStepSec, lo.BatchLimit, hi.BatchLimit)
}

// NearMisses returns the router's kvroute_prompt_near_misses_total (all
// models).
func (r *Router) NearMisses() int {
	return int(sumBy(r.gather(), "kvroute_prompt_near_misses_total", "")[""])
}

// gather returns the router's metric families (nil if gathering failed).
func (r *Router) gather() []*dto.MetricFamily {
	mfs, _ := r.rt.Registry.Gather()
	return mfs
}

// sumBy returns the series of the counter or gauge called name in mfs,
// summed by the value of label ("" sums them all under "").
func sumBy(mfs []*dto.MetricFamily, name, label string) map[string]float64 {
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			k := ""
			for _, lp := range m.GetLabel() {
				if lp.GetName() == label {
					k = lp.GetValue()
				}
			}
			out[k] += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return out
}

// Index returns what the router's decisions and prefix index looked like at
// the end of a run, for the log: decisions by reason, the estimates of
// cached tokens against the engines' reports, the index's entries and
// evictions; "" for a policy that decides by none of the prefix policy's
// reasons.
func (r *Router) Index() string {
	mfs := r.gather()
	count := func(name, label string, keys ...string) string {
		m := sumBy(mfs, name, label)
		var parts []string
		for _, k := range keys {
			if v := m[k]; v > 0 {
				parts = append(parts, fmt.Sprintf("%s %.0f", k, v))
			}
		}
		return strings.Join(parts, ", ")
	}
	decisions := count("kvroute_routing_decisions_total", "reason", routing.ReasonWarm, routing.ReasonSpill, routing.ReasonCold)
	if decisions == "" {
		return "" // not the prefix policy
	}
	s := fmt.Sprintf("decisions %s; estimates %s; index %.0f entries, %.0f evictions", decisions,
		count("kvroute_prefix_estimates_total", "outcome", "exact", "over", "under"),
		sumBy(mfs, "kvroute_prefix_index_entries", "")[""], sumBy(mfs, "kvroute_prefix_index_evictions_total", "")[""])
	if sent := sumBy(mfs, "kvroute_peer_bytes_total", "direction"); len(sent) > 0 {
		s += fmt.Sprintf("; gossip sent %.0f messages, %.0f bytes; placements %s; states %.0f (%.0f claims, %.0f homes)",
			sumBy(mfs, "kvroute_peer_messages_total", "direction")["sent"], sent["sent"],
			count("kvroute_peer_placements_total", "outcome", "merged", "unknown_endpoint", "mismatched", "dropped", "malformed"),
			sumBy(mfs, "kvroute_peer_states_total", "")[""], sumBy(mfs, "kvroute_peer_state_claims_total", "")[""],
			sumBy(mfs, "kvroute_peer_state_homes_total", "")[""])
	}
	return s
}

// Close drains the router (in-flight streams get 10 s) and waits for it
// and its KV-event subscriber.
func (r *Router) Close() error {
	r.stop()
	err := <-r.done
	if r.subDone != nil {
		<-r.subDone
	}
	// The access log's file stays open (the process's exit closes it):
	// closed here, a replaced replica's last lines, written after Close
	// returned, were lost ("file already closed" in rolling updates).
	return err
}

// KVEventBatches returns the KV-event batches the router's policy was fed:
// kvroute_kv_event_batches_total of its own subscriber, or those handed
// to a peer's picker (0 without events).
func (r *Router) KVEventBatches() int {
	return int(sumBy(r.gather(), "kvroute_kv_event_batches_total", "")[""]) + int(r.peerBatches.Load())
}
