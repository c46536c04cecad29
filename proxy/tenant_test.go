package proxy

import (
	"fmt"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/metrics"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"
)

// A tenant is a hash of its API key (or of the tenant header's value),
// never the key; no key is the default tenant; labels are bounded.
func TestTenantOfAndLabels(t *testing.T) {
	s := New(Options{Tenants: TenantOptions{MetricTenants: 3}})
	h := func(kv ...string) *fasthttp.RequestHeader {
		var hd fasthttp.RequestHeader
		for i := 0; i < len(kv); i += 2 {
			hd.Set(kv[i], kv[i+1])
		}
		return &hd
	}
	a, b := s.tenantOf(h("Authorization", "Bearer sk-one")), s.tenantOf(h("Authorization", "bearer sk-two"))
	if a == 0 || b == 0 || a == b {
		t.Fatalf("tenants %x and %x", a, b)
	}
	if s.tenantOf(h("Authorization", "Bearer sk-one")) != a {
		t.Fatal("the same key is another tenant")
	}
	if s.tenantOf(h()) != 0 || s.tenantOf(h("Authorization", "Basic xyz")) != 0 {
		t.Fatal("a request without a bearer key is not the default tenant")
	}
	if l := s.tenantLabel(a); strings.Contains(l, "sk-one") || !strings.HasPrefix(l, "t-") || len(l) != 14 {
		t.Fatalf("label %q", l)
	}
	for i := range 5 {
		s.tenantLabel(s.tenantOf(h("Authorization", fmt.Sprintf("Bearer k%d", i))))
	}
	if l := s.tenantLabel(s.tenantOf(h("Authorization", "Bearer late"))); l != "other" {
		t.Fatalf("the 8th tenant is labelled %q, want other", l)
	}
	if s.tenantLabel(0) != "default" {
		t.Fatal("the default tenant's label")
	}
	byHeader := New(Options{Tenants: TenantOptions{Header: "X-Tenant"}})
	if x := byHeader.tenantOf(h("X-Tenant", "team-a", "Authorization", "Bearer sk-one")); x == 0 || x != byHeader.tenantOf(h("X-Tenant", "team-a")) {
		t.Fatal("the tenant header does not name the tenant")
	}
}

// The labels go to the busiest tenants: a tenant that floods a router
// whose labels the first tenants took takes the least busy one's among
// those with nothing in flight; the retired label's series go.
func TestTenantLabelsGoToTheBusiest(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := New(Options{Tenants: TenantOptions{MetricTenants: 2}, Metrics: metrics.New(reg, Classes, nil)})
	const a, b, c, d = 0xa1 << 56, 0xb1 << 56, 0xc1 << 56, 0xd1 << 56
	admit := func(id uint64, n int) {
		for range n {
			l := s.tenantLabel(id)
			s.countAdmitted(id)
			s.opt.Metrics.TenantAdmitted(l, "default", 0, false)
		}
	}
	admit(a, 3)
	admit(b, 1)
	admit(c, 20)
	if s.tenantLabel(c) != "other" {
		t.Fatalf("a third tenant of two labels is %q before a ranking", s.tenantLabel(c))
	}
	series := func(label string) bool {
		fams, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range fams {
			for _, m := range f.GetMetric() {
				for _, lp := range m.GetLabel() {
					if lp.GetName() == "tenant" && lp.GetValue() == label {
						return true
					}
				}
			}
		}
		return false
	}
	if !series(hashLabel(b)) {
		t.Fatal("a labelled tenant has no series")
	}
	s.rankTenants()
	if s.tenantLabel(c) != hashLabel(c) || s.tenantLabel(b) != "other" || s.tenantLabel(a) != hashLabel(a) {
		t.Fatalf("after a ranking: a %q, b %q, c %q; want c to take b's label", s.tenantLabel(a), s.tenantLabel(b), s.tenantLabel(c))
	}
	if series(hashLabel(b)) {
		t.Fatal("the retired label's series are still exported")
	}
	// a, the least busy, runs a request: d takes c's label instead.
	s.queue.runs.started(flowOf(a, classDefault), 1, classDefault)
	admit(d, 30)
	s.rankTenants()
	if s.tenantLabel(a) != hashLabel(a) || s.tenantLabel(d) != hashLabel(d) || s.tenantLabel(c) != "other" {
		t.Fatalf("a in flight: a %q, c %q, d %q; want d to take c's label", s.tenantLabel(a), s.tenantLabel(c), s.tenantLabel(d))
	}
	s.queue.runs.ended(flowOf(a, classDefault))
	const e = 0xe1 << 56
	admit(e, 60)
	s.rankTenants()
	if s.tenantLabel(e) != hashLabel(e) || s.tenantLabel(a) != "other" || s.tenantLabel(d) != hashLabel(d) {
		t.Fatalf("once a is idle: a %q, d %q, e %q; want e to take a's label", s.tenantLabel(a), s.tenantLabel(d), s.tenantLabel(e))
	}
}
