package routing

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/prefix"
)

// usableWait bounds the waits of these tests; a deadlock guard, not a speed
// assertion.
const usableWait = 10 * time.Second

// unusable are endpoints that no policy may pick, each made so by the
// mechanism that does it in production: a Fleet's active probes (down), a
// Fleet's passive ejection after failures the proxy reports (ejected), and
// a Publish that leaves it out (draining: a request that loaded the Set
// just before still sees it).
type unusable struct {
	down, ejected, draining *discovery.Endpoint
}

// healthServer answers /health with 200, or 503 when sick.
func healthServer(t *testing.T, sick bool) string {
	t.Helper()
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if sick {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	t.Cleanup(s.Close)
	return s.URL
}

// fleetEndpoints runs a discovery Fleet over nUp healthy pods, one pod
// whose /health fails and one pod the proxy reports failing, and returns
// the healthy endpoints and the unusable ones, once the failing pod is
// down and the failing-requests one ejected.
func fleetEndpoints(t *testing.T, nUp int) ([]*discovery.Endpoint, unusable) {
	t.Helper()
	var urls []string
	for range nUp + 1 { // the last healthy pod is the one to eject
		urls = append(urls, healthServer(t, false))
	}
	sickURL := healthServer(t, true)
	urls = append(urls, sickURL)
	f, err := discovery.New(discovery.Options{
		Health: discovery.HealthConfig{Interval: 5 * time.Millisecond, Timeout: usableWait, Jitter: 0.01,
			FailThreshold: 1, RiseThreshold: 1000},
		// A cooldown far beyond the test: the ejection cannot end under it.
		Passive: discovery.PassiveConfig{Failures: 2, Cooldown: time.Hour, MaxCooldown: time.Hour, MaxEjectedShare: 1},
		Scrape:  discovery.ScrapeConfig{Disabled: true},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := f.AddStatic(discovery.RoleMixed, urls); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(usableWait):
			t.Error("the Fleet did not stop")
		}
	})

	var u unusable
	var up []*discovery.Endpoint
	ejectURL := strings.TrimRight(urls[nUp], "/")
	for _, e := range f.Pool().Load().Endpoints {
		switch e.URL {
		case sickURL:
			u.down = e
		case ejectURL:
			u.ejected = e
		default:
			up = append(up, e)
		}
	}
	if len(up) != nUp || u.down == nil || u.ejected == nil {
		t.Fatalf("fleet endpoints: %d up, down %v, to eject %v", len(up), u.down, u.ejected)
	}
	u.ejected.ReportFailure()
	u.ejected.ReportFailure()
	deadline := time.Now().Add(usableWait)
	for u.down.State() != discovery.StateDown {
		if time.Now().After(deadline) {
			t.Fatalf("the pod failing its probes is %v, want down", u.down.State())
		}
		time.Sleep(time.Millisecond)
	}
	if u.ejected.State() != discovery.StateEjected {
		t.Fatalf("the pod reported failing is %v, want ejected", u.ejected.State())
	}

	// Draining: published, then left out of the next Set.
	var pool discovery.Pool
	d, err := discovery.NewEndpoint("http://127.0.0.1:1", discovery.RoleMixed)
	if err != nil {
		t.Fatal(err)
	}
	pool.Publish([]*discovery.Endpoint{d})
	pool.Publish(nil)
	if d.State() != discovery.StateDraining {
		t.Fatalf("the endpoint left out is %v, want draining", d.State())
	}
	u.draining = d
	for _, e := range up {
		if !e.Routable() {
			t.Fatalf("healthy %s is %v", e, e.State())
		}
	}
	return up, u
}

// setOf publishes eps, in this order, as one Set.
func setOf(eps ...*discovery.Endpoint) *discovery.Set {
	var pool discovery.Pool
	return pool.Publish(eps)
}

// usableRequests are the requests the policies are asked about: long
// prompts that recur (so the prefix policy has keys, homes and warm
// blocks), distinct ones, and a request without a prompt.
func usableRequests() []*Request {
	var out []*Request
	for i := range 24 {
		text := strings.Repeat(fmt.Sprintf("system prompt %d of the usable test. ", i%6), 200) + fmt.Sprint(" question ", i)
		var h prefix.Hasher
		h.Reset(testBlock, 1024, prefix.Seed("m", ""))
		_, _ = h.WriteString(text)
		out = append(out, &Request{Kind: KindCompletions, Model: "m", PromptBytes: len(text),
			PromptTokens: len(text) / 4, Hashes: h.Hashes})
	}
	return append(out, &Request{Kind: KindOther})
}

