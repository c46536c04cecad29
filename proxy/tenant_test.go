package proxy

import (
	"fmt"
	"strings"
	"testing"

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
