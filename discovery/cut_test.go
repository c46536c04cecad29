package discovery

import (
	"fmt"
	"net/http"
	"sync/atomic"
	"testing"
	"time"
)

// An engine's first cut is a probe: no other is made there until a scrape
// (asked for at once) tells whether the engine stopped the cut request;
// one that went on with it — its running requests beyond the router's
// grew — takes no more cuts.
func TestCutsLearnWhetherTheEngineStops(t *testing.T) {
	for _, kept := range []bool{false, true} {
		t.Run(fmt.Sprintf("kept=%v", kept), func(t *testing.T) {
			var e *Endpoint
			var cut atomic.Bool
			p := startMetricsPod(t, nil)
			p.during = func(*http.Request) {
				n := e.InFlight()
				if cut.Load() && kept {
					n++ // the cut request goes on
				}
				p.text = fmt.Appendf(nil, "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} %d\nvllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0\n", n)
			}
			rec := scrapedOnDemand(t, p.URL, &e)
			if !e.TakesBack() {
				t.Fatal("an engine not cut yet must take cuts")
			}
			cut.Store(true)
			e.Cut()
			if e.TakesBack() {
				t.Fatal("a second cut before the probe settled")
			}
			rec.wait(t, 0, "scrape", e, 2)
			rec.until(t, "the probe settled", func() bool {
				e.cuts.mu.Lock()
				defer e.cuts.mu.Unlock()
				return e.cuts.due.IsZero()
			})
			if e.TakesBack() == kept {
				t.Errorf("takes cuts %v after the probe", e.TakesBack())
			}
		})
	}
	// A probe no scrape settles (the engine's metrics fail after the cut)
	// holds the engine's cuts back only for cutUnsettled.
	t.Run("unsettled", func(t *testing.T) {
		var e *Endpoint
		p := startMetricsPod(t, []byte("vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0\nvllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0\n"))
		rec := scrapedOnDemand(t, p.URL, &e)
		p.serve(http.StatusInternalServerError, nil)
		e.Cut()
		rec.wait(t, 0, "scrape-fail", e, 1)
		if e.TakesBack() {
			t.Fatal("a second cut while the probe waits for a scrape")
		}
		e.cuts.mu.Lock()
		settled := e.cuts.due.IsZero()
		e.cuts.due = time.Now().Add(-cutUnsettled - time.Millisecond) // as if it had waited that long
		e.cuts.mu.Unlock()
		if settled {
			t.Fatal("a failed scrape settled the probe")
		}
		if !e.TakesBack() {
			t.Error("a probe unsettled for cutUnsettled still holds cuts back")
		}
	})
}
