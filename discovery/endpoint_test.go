package discovery

import (
	"errors"
	"testing"
)

func TestEndpointFragments(t *testing.T) {
	for _, c := range []struct {
		name, raw           string
		bootstrap, kvEvents int
		bad                 bool
	}{
		{name: "none", raw: "http://10.0.0.1:8000"},
		{name: "bootstrap", raw: "http://10.0.0.1:8000#bootstrap=8998", bootstrap: 8998},
		{name: "kv events", raw: "http://10.0.0.1:8000#kv-events=5557", kvEvents: 5557},
		{name: "both", raw: "10.0.0.1:8000#bootstrap=9000&kv-events=5558", bootstrap: 9000, kvEvents: 5558},
		{name: "unknown key", raw: "http://10.0.0.1:8000#boot=1", bad: true},
		{name: "port out of range", raw: "http://10.0.0.1:8000#kv-events=70000", bad: true},
		{name: "not a number", raw: "http://10.0.0.1:8000#kv-events=x", bad: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			e, err := NewEndpoint(c.raw, RoleMixed)
			if c.bad {
				if !errors.Is(err, ErrBadURL) {
					t.Fatalf("err %v, want ErrBadURL", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if e.BootstrapPort != c.bootstrap || e.KVEventsPort != c.kvEvents || e.URL != "http://10.0.0.1:8000" {
				t.Fatalf("bootstrap %d kv-events %d url %q", e.BootstrapPort, e.KVEventsPort, e.URL)
			}
		})
	}
}
