package proxy

import (
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

// Through the proxy, on an engine that runs four requests at once: while a
// quiet tenant is active (its last request ended just now), a noisy
// tenant's backlog is not given the engine's last free place, and the
// quiet tenant's next request starts in it at once, before any noisy
// request has ended. Without the reserve, the backlog fills the engine and
// the quiet request starts only after a noisy one ends; with the quiet
// tenant gone (not active), the backlog takes every place.
func TestReserveKeepsAPlaceForTheQuietTenant(t *testing.T) {
	for _, tc := range []struct {
		name    string
		reserve int
		warm    bool // the quiet tenant sent a request just before the flood
		running int  // noisy requests that start at once, and before the quiet one
	}{
		{name: "reserve", reserve: 1, warm: true, running: 3},
		{name: "no reserve", reserve: 0, warm: true, running: 4},
		{name: "quiet tenant not active", reserve: 1, running: 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const hold = time.Second
			e := newShortQueueEngine(t, 4, hold)
			opt := Options{Limits: Limits{QueueTimeout: guard, MaxQueue: 100}, Tenants: TenantOptions{Reserve: tc.reserve}}
			h := startProxy(t, routing.NewLeastRequest(nil), opt, e.url)
			h.pool.Load().Endpoints[0].SetCosts(&discovery.Costs{BatchLimit: 4}) // learned: four at once
			if tc.warm {
				postAs(t, h.url, "quiet", "")
			}
			// The flood's requests one at a time, each at the engine or in
			// the queue before the next.
			const flood = 6
			var wg sync.WaitGroup
			warm := len(e.order())
			for i := range flood {
				wg.Add(1)
				go func() { defer wg.Done(); postAs(t, h.url, "noisy", "") }()
				for deadline := time.Now().Add(guard); len(e.order())-warm+h.srv.QueueStatus().Waiting <= i; time.Sleep(time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatalf("noisy request %d reached neither the engine nor the queue", i)
					}
				}
			}
			if n := len(e.order()) - warm; n != tc.running {
				t.Fatalf("%d noisy requests started, want %d", n, tc.running)
			}
			wg.Add(1)
			go func() { defer wg.Done(); postAs(t, h.url, "quiet", "") }()
			wg.Wait()
			// The first noisy requests hold their places for a second:
			// with the reserve the quiet request starts in the free place
			// at once, without it after a noisy request ended.
			order := e.order()[warm:]
			at := slices.Index(order, "Bearer quiet default")
			if tc.reserve > 0 && tc.warm && at != tc.running || at < tc.running {
				t.Fatalf("the quiet request started after %d noisy ones, want %d: %q", at, tc.running, order)
			}
		})
	}
}
