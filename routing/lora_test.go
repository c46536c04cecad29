package routing

import (
	"testing"
	"time"

	"github.com/kvroute/kvroute/discovery"
)

// An adapter's request avoids an engine that runs as many other adapters
// as it may at once (vLLM's --max-loras, scraped from
// vllm:lora_requests_info; here the adapters of other clients' requests,
// as the scrape shows them): it would wait there for a slot however free
// the batch. An engine running the adapter, or with a free slot, costs
// nothing more; nor does any engine for the base model, and without the
// model list only an adapter the engine shows waiting is taken for one.
func TestLoRASlots(t *testing.T) {
	set := testSet(t, 3)
	base := "m"
	slots := []*discovery.LoRAStats{
		{MaxLoRAs: 1, Running: []string{"a"}},
		{MaxLoRAs: 1, Running: []string{"b"}},
		{MaxLoRAs: 2, Running: []string{"a"}},
	}
	for i, e := range set.Endpoints {
		e.SetModels([]discovery.Model{{ID: base}, {ID: "a", Parent: &base}, {ID: "b", Parent: &base}, {ID: "c", Parent: &base}})
		e.SetEngine(&discovery.EngineStats{Engine: "vllm", Running: 1, At: time.Now().Add(time.Hour), LoRA: slots[i]})
	}
	p := newTestPrefix(DefaultPrefixParams())
	ask := func(model string, id int) (Decision, []Term) {
		r := request(system(id, 4*testBlock))
		r.Model = model
		d, terms := p.Explain(r, set)
		p.Pick(r, set)
		return d, terms
	}
	waits := func(terms []Term) (w [3]bool) {
		for i, tm := range terms {
			w[i] = tm.LoRASlotWaitSec > 0
			if w[i] && tm.Idle {
				t.Errorf("%s waits for a LoRA slot but takes spills", tm.Endpoint)
			}
		}
		return w
	}
	for i := range 8 {
		d, terms := ask("b", 100+i)
		if d.Endpoint == set.Endpoints[0] || waits(terms) != [3]bool{true, false, false} {
			t.Fatalf("adapter b went to %s; slot waits %v, want only the engine full with a", d.Endpoint, waits(terms))
		}
		if d, terms = ask("c", 200+i); d.Endpoint != set.Endpoints[2] || waits(terms) != [3]bool{true, true, false} {
			t.Fatalf("adapter c went to %s; slot waits %v, want the engine with a free slot", d.Endpoint, waits(terms))
		}
		if _, terms = ask(base, 300+i); waits(terms) != [3]bool{} {
			t.Fatalf("the base model waits for a LoRA slot: %v", waits(terms))
		}
	}

	// Without the model list, an adapter is known by the engine's queue.
	unknown := testSet(t, 1)
	e := unknown.Endpoints[0]
	e.SetEngine(&discovery.EngineStats{Engine: "vllm", Running: 1, At: time.Now().Add(time.Hour),
		LoRA: &discovery.LoRAStats{MaxLoRAs: 1, Running: []string{"a"}, Waiting: []string{"c"}}})
	for model, want := range map[string]bool{"c": true, "d": false} {
		r := request(system(400, 4*testBlock))
		r.Model = model
		if _, terms := p.Explain(r, unknown); (terms[0].LoRASlotWaitSec > 0) != want {
			t.Errorf("model %s, list unknown: slot wait %v, want %v", model, terms[0].LoRASlotWaitSec, want)
		}
	}
}

// Where the engine runs only this router's requests, the adapters holding
// its slots are those of the router's own requests in flight, which are
// current where the scrape is up to an interval old.
func TestLoRASlotsOwnRequests(t *testing.T) {
	set := testSet(t, 1)
	e := set.Endpoints[0]
	base := "m"
	e.SetModels([]discovery.Model{{ID: base}, {ID: "a", Parent: &base}, {ID: "b", Parent: &base}})
	// The scrape saw the router's request for a running; it has finished.
	e.SetEngine(&discovery.EngineStats{Engine: "vllm", Running: 1, Routed: 1, At: time.Now().Add(time.Hour),
		LoRA: &discovery.LoRAStats{MaxLoRAs: 1, Running: []string{"a"}}})
	p := newTestPrefix(DefaultPrefixParams())
	slotWait := func(model string) bool {
		r := request(system(500, 4*testBlock))
		r.Model = model
		_, terms := p.Explain(r, set)
		return terms[0].LoRASlotWaitSec > 0
	}
	if slotWait("b") {
		t.Fatal("b waits for a slot that a finished request held")
	}
	lease := e.Acquire(0)
	lease.ForAdapter("a")
	if !slotWait("b") || slotWait("a") {
		t.Fatal("with a request for a in flight, b must wait and a not")
	}
	lease.Release()
	if slotWait("b") || len(e.AdaptersInFlight(nil)) != 0 {
		t.Fatal("the released request still holds the slot")
	}
}
