package routing

import (
	"testing"

	"github.com/kvroute/kvroute/discovery"
)

// slowEngine is what calibration learns of a large model on small GPUs:
// 1,000 prefill tokens/s, 30 ms decode steps, 4 sequences at a time, each
// generating for 3 s.
var slowEngine = discovery.Costs{PrefillTokensPerSec: 1000, PendingTokensPerSec: 1500, FixedSec: 0.05, DecodeStepSec: 0.03,
	DecodeSec: 3, PrefillTokens: 1500, BatchLimit: 4, TTFTSamples: 300, DecodeSamples: 300, StepSamples: 30, LimitSamples: 5}

// Learned costs replace the priors, except where pinned.
func TestLearnedRatesReplacePriors(t *testing.T) {
	p := DefaultPrefixParams()
	r := p.ratesOf(&slowEngine, p.pins())
	want := rates{prefill: 1000, pending: 1500, load: 1000 * discovery.LoadSpeedup, decode: 0.03, queue: 1.5, slot: 0.75, limit: 4, turnover: 3}
	if r != want {
		t.Errorf("learned: %+v, want %+v", r, want)
	}
	if r := p.ratesOf(nil, p.pins()); r.prefill != p.PrefillTokensPerSec || r.decode != p.DecodeCostSec || r.limit != 0 {
		t.Errorf("nothing learned yet: %+v", r)
	}
	p.BatchLimit = 16
	p.Pinned = []string{PinPrefillRate, PinDecodeCost, PinQueueCost, PinBatchLimit}
	if err := p.Validate(); err != nil {
		t.Fatal(err)
	}
	r = p.ratesOf(&slowEngine, p.pins())
	if r.prefill != p.PrefillTokensPerSec || r.decode != p.DecodeCostSec || r.queue != p.QueueCostSec || r.limit != 16 {
		t.Errorf("pinned: %+v", r)
	}
	p.Pinned = []string{"magic"}
	if p.Validate() == nil {
		t.Error("an unknown pinned name was accepted")
	}
}

// learnedSet is a set of n endpoints that calibration has measured as c.
func learnedSet(t *testing.T, n int, c discovery.Costs) *discovery.Set {
	set := testSet(t, n)
	for _, e := range set.Endpoints {
		cc := c
		e.SetCosts(&cc)
	}
	return set
}

// On an engine that runs few sequences at once, a warm endpoint past its
// batch limit makes requests wait for a place; they spill to an endpoint
// with a free one, although the prior constants (20k tokens/s, no limit)
// would have kept them waiting. With the limit pinned high, the same load
// is no reason to leave.
func TestBatchLimitMakesTheWarmEndpointSpill(t *testing.T) {
	pinned := DefaultPrefixParams()
	pinned.BatchLimit, pinned.Pinned = 256, []string{PinBatchLimit}
	for _, tc := range []struct {
		name   string
		params PrefixParams
		want   string
	}{
		{name: "learned limit of 4", params: DefaultPrefixParams(), want: ReasonSpill},
		{name: "limit pinned at 256", params: pinned, want: ReasonWarm},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := learnedSet(t, 3, slowEngine)
			p := newTestPrefix(tc.params)
			sys := system(60, 8192)
			warm := p.Pick(request(sys+"a"), set).Endpoint
			defer occupy(warm, 10, 0)() // 10 running or waiting
			d := p.Pick(request(sys+"b"), set)
			if d.Reason != tc.want || (d.Endpoint == warm) != (tc.want == ReasonWarm) {
				t.Fatalf("%+v, want %s", d, tc.want)
			}
		})
	}
}

// homeOf returns the home the policy would give r's key, without counting
// r as seen.
func homeOf(t *testing.T, p *Prefix, r *Request, set *discovery.Set) string {
	t.Helper()
	_, terms := p.Explain(r, set)
	for _, tm := range terms {
		if tm.Home {
			return tm.Endpoint
		}
	}
	t.Fatal("no home")
	return ""
}

// A prompt that shares nothing with earlier ones goes home while its home
// has room, and where it starts soonest while its home is busy: nothing
// cached is at stake.
func TestColdPromptsAvoidABusyHome(t *testing.T) {
	set := learnedSet(t, 4, slowEngine)
	p := newTestPrefix(DefaultPrefixParams())
	r := request(system(70, 8192) + "q")
	busy := homeOf(t, p, r, set)
	var other *Request
	for i := 0; other == nil; i++ {
		if o := request(system(80+i, 8192) + "q"); homeOf(t, p, o, set) != busy {
			other = o
		}
	}
	for _, e := range set.Endpoints {
		if e.URL == busy {
			defer occupy(e, 10, 3000)()
		}
	}
	if d := p.Pick(r, set); d.Endpoint == nil || d.Endpoint.URL == busy || d.Reason != ReasonCold {
		t.Errorf("a new prompt queued on its busy home: %+v", d)
	}
	if d := p.Pick(other, set); d.Endpoint == nil || !d.Home || d.Reason != ReasonCold {
		t.Errorf("a new prompt left an idle home: %+v", d)
	}
}

