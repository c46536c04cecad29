package scenario

import (
	"testing"
	"time"

	"github.com/kvroute/kvroute/app"
	"github.com/kvroute/kvroute/bench/sim"
)

// Every policy of the comparison builds into a router main would accept,
// with the benchmark's defaults but for the peers' own settings: gie-blend
// refreshes engine metrics every 50 ms, as GIE does.
func TestPolicyRouters(t *testing.T) {
	for _, p := range Policies() {
		t.Run(p.Name, func(t *testing.T) {
			cfg := routerConfig(p, []string{"http://127.0.0.1:9"}, nil)
			want := app.DefaultConfig().ScrapeInterval
			if p.Name == "gie-blend" {
				want = 50 * time.Millisecond
			}
			if cfg.ScrapeInterval != want || cfg.Policy != p.router() {
				t.Fatalf("policy %q, scrape interval %v; want %q, %v", cfg.Policy, cfg.ScrapeInterval, p.router(), want)
			}
			if _, err := app.New(cfg, nil); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// llm-d's peak prefill throughput is calibrated per deployment, one
// unloaded chunk of max_num_batched_tokens: ≈ 19,000 tokens/s for the
// H100 pods in real time, twice that at time scale 2, and the mean of a
// mixed fleet.
func TestPeakPrefillCalibration(t *testing.T) {
	h100 := sim.DefaultConfig()
	fast := h100
	fast.TimeScale = 2
	a100, err := sim.LookupProfile("a100-8b")
	if err != nil {
		t.Fatal(err)
	}
	slowPod := a100.Configs(1, sim.Config{})[0]
	for _, tc := range []struct {
		name    string
		engines []sim.Config
		lo, hi  float64
	}{
		{name: "h100", engines: []sim.Config{h100}, lo: 18500, hi: 19500},
		{name: "h100 at 2x", engines: []sim.Config{fast}, lo: 37000, hi: 39000},
		{name: "none", engines: nil, lo: 0, hi: 0},
		{name: "mixed", engines: []sim.Config{h100, slowPod}, lo: 5000, hi: 18500},
	} {
		if got := peakPrefill(tc.engines); got < tc.lo || got > tc.hi {
			t.Errorf("%s: %.0f tokens/s, want in [%.0f, %.0f]", tc.name, got, tc.lo, tc.hi)
		}
	}
}
