package app

import (
	"bufio"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/discovery"
)

// startRouter runs the router main builds (New with cfg) on
// 127.0.0.1:0 until the test ends and returns it with its base URL.
func startRouter(t *testing.T, cfg Config) (*Router, string) {
	t.Helper()
	rt, err := New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rt.Run(ctx, ln, nil, 5*time.Second) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("router: %v", err)
			}
		case <-time.After(30 * time.Second): // above Run's 5 s drain: a deadlock guard
			t.Error("the router did not stop")
		}
	})
	return rt, "http://" + ln.Addr().String()
}

// words is a vocabulary for prompts that share nothing.
var words = strings.Fields("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike " +
	"november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu")

// streamPrompts sends n streamed completions of random, unshared prompts of
// 100 to 4,000 words through url, conc at a time, reading each to its end.
func streamPrompts(t *testing.T, url, model string, n, conc int) {
	t.Helper()
	rng := rand.New(rand.NewPCG(7, uint64(n)))
	bodies := make(chan string, n)
	for i := range n {
		var b strings.Builder
		fmt.Fprintf(&b, "request %d:", i)
		for range 100 + rng.IntN(3900) {
			b.WriteString(" " + words[rng.IntN(len(words))])
		}
		bodies <- fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2,"stream":true,"stream_options":{"include_usage":true}}`, model, b.String())
	}
	close(bodies)
	var wg sync.WaitGroup
	for range conc {
		wg.Go(func() {
			for body := range bodies {
				resp, err := testClient.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
				if err != nil {
					t.Error(err)
					return
				}
				sc := bufio.NewScanner(resp.Body)
				for sc.Scan() {
				}
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					t.Errorf("status %d", resp.StatusCode)
					return
				}
			}
		})
	}
	wg.Wait()
}

// Within 300 requests of a cold start, the router learns each engine's
// prefill rate to within 25% from its own streams' times to first byte:
// on the h100-8b and slow-large (70B, 2.2k tokens/s) profiles. The
// simulators run faster than real time and the router sees wall time, so
// the truth is the configured rate × the time scale: 40k and 22k tokens/s,
// from priors of 20k (the default) and 5k, off by 2× and 4.4× (the unit
// tests of discovery/costs_test.go take priors off by 10× and 3×). At
// 20× speed the slow-large prefills were short enough against a loaded
// 2-core machine's scheduling noise (fixed times of 70–130 ms under -race)
// that one CI run learned 28% off; at 10× they are twice as long.
func TestRouterLearnsEachEnginesPrefillRate(t *testing.T) {
	profile := func(name string, timeScale float64) sim.Config {
		p, err := sim.LookupProfile(name)
		if err != nil {
			t.Fatal(err)
		}
		c := p.Configs(1, sim.Config{TimeScale: timeScale})[0]
		if err := c.Validate(); err != nil {
			t.Fatal(err)
		}
		return c
	}
	for _, tc := range []struct {
		name  string
		cfg   sim.Config
		prior float64
	}{
		{name: "h100-8b at 2× speed", cfg: profile("h100-8b", 2)},
		{name: "slow-large at 10× speed", cfg: profile("slow-large", 10), prior: 5000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			fleet := startSimFleet(t, 1, tc.cfg)
			cfg := DefaultConfig()
			cfg.Backends, cfg.AccessLog = fleet.URLs(), false
			if tc.prior > 0 {
				cfg.Prefix.PrefillTokensPerSec = tc.prior
			}
			rt, url := startRouter(t, cfg)
			streamPrompts(t, url, tc.cfg.Model, 300, 4)
			ep := rt.Pool.Load().Endpoints[0]
			var got *discovery.Costs
			// Every completed stream is observed (DecodeSamples); those sent
			// past a learned batch limit stay out of the prefill fit.
			for deadline := time.Now().Add(5 * time.Second); got == nil || got.DecodeSamples < 300; {
				if time.Now().After(deadline) {
					t.Fatalf("costs %+v after 300 streams", got)
				}
				got = ep.Costs()
				time.Sleep(10 * time.Millisecond) // the last streams' first bytes are recorded asynchronously
			}
			truth := tc.cfg.PrefillTokensPerSec * tc.cfg.TimeScale
			rel := math.Abs(got.PrefillTokensPerSec-truth) / truth
			t.Logf("learned %.0f tokens/s (truth %.0f, off by %.0f%%), fixed %.1f ms, %d samples",
				got.PrefillTokensPerSec, truth, 100*rel, 1000*got.FixedSec, got.TTFTSamples)
			if rel > 0.25 {
				t.Errorf("learned prefill rate %.0f tokens/s, truth %.0f", got.PrefillTokensPerSec, truth)
			}
		})
	}
}
