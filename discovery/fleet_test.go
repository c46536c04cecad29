package discovery

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

func newRegistry() *prometheus.Registry { return prometheus.NewRegistry() }

// TestFleetMergesSources: static lists and DNS sources of several roles
// make one Set; a source's change republishes the merge.
func TestFleetMergesSources(t *testing.T) {
	srv := startDNS(t)
	f, rec := newFleet(t, quietOptions())
	if err := f.AddStatic(RoleMixed, []string{"http://10.9.0.1:8000", "10.9.0.2:8000"}); err != nil {
		t.Fatal(err)
	}
	if err := f.AddStatic(RolePrefill, []string{"10.9.1.1:8000"}); err != nil {
		t.Fatal(err)
	}
	dc := fastDNS(srv, "decode.ns.svc.cluster.local:8200")
	dc.Role = RoleDecode
	if err := f.AddDNS(dc); err != nil {
		t.Fatal(err)
	}
	if err := f.AddStatic(RoleMixed, []string{"ftp://nope"}); !errors.Is(err, ErrBadURL) {
		t.Errorf("bad URL: err = %v", err)
	}
	if got := f.Pool().Load(); got.Len() != 3 || got.Decode != nil {
		t.Fatalf("static lists not published before Run: %v", urls(got.Endpoints))
	}
	run(t, f)
	rec.wait(t, 0, "dns-ok", nil, 1)
	set := f.Pool().Load()
	for _, tc := range []struct {
		role Role
		want []string
	}{
		{RoleMixed, []string{"http://10.9.0.1:8000", "http://10.9.0.2:8000"}},
		{RolePrefill, []string{"http://10.9.1.1:8000"}},
		{RoleDecode, []string{"http://10.0.2.1:8200", "http://10.0.2.2:8200"}},
	} {
		if got := urls(set.Role(tc.role)); !slices.Equal(got, tc.want) {
			t.Errorf("%v = %v, want %v", tc.role, got, tc.want)
		}
	}
	v := set.Version
	rec.wait(t, 0, "dns-ok", nil, 4)
	if f.Pool().Load().Version != v {
		t.Error("unchanged lookups republished the Set")
	}

	if err := f.AddStatic(RoleMixed, nil); !errors.Is(err, ErrRunning) {
		t.Errorf("AddStatic while running: %v", err)
	}
	if err := f.Run(context.Background()); !errors.Is(err, ErrRunning) {
		t.Errorf("second Run: %v", err)
	}

	// Introspection marshals, and the metrics count endpoints by pool.
	b, err := json.Marshal(f.Endpoints())
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"role":"decode","state":"up","routable":true`) {
		t.Errorf("introspection JSON: %s", b)
	}
	for _, mf := range gather(t, f) {
		if mf.GetName() != "kvroute_discovery_endpoints" {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			want := 0.0
			if labels["state"] == "up" {
				want = map[string]float64{"mixed": 2, "prefill": 1, "decode": 2}[labels["pool"]]
			}
			if got := m.GetGauge().GetValue(); got != want {
				t.Errorf("endpoints%v = %v, want %v", labels, got, want)
			}
		}
	}
}
