package discovery

import (
	"slices"
	"testing"
	"time"
)

func mustEndpoints(t *testing.T, role Role, raw ...string) []*Endpoint {
	t.Helper()
	out := make([]*Endpoint, len(raw))
	for i, r := range raw {
		e, err := NewEndpoint(r, role)
		if err != nil {
			t.Fatal(err)
		}
		out[i] = e
	}
	return out
}

func TestPublishGroupsRolesAndKeepsEndpoints(t *testing.T) {
	var p Pool
	if p.Load().Len() != 0 || p.Load().Role(RoleDecode) != nil {
		t.Fatal("zero Pool not empty")
	}
	d := mustEndpoints(t, RoleDecode, "10.0.2.1:8000", "10.0.2.2:8000")
	m := mustEndpoints(t, RoleMixed, "10.0.0.1:8000", "10.0.0.1:8000")
	pf := mustEndpoints(t, RolePrefill, "10.0.1.1:8000", "10.0.0.1:8000") // same URL as a mixed one: another endpoint
	changed := p.Changed()
	s1 := p.Publish(slices.Concat(d, m, pf))
	select {
	case <-changed:
	default:
		t.Fatal("Changed not closed by Publish")
	}
	if got, want := urls(s1.Endpoints), []string{"http://10.0.0.1:8000", "http://10.0.2.1:8000",
		"http://10.0.2.2:8000", "http://10.0.1.1:8000", "http://10.0.0.1:8000"}; !slices.Equal(got, want) {
		t.Fatalf("Endpoints = %v, want %v", got, want)
	}
	if want := slices.Concat(m[:1], d); !slices.Equal(s1.Serving, want) || cap(s1.Serving) != len(want) {
		t.Errorf("Serving = %v, want the mixed then the decode endpoints", urls(s1.Serving))
	}
	for _, tc := range []struct {
		role Role
		want []*Endpoint
	}{
		{RoleMixed, m[:1]}, {RolePrefill, pf}, {RoleDecode, d},
	} {
		t.Run(tc.role.String(), func(t *testing.T) {
			if got := s1.Role(tc.role); !slices.Equal(got, tc.want) {
				t.Errorf("Role(%v) = %v", tc.role, urls(got))
			}
			if got := s1.Role(tc.role); cap(got) != len(got) {
				t.Errorf("group has spare capacity %d: an append would write into the next group", cap(got)-len(got))
			}
		})
	}

	m[0].requests.Add(3)
	fresh := mustEndpoints(t, RoleMixed, "10.0.0.1:8000")
	s2 := p.Publish(slices.Concat(fresh, d))
	if s2.Version != s1.Version+1 {
		t.Errorf("version %d after %d", s2.Version, s1.Version)
	}
	if s2.Mixed[0] != m[0] || s2.Mixed[0].Requests() != 3 {
		t.Error("kept address lost its *Endpoint")
	}
	if s2.Prefill != nil {
		t.Errorf("Prefill = %v, want nil", urls(s2.Prefill))
	}
	if got := p.Draining(); !slices.Equal(got, pf) {
		t.Errorf("Draining = %v, want the prefill endpoints", urls(got))
	}
	for _, e := range pf {
		if e.Routable() || e.State() != StateDraining {
			t.Errorf("%s: routable %v, state %v", e.URL, e.Routable(), e.State())
		}
	}
}

func TestReap(t *testing.T) {
	var p Pool
	eps := mustEndpoints(t, RoleMixed, "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
	p.Publish(eps)
	eps[1].inFlight.Add(1)
	eps[2].inFlight.Add(1)
	p.Publish(nil)
	now := time.Now()
	for _, tc := range []struct {
		name  string
		at    time.Time
		grace time.Duration
		limit time.Duration
		want  []*Endpoint
	}{
		{name: "within grace nothing goes", at: now, grace: time.Second, limit: time.Minute},
		{name: "idle one goes after grace", at: now.Add(time.Second), grace: time.Second, limit: time.Minute, want: eps[:1]},
		{name: "busy ones stay before the limit", at: now.Add(59 * time.Second), grace: time.Second, limit: time.Minute},
		{name: "busy ones go at the limit", at: now.Add(time.Minute), grace: time.Second, limit: time.Minute, want: eps[1:]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := p.reap(tc.at, tc.grace, tc.limit); !slices.Equal(got, tc.want) {
				t.Errorf("reaped %v, want %v", urls(got), urls(tc.want))
			}
		})
	}
}
