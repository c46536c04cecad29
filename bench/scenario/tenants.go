package scenario

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"sync"
	"time"

	"github.com/kvroute/kvroute/app"
	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/bench/workload"
)

// The tenant scenarios (issue #38) measure an overloaded fleet shared by
// callers: quiet tenants at a modest rate beside a noisy one far beyond
// the fleet's capacity (noisy neighbour), or interactive traffic beside a
// flex batch flood under the same key (priority). Each measures, on a
// fresh fleet and router per phase:
//
//  1. the fleet's capacity: a closed loop of twice its batch slots
//     through kvroute — requests and output tokens per second at
//     saturation;
//  2. the quiet traffic alone, at rates set from that capacity;
//  3. the quiet traffic on its own fleet and router while the flood (4×
//     capacity) runs on a second, identical one (phaseApart): the floor
//     the machine sets;
//  4. the quiet traffic beside the flood (4× capacity), with kvroute's
//     fair queue, with it fully work-conserving (--tenant-reserve 0) and
//     with its queue in arrival order (--queue-fifo, the anchor), in the
//     same run; noisy-neighbour also once with a budget (--tenant-budgets)
//     that caps the noisy tenant at half the fleet's sequences.
//
// Rates come from the measured capacity, so that "4× capacity" holds on
// every engine, real or simulated, without assuming its speed.

// Tenant scenario names.
const (
	NoisyNeighbour = "noisy-neighbour"
	// NoisyNeighbour429 is noisy-neighbour on engines with a short
	// waiting queue that answer 429 beyond it (llm-d's simulator with
	// --max-waiting-queue-length).
	NoisyNeighbour429 = "noisy-neighbour-429"
	PriorityFlood     = "priority"
)

// TenantScenarioNames lists the tenant scenarios.
func TenantScenarioNames() []string {
	return []string{NoisyNeighbour, NoisyNeighbour429, PriorityFlood}
}

// IsTenantScenario reports whether name is a tenant scenario.
func IsTenantScenario(name string) bool {
	for _, n := range TenantScenarioNames() {
		if n == name {
			return true
		}
	}
	return false
}

// The policies a tenant scenario compares: kvroute's fair queue (default
// flags: the reserve keeps places), the same with preemption, without
// either (fully work-conserving), with its queue in arrival order, and
// with the flood capped by a budget.
const (
	TenantFair      = "prefix"
	TenantPreempt   = "prefix-preempt"
	TenantFIFO      = "prefix-fifo"
	TenantBudget    = "prefix-budget"
	TenantNoReserve = "prefix-no-reserve"
)

// queueName is a tenant policy's queue in the report.
func queueName(policy string) string {
	return map[string]string{TenantFair: "fair", TenantPreempt: "fair, preemption", TenantFIFO: "fifo",
		TenantBudget: "fair, flood capped", TenantNoReserve: "fair, no reserve or preemption"}[policy]
}

// tenantShape is the traffic of one tenant scenario.
type tenantShape struct {
	quiet []tenantLoad // measured alone, then beside the flood
	flood tenantLoad
	// maxWaiting > 0 gives llm-d pods that waiting-queue bound.
	maxWaiting int
	// capFlood: a phase with the flood's tenant capped by a budget.
	capFlood bool
}

// tenantLoad is one tenant's traffic: its key, tier, prompts and rate as
// a share of the fleet's capacity (requests per second).
type tenantLoad struct {
	Name  string  `json:"name"`
	Key   string  `json:"-"`
	Tier  string  `json:"tier,omitempty"`
	Share float64 `json:"share_of_capacity"`
	Seed  uint64  `json:"-"`
}

func tenantShapeOf(name string) (tenantShape, error) {
	quiet := []tenantLoad{{Name: "quiet-a", Key: "key-quiet-a", Share: 0.15, Seed: 11}, {Name: "quiet-b", Key: "key-quiet-b", Share: 0.15, Seed: 12}}
	switch name {
	case NoisyNeighbour:
		return tenantShape{quiet: quiet, flood: tenantLoad{Name: "noisy", Key: "key-noisy", Share: 4, Seed: 13}, capFlood: true}, nil
	case NoisyNeighbour429:
		return tenantShape{quiet: quiet, flood: tenantLoad{Name: "noisy", Key: "key-noisy", Share: 4, Seed: 13}, maxWaiting: 2}, nil
	case PriorityFlood:
		return tenantShape{quiet: []tenantLoad{{Name: "interactive", Key: "key-team", Share: 0.3, Seed: 21}},
			flood: tenantLoad{Name: "batch", Key: "key-team", Tier: "flex", Share: 4, Seed: 22}}, nil
	}
	return tenantShape{}, fmt.Errorf("%w: unknown tenant scenario %q", ErrConfig, name)
}