// An endpoint measured twice as fast (twice the prefill rate, half the
// decode step and decode time) takes about twice the requests when both
// are needed: prompts that share nothing, held in flight, spread until
// their waits are about equal (a new prompt stays home while its home's
// wait is within the spill rule of the best: 1.25× + 50 ms, so the slow
// endpoint keeps somewhat more than a third).
func TestFasterEndpointTakesMoreLoad(t *testing.T) {
	set := testSet(t, 2)
	slow, fast := slowEngine, slowEngine
	slow.BatchLimit, fast.BatchLimit = 64, 64
	fast.PrefillTokensPerSec *= 2
	fast.PendingTokensPerSec *= 2
	fast.DecodeStepSec /= 2
	fast.DecodeSec /= 2
	set.Endpoints[0].SetCosts(&slow)
	set.Endpoints[1].SetCosts(&fast)
	p := newTestPrefix(DefaultPrefixParams())
	var held []discovery.Lease
	defer func() {
		for i := range held {
			held[i].Release()
		}
	}()
	for i := range 60 {
		_, l := dispatch(p, request(system(1000+i, 4096)), set)
		held = append(held, l)
	}
	ns, nf := set.Endpoints[0].InFlight(), set.Endpoints[1].InFlight()
	if ratio := float64(nf) / float64(ns); ratio < 1.5 || ratio > 2.5 {
		t.Errorf("fast endpoint holds %d, slow %d (%.2f×), want about 2×", nf, ns, ratio)
	}
}

// The engine's view adds only what this router's own counters cannot see:
// requests beyond those the router had in flight there at the scrape
// (other replicas', clients bypassing kvroute). A scrape taken while the
// router's own requests ran does not keep the endpoint looking busy after
// they finished.
func TestEngineViewAddsOnlyOtherClients(t *testing.T) {
	p := DefaultPrefixParams()
	r := p.ratesOf(&slowEngine, p.pins()) // 4 at a time, 0.75 s a place
	own := load{inFlight: 1}
	base, _, _ := p.wait(own, r, 1000, 0)
	// The scrape saw 3 running and 2 waiting, all of them this router's.
	mine := own
	mine.eng = &discovery.EngineStats{Running: 3, Waiting: 2, Routed: 5}
	if w, _, _ := p.wait(mine, r, 1000, 0); w != base {
		t.Errorf("the router's own requests, since finished, counted again: wait %.3f, want %.3f", w, base)
	}
	// The same scrape with 5 of them other clients': they run (3 decode
	// costs), fill the batch (2 places to wait for) and queue (2 queue costs).
	theirs := own
	theirs.eng = &discovery.EngineStats{Running: 3, Waiting: 2, Routed: 0}
	want := base + 5*r.decode + 3*r.slot + 2*r.queue
	if w, _, idle := p.wait(theirs, r, 1000, 0); w < want-1e-9 || w > want+1e-9 || idle {
		t.Errorf("other clients' requests: wait %.3f (idle %v), want %.3f and not idle", w, idle, want)
	}
}

// The gossiping replicas' requests in flight count like the router's
// own, with a scrape or without one (Ollama has none), in the wait and in
// the routers' own view (the spill test's): the engine's count of them is
// not counted twice.
func TestWaitCountsPeerLoad(t *testing.T) {
	p := DefaultPrefixParams()
	r := p.ratesOf(&slowEngine, p.pins()) // 4 at a time, 0.75 s a place
	base, _, _ := p.wait(load{inFlight: 1}, r, 1000, 0)
	want := base + 4*r.decode + 2*r.slot // five in flight: two places to wait for
	peers := load{inFlight: 1, peer: 4}
	if w, own, idle := p.wait(peers, r, 1000, 0); w < want-1e-9 || w > want+1e-9 || own < want-1e-9 || own > want+1e-9 || idle {
		t.Errorf("no scrape: wait %.3f own %.3f idle %v, want %.3f both, not idle (the batch is full)", w, own, idle, want)
	}
	// The scrape saw the router's one and the peers' four: nobody else's.
	peers.eng = &discovery.EngineStats{Running: 4, Waiting: 1, Routed: 1, Peers: 4}
	if w, _, _ := p.wait(peers, r, 1000, 0); w < want-1e-9 || w > want+1e-9 {
		t.Errorf("with a scrape: wait %.3f, want %.3f", w, want)
	}
}