// TestPoliciesSkipUnusableEndpoints: every policy of the table never picks
// an endpoint that is down, ejected or draining (nor one the request was
// already sent to), even when the unusable endpoints are idle, the usable
// ones loaded, and the prefix policy believes the unusable ones hold the
// prompt; and it returns no endpoint when none is usable.
func TestPoliciesSkipUnusableEndpoints(t *testing.T) {
	up, u := fleetEndpoints(t, 3)
	bad := []*discovery.Endpoint{u.down, u.ejected, u.draining}
	isBad := func(e *discovery.Endpoint) bool {
		return e == u.down || e == u.ejected || e == u.draining
	}
	// The usable endpoints are busy, the unusable idle: a policy that
	// looked only at load would prefer them.
	for _, e := range up {
		release := occupy(e, 4, 10_000)
		t.Cleanup(release)
	}

	cases := []struct {
		name string
		set  *discovery.Set
		// tried are endpoints the requests were already sent to.
		tried []*discovery.Endpoint
		// none: no endpoint may be picked.
		none bool
	}{
		{name: "unusable first", set: setOf(u.down, u.ejected, u.draining, up[0], up[1], up[2])},
		{name: "unusable last", set: setOf(up[0], up[1], up[2], u.down, u.ejected, u.draining)},
		{name: "interleaved", set: setOf(u.down, up[0], u.ejected, up[1], u.draining, up[2])},
		{name: "down beside one usable", set: setOf(u.down, up[0])},
		{name: "ejected beside one usable", set: setOf(u.ejected, up[0])},
		{name: "draining beside one usable", set: setOf(u.draining, up[0])},
		{name: "only down", set: setOf(u.down), none: true},
		{name: "only ejected", set: setOf(u.ejected), none: true},
		{name: "only draining", set: setOf(u.draining), none: true},
		{name: "none usable", set: setOf(u.down, u.ejected, u.draining), none: true},
		{name: "usable ones already tried", set: setOf(u.down, up[0], u.ejected, up[1], u.draining),
			tried: []*discovery.Endpoint{up[0], up[1]}, none: true},
		{name: "one usable left untried", set: setOf(u.down, up[0], u.ejected, up[1], u.draining, up[2]),
			tried: []*discovery.Endpoint{up[0], up[2]}},
		{name: "empty set", set: setOf(), none: true},
	}

	table := Policies()
	for _, name := range PolicyNames(table) {
		for _, tc := range cases {
			t.Run(name+"/"+tc.name, func(t *testing.T) {
				pick := table[name](PolicyConfig{
					BlockBytes: testBlock,
					Index:      prefix.IndexConfig{BlocksPerEndpoint: 100_000},
					Prefix:     DefaultPrefixParams(),
				})
				if p, ok := pick.(*Prefix); ok {
					// The prefix policy believes the unusable endpoints
					// hold every prompt.
					for _, r := range usableRequests() {
						for _, e := range bad {
							p.Index().Record(e.ID, r.Hashes)
						}
					}
				}
				picked := map[*discovery.Endpoint]int{}
				for round := range 8 {
					for _, r := range usableRequests() {
						r.Tried = append(r.Tried, tc.tried...)
						d := pick.Pick(r, tc.set)
						e := d.Endpoint
						switch {
						case tc.none && e != nil:
							t.Fatalf("round %d: picked %s (%v) with no usable endpoint", round, e, e.State())
						case !tc.none && e == nil:
							t.Fatalf("round %d: no endpoint picked (reason %q), want a usable one", round, d.Reason)
						case e == nil:
							continue
						case isBad(e):
							t.Fatalf("round %d: picked %s, which is %v", round, e, e.State())
						case !Usable(r, e):
							t.Fatalf("round %d: picked %s, already tried", round, e)
						}
						picked[e]++
						if round%2 == 0 {
							// Some picks stay in flight, as the proxy's
							// leases would, so later picks see load move.
							l := e.Acquire(d.Prefill)
							t.Cleanup(l.Release)
						}
					}
				}
				for e, n := range picked {
					if !e.Routable() {
						t.Errorf("%d picks of %s (%v)", n, e, e.State())
					}
				}
			})
		}
	}
	// Nothing above changed the states the test relies on.
	if u.down.State() != discovery.StateDown || u.ejected.State() != discovery.StateEjected ||
		u.draining.State() != discovery.StateDraining {
		t.Fatalf("states changed: %v %v %v", u.down.State(), u.ejected.State(), u.draining.State())
	}
}