// TenantReport is a tenant scenario's outcome.
type TenantReport struct {
	Scenario string    `json:"scenario"`
	Engine   string    `json:"engine"`
	Pods     int       `json:"pods"`
	Seqs     int       `json:"seqs_per_pod"`
	Machine  Machine   `json:"machine"`
	Started  time.Time `json:"started"`
	// Capacity is the closed loop at twice the fleet's batch slots, and
	// CapacityThroughput its output tokens per second within the phase.
	Capacity           TenantRun     `json:"capacity"`
	CapacityThroughput float64       `json:"capacity_output_throughput"`
	Phases             []TenantPhase `json:"phases"`
	// PhaseSeconds is each open-loop phase's sending time (wall);
	// OutputSpread TenantOptions'.
	PhaseSeconds float64 `json:"phase_s"`
	OutputSpread int     `json:"output_spread,omitempty"`
	WallSeconds  float64 `json:"wall_s"`
}

// TenantPhase is one phase: the tenants' runs side by side behind one
// router.
type TenantPhase struct {
	Name   string      `json:"name"`
	Policy string      `json:"policy"`
	Runs   []TenantRun `json:"runs"`
	// OutputThroughput is every tenant's answered output tokens per
	// second over the phase's sending time.
	OutputThroughput float64 `json:"output_throughput"`
}

// TenantRun is one tenant's run in a phase.
type TenantRun struct {
	Tenant tenantLoad   `json:"tenant"`
	Rate   float64      `json:"rate"`
	Sum    load.Summary `json:"summary"`
	// SettledP90 is the TTFT p90 (ms) of the answered requests sent after
	// the phase's first settle seconds (the router learns the engines'
	// batch limits in its first overload).
	SettledP90 float64 `json:"settled_ttft_p90_ms"`
	// Rejected counts answers 429, RetryAfter those with a Retry-After,
	// Other every other failure.
	Rejected   int `json:"rejected_429"`
	RetryAfter int `json:"retry_after"`
	Other      int `json:"other_failures"`
}

// settle is the start of a phase left out of the settled figures.
const settle = 10 * time.Second

// tenantPods and tenantSeqs shape the fleet: four pods of four sequences
// each, so that the flood's 4× stays a few dozen requests a second on
// two cores.
const (
	tenantPods = 4
	tenantSeqs = 4
)

// tenantWorkload is one tenant's prompts: its own system prompts (by
// seed), 4 groups × 16 questions, 64 tokens out.
func tenantWorkload(seed uint64) workload.Config {
	return workload.Config{Kind: workload.KindSharedPrefix, Seed: seed, Groups: 4, PromptsPerGroup: 16,
		SystemTokens: 384, QuestionTokens: 64, OutputTokens: tenantOutput}
}

// tenantOutput is the tenant scenarios' output length (tokens).
const tenantOutput = 64

// TenantOptions shape a tenant scenario's run.
type TenantOptions struct {
	// Phase is each phase's sending time (wall).
	Phase time.Duration
	// OutputSpread, when positive, draws each request's output length
	// uniformly within 64 ± OutputSpread tokens (seeded per tenant), so
	// that sequences started together do not all end together; 0: every
	// request 64.
	OutputSpread int
	// Reserve, when not negative, is the fair-queue phases' --tenant-reserve
	// (-1: kvroute's default).
	Reserve int
	// Seqs is each simulated pod's batch (max-num-seqs; 0: 4). llama.cpp
	// keeps its own four slots.
	Seqs int
}

