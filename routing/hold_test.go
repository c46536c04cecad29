package routing

import (
	"testing"
	"time"

	"github.com/kvroute/kvroute/discovery"
)

// On a slot engine, a request whose prompt's copies are all busy with this
// router's requests is held (Decision.Hold) until one ends, where a turn
// there is shorter than the prompt's cold prefill and a slot is free; a
// second copy, once made, lets the next one go; a paged engine, a held
// request, a turn longer than the prefill, an engine of unknown or all
// busy slots and a cold prompt are never held.
func TestHoldForBusyCopy(t *testing.T) {
	p := newTestPrefix(DefaultPrefixParams())
	set := testSet(t, 1)
	e := set.Endpoints[0]
	e.SetDialect(discovery.DialectLlamaCpp)
	// About 4,000 tokens at 10,000 a second: 0.4 s cold; a turn 20 ms.
	costs := &discovery.Costs{PrefillTokensPerSec: 10_000, PendingTokensPerSec: 10_000, DecodeSec: 0.02, BatchLimit: 4}
	e.SetCosts(costs)
	prompt := system(3, 16*testBlock)
	start := func(q string) (Decision, discovery.Lease) {
		d := p.Pick(request(prompt+q), set)
		if d.Hold != nil {
			return d, discovery.Lease{}
		}
		l := e.Acquire(d.Prefill)
		l.ForPrompt(d.PrefixKey)
		return d, l
	}
	d1, l1 := start("first")
	if d1.Hold != nil || d1.PrefixKey == 0 {
		t.Fatalf("a cold prompt: hold %v, key %x; want no hold, a key", d1.Hold != nil, d1.PrefixKey)
	}
	d2, _ := start("second")
	if d2.Hold == nil {
		t.Fatal("its only copy busy: not held")
	}
	if want := 400*time.Millisecond + 20*time.Millisecond; d2.HoldFor < want-5*time.Millisecond || d2.HoldFor > want+50*time.Millisecond {
		t.Errorf("held for at most %v, want about %v (the cold prefill and a turn)", d2.HoldFor, want)
	}
	l1.Release()
	select {
	case <-d2.Hold:
	default:
		t.Fatal("the hold did not end with the busy request")
	}

	// Held once, the request goes: a second copy is made, and then a
	// third request finds one free.
	_, l1 = start("first again")
	r := request(prompt + "second")
	r.Held = true
	d2 = p.Pick(r, set)
	if d2.Hold != nil {
		t.Fatal("a request held once was held again")
	}
	l2 := e.Acquire(d2.Prefill)
	l2.ForPrompt(d2.PrefixKey)
	l1.Release()
	if d3, l3 := start("third"); d3.Hold != nil {
		t.Error("one copy of two busy: held")
	} else {
		l3.Release()
	}
	if running, copies, _ := e.PromptRuns(d2.PrefixKey); running != 1 || copies != 2 {
		t.Errorf("running %d, copies %d; want 1, 2", running, copies)
	}
	_, l3 := start("third again")
	if d4, _ := start("fourth"); d4.Hold == nil {
		t.Error("both copies busy: not held")
	}

	// Not held: with every slot busy the engine queues the request and
	// gives it the first slot that frees (the prompt's, when its request
	// ends first); slots unknown.
	release := occupy(e, 2, 0)
	d, l := start("all slots busy")
	if d.Hold != nil {
		t.Error("held with every slot busy")
	}
	l.Release()
	release()
	e.SetCosts(&discovery.Costs{PrefillTokensPerSec: 10_000, PendingTokensPerSec: 10_000, DecodeSec: 0.02})
	d, l = start("slots unknown")
	if d.Hold != nil {
		t.Error("held with the slots unknown")
	}
	l.Release()
	e.SetCosts(costs)

	// Not held: a paged cache shares a running prompt; a turn longer than
	// the cold prefill is not worth waiting for.
	e.SetDialect(discovery.DialectVLLM)
	d, l = start("paged")
	if d.Hold != nil {
		t.Error("held on a paged engine")
	}
	l.Release()
	e.SetDialect(discovery.DialectOllama)
	e.SetCosts(&discovery.Costs{PrefillTokensPerSec: 10_000, PendingTokensPerSec: 10_000, DecodeSec: 0.5, BatchLimit: 4})
	d, l = start("long turns")
	if d.Hold != nil {
		t.Error("held for a turn longer than the cold prefill")
	}
	l.Release()
	l2.Release()
	l3.Release()
	if running, _, ended := e.PromptRuns(d2.PrefixKey); running != 0 || ended != nil {
		t.Errorf("after every release: running %d, ended %v", running, ended)
	}
}
