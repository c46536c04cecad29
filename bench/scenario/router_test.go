package scenario

import (
	"testing"
	"time"

	"github.com/kvroute/kvroute/proxy"
)

// Every policy of the comparison builds into a router main would accept,
// with the benchmark's defaults but for the peers' own settings: gie-blend
// refreshes engine metrics every 50 ms, as GIE does.
func TestPolicyRouters(t *testing.T) {
	for _, p := range Policies() {
		t.Run(p.Name, func(t *testing.T) {
			cfg := routerConfig(p, []string{"http://127.0.0.1:9"})
			want := proxy.DefaultConfig().ScrapeInterval
			if p.Name == "gie-blend" {
				want = 50 * time.Millisecond
			}
			if cfg.ScrapeInterval != want || cfg.Policy != p.router() {
				t.Fatalf("policy %q, scrape interval %v; want %q, %v", cfg.Policy, cfg.ScrapeInterval, p.router(), want)
			}
			if _, err := proxy.NewRouter(cfg, nil); err != nil {
				t.Fatal(err)
			}
		})
	}
}