// RunTenants runs tenant scenario name on engine and returns its report.
func RunTenants(ctx context.Context, name, engine string, to TenantOptions, opt RunOptions) (*TenantReport, error) {
	phase := to.Phase
	shape, err := tenantShapeOf(name)
	if err != nil {
		return nil, err
	}
	if shape.maxWaiting > 0 && engine != EngineLLMD {
		return nil, fmt.Errorf("%w: %s runs on %s (a waiting-queue bound)", ErrConfig, name, EngineLLMD)
	}
	seqs := tenantSeqs
	if to.Seqs > 0 && engine != EngineLlamaCpp {
		seqs = to.Seqs
	}
	sc := Scenario{Name: name, Pods: tenantPods, Engine: engine, Seed: 1,
		Sim: sim.Config{Seed: 1, TimeScale: 1, MaxNumSeqs: seqs}, Workload: tenantWorkload(1),
		llmdMaxWaiting: shape.maxWaiting}
	sc.describeFleet()
	rep := &TenantReport{Scenario: name, Engine: sc.engineName(), Pods: sc.Pods, Seqs: seqs, Machine: ThisMachine(), Started: time.Now(),
		PhaseSeconds: phase.Seconds(), OutputSpread: to.OutputSpread}
	defer func() { rep.WallSeconds = time.Since(rep.Started).Seconds() }()
	logf := func(format string, a ...any) {
		if opt.Log != nil {
			fmt.Fprintf(opt.Log, format+"\n", a...)
		}
	}
	slots := tenantPods * seqs
	capRun := tenantLoad{Name: "capacity", Key: "key-capacity", Seed: 31}
	logf("%s on %s: capacity (closed loop of %d)", name, sc.engineName(), 2*slots)
	runs, tput, err := runTenantPhase(ctx, &sc, phaseSpec{policy: TenantFair, ts: []tenantLoad{capRun}, closed: 2 * slots}, to, opt)
	if err != nil {
		return rep, err
	}
	rep.Capacity, rep.CapacityThroughput = runs[0], tput
	capacity := rep.Capacity.Sum.RequestThroughput
	if !(capacity > 0) {
		return rep, fmt.Errorf("scenario %s: the capacity run answered nothing (%+v)", name, rep.Capacity.Sum.Errors)
	}
	logf("  capacity %.2f req/s, %.0f output tokens/s", capacity, tput)
	phases := []struct {
		name, policy string
		flood        bool
	}{{"alone", TenantFair, false}, {phaseApart, TenantFair, true}, {"flood", TenantFair, true}, {"flood", TenantPreempt, true}, {"flood", TenantNoReserve, true}, {"flood", TenantFIFO, true}}
	var budgets string
	if shape.capFlood {
		phases = append(phases, struct {
			name, policy string
			flood        bool
		}{"flood", TenantBudget, true})
		budgets, err = floodBudget(shape.flood.Key, slots/2)
		if err != nil {
			return rep, err
		}
		defer os.Remove(budgets)
	}
	for _, ph := range phases {
		ts := shape.quiet
		if ph.flood {
			ts = append(append([]tenantLoad(nil), ts...), shape.flood)
		}
		logf("%s on %s: %s, %s", name, sc.engineName(), ph.name, ph.policy)
		runs, tput, err := runTenantPhase(ctx, &sc, phaseSpec{policy: ph.policy, ts: ts, capacity: capacity, budgets: budgets,
			apart: ph.name == phaseApart}, to, opt)
		if err != nil {
			return rep, err
		}
		rep.Phases = append(rep.Phases, TenantPhase{Name: ph.name, Policy: ph.policy, Runs: runs, OutputThroughput: tput})
	}
	return rep, nil
}

// phaseApart is the phase whose flood runs on a fleet and router of its
// own, beside the quiet tenants' (an identical fleet and router, which the
// flood never reaches) on the same machine: the floor of what the machine
// itself lets the quiet tenants have under a flood. On the simulators it
// is their alone, give or take the load generator; on real engines that
// share the machine's cores it is what the flood's compute leaves the
// quiet tenants' engines, whatever a router does.
const phaseApart = "flood apart"

// phaseSpec is one phase: the router's policy, the tenants of ts each an
// open loop at share × capacity, or with closed > 0 one closed loop of
// that many; budgets is the budgets file of policy TenantBudget; apart
// sends ts's last tenant (the flood) to a fleet and router of its own.
type phaseSpec struct {
	policy   string
	ts       []tenantLoad
	capacity float64
	closed   int
	budgets  string
	apart    bool
}

// runTenantPhase starts a fleet and a router of ps.policy, runs every
// tenant of ps at once behind it for to.Phase, and returns their runs and
// the phase's output throughput.
func runTenantPhase(ctx context.Context, sc *Scenario, ps phaseSpec, to TenantOptions, opt RunOptions) (_ []TenantRun, tput float64, err error) {
	policy, ts, capacity, closed, phase := ps.policy, ps.ts, ps.capacity, ps.closed, to.Phase
	fleets := 1
	if ps.apart {
		fleets = 2
	}
	urls, pods := make([]string, fleets), make([][]string, fleets)
	for i := range fleets {
		fleet, rt, err := startBehind(ctx, sc, ps, to, opt)
		if err != nil {
			return nil, 0, err
		}
		defer func() { err = errors.Join(err, rt.Close(), fleet.Close()) }()
		urls[i], pods[i] = rt.URL, fleet.URLs()
	}
	out := make([]TenantRun, len(ts))
	results := make([]*load.Result, len(ts))
	errs := make([]error, len(ts))
	var wg sync.WaitGroup
	for i, t := range ts {
		wl, err := tenantWorkload(t.Seed).Build()
		if err != nil {
			return nil, 0, err
		}
		if d := to.OutputSpread; d > 0 {
			r := rand.New(rand.NewPCG(t.Seed, 64))
			for i := range wl.Sessions {
				for k := range wl.Sessions[i].Turns {
					wl.Sessions[i].Turns[k].OutputTokens = max(1, tenantOutput-d+r.IntN(2*d+1))
				}
			}
		}
		ld := load.Load{Rate: load.Rate(t.Share * capacity), Duration: phase}
		if closed > 0 {
			ld = load.Load{Arrival: load.ArrivalClosed, Concurrency: closed, Duration: phase}
		}
		out[i] = TenantRun{Tenant: t, Rate: float64(ld.Rate)}
		f := 0
		if ps.apart && i == len(ts)-1 {
			f = 1
		}
		lc := load.Config{BaseURL: urls[f], PodURLs: pods[f], NoEngineMetrics: true, Model: sc.Fleet.Model,
			Workload: wl, Load: ld, Seed: sc.Seed + t.Seed, Label: policy + "/" + t.Name, APIKey: t.Key, ServiceTier: t.Tier,
			Timeout: 2 * time.Minute}
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = load.Run(ctx, lc)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, 0, err
	}
	var tokens float64
	for i, res := range results {
		out[i].Sum = res.Summary
		var settled []float64
		for _, r := range res.Requests {
			if r.Err == "" && r.Start >= settle.Seconds() {
				settled = append(settled, r.TTFT) // NewDist reports ms
			}
		}
		out[i].SettledP90 = load.NewDist(settled).P90
		for _, r := range res.Requests {
			switch {
			case r.Err == "":
				if r.Start+r.E2EL <= phase.Seconds() { // within the phase: what the fleet delivered then
					tokens += float64(r.OutputTokens)
				}
			case r.Status == 429:
				out[i].Rejected++
				if r.RetryAfter {
					out[i].RetryAfter++
				}
			default:
				out[i].Other++
			}
		}
	}
	return out, tokens / phase.Seconds(), nil
}

// startBehind starts a fleet of sc's pods and a router of ps.policy in
// front of it.
func startBehind(ctx context.Context, sc *Scenario, ps phaseSpec, to TenantOptions, opt RunOptions) (engineFleet, *Router, error) {
	policy, budgets := ps.policy, ps.budgets
	cfgs, err := sc.PodConfigs()
	if err != nil {
		return nil, nil, err
	}
	fleet, err := startFleet(ctx, sc, cfgs, opt.LLMDBinary)
	if err != nil {
		return nil, nil, err
	}
	p := Policy{Name: policy, Router: "prefix", Configure: func(c *app.Config) {
		if to.Reserve >= 0 {
			c.Tenants.Reserve = to.Reserve // the fair phases' reserve
		}
		switch policy {
		case TenantFIFO:
			c.Tenants.FIFO = true
		case TenantPreempt:
			c.Tenants.Preempt = true
		case TenantNoReserve:
			c.Tenants.Reserve, c.Tenants.Preempt = 0, false
		case TenantBudget:
			c.BudgetsFile = budgets
		}
	}}
	rt, err := StartRouter(p, fleet.URLs(), sc.simEngines(cfgs))
	if err != nil {
		return nil, nil, errors.Join(err, fleet.Close())
	}
	return fleet, rt, nil
}

// WriteTenantReport writes rep as Markdown tables: the capacity, then
// each phase's tenants with their TTFT against their own alone, and the
// fleet's throughput against its capacity.
func WriteTenantReport(w io.Writer, rep *TenantReport) {
	fmt.Fprintf(w, "## %s on %s (%d pods × %d sequences)\n\n", rep.Scenario, rep.Engine, rep.Pods, rep.Seqs)
	if rep.OutputSpread > 0 {
		fmt.Fprintf(w, "Output lengths drawn uniformly within %d ± %d tokens.\n\n", tenantOutput, rep.OutputSpread)
	}
	c := rep.Capacity.Sum
	fmt.Fprintf(w, "Capacity (closed loop of %d, %.0f s): %.2f req/s, %.0f output tokens/s, TTFT p90 %.0f ms.\n\n",
		2*rep.Pods*rep.Seqs, rep.PhaseSeconds, c.RequestThroughput, rep.CapacityThroughput, c.TTFT.P90)
	alone := map[string]load.Summary{}
	for _, ph := range rep.Phases {
		if ph.Name == "alone" {
			for _, r := range ph.Runs {
				alone[r.Tenant.Name] = r.Sum
			}
		}
	}
	fmt.Fprintln(w, "| phase | queue | tenant | tier | rate req/s | sent | answered | 429 (Retry-After) | other failures | TTFT p50 ms | TTFT p90 ms | p90 ÷ alone | after 10 s: p90 ms, ÷ alone |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	for _, ph := range rep.Phases {
		queue := queueName(ph.Policy)
		for _, r := range ph.Runs {
			ratio, settled := "—", "—" // nothing sent after the settling time
			if r.SettledP90 > 0 {
				settled = fmt.Sprintf("%.0f", r.SettledP90)
			}
			if a, ok := alone[r.Tenant.Name]; ok && ph.Name != "alone" && a.TTFT.P90 > 0 {
				ratio = fmt.Sprintf("%.2f×", r.Sum.TTFT.P90/a.TTFT.P90)
				if r.SettledP90 > 0 {
					settled += fmt.Sprintf(", %.2f×", r.SettledP90/a.TTFT.P90)
				}
			}
			tier := r.Tenant.Tier
			if tier == "" {
				tier = "default"
			}
			fmt.Fprintf(w, "| %s | %s | %s | %s | %.2f | %d | %d | %d (%d) | %d | %.0f | %.0f | %s | %s |\n", ph.Name, queue, r.Tenant.Name, tier,
				r.Rate, r.Sum.Requests, r.Sum.Completed, r.Rejected, r.RetryAfter, r.Other, r.Sum.TTFT.P50, r.Sum.TTFT.P90, ratio, settled)
		}
	}
	fmt.Fprintln(w)
	for _, ph := range rep.Phases {
		if ph.Name == "alone" {
			continue
		}
		queue := queueName(ph.Policy)
		ratio := math.NaN()
		if rep.CapacityThroughput > 0 {
			ratio = ph.OutputThroughput / rep.CapacityThroughput
		}
		if ph.Name == phaseApart {
			fmt.Fprintf(w, "Output of the two fleets, the flood apart: %.0f tokens/s, %.2f× one fleet's capacity run.\n", ph.OutputThroughput, ratio)
			continue
		}
		fmt.Fprintf(w, "Fleet output under the flood, %s queue: %.0f tokens/s, %.2f× the capacity run's.\n", queue, ph.OutputThroughput, ratio)
	}
	fmt.Fprintln(w)
}

// floodBudget writes a budgets file that caps the tenant of API key at
// maxConc requests at once, and returns its path.
func floodBudget(key string, maxConc int) (string, error) {
	f, err := os.CreateTemp("", "kvtenants-budgets-*.json")
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256([]byte(key))
	_, err = fmt.Fprintf(f, `{"tenants": {"flood": {"key_sha256": %q, "max_concurrency": %d}}}`, hex.EncodeToString(sum[:]), maxConc)
	return f.Name(), errors.Join(err, f.Close())
}
