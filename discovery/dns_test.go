package discovery

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/miekg/dns"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// fastDNS returns a DNSConfig for the test server that re-resolves often.
func fastDNS(s *dnsServer, service string) DNSConfig {
	return DNSConfig{Service: service, Server: s.addr, Interval: 20 * time.Millisecond,
		MinInterval: 5 * time.Millisecond, Timeout: 200 * time.Millisecond}
}

func TestParseServiceSpec(t *testing.T) {
	for _, tc := range []struct {
		name, spec string
		wantName   string
		wantPort   uint16
		wantNamed  string
		wantErr    error
	}{
		{name: "bare name", spec: "vllm", wantName: "vllm", wantPort: 8000},
		{name: "numeric port", spec: "vllm.ns.svc.cluster.local:8080", wantName: "vllm.ns.svc.cluster.local", wantPort: 8080},
		{name: "absolute name", spec: "vllm.ns.svc.cluster.local.:80", wantName: "vllm.ns.svc.cluster.local.", wantPort: 80},
		{name: "named port", spec: "vllm:http", wantName: "vllm", wantNamed: "http"},
		{name: "named port with digits", spec: "vllm:metrics-2", wantName: "vllm", wantNamed: "metrics-2"},
		{name: "empty", spec: "", wantErr: ErrBadService},
		{name: "empty port", spec: "vllm:", wantErr: ErrBadService},
		{name: "port zero", spec: "vllm:0", wantErr: ErrBadService},
		{name: "port too big", spec: "vllm:65536", wantErr: ErrBadService},
		{name: "port name too long", spec: "vllm:abcdefghijklmnop", wantErr: ErrBadService},
		{name: "port name upper case", spec: "vllm:HTTP", wantErr: ErrBadService},
		{name: "url", spec: "http://vllm:8000", wantErr: ErrBadService},
		{name: "ipv6 literal", spec: "[::1]:8000", wantErr: ErrBadService},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var d dnsSource
			err := d.parseService(tc.spec)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("err = %v, want %v", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if d.name != tc.wantName || d.port != tc.wantPort || d.portName != tc.wantNamed {
				t.Errorf("got name %q port %d named %q", d.name, d.port, d.portName)
			}
		})
	}
}

func TestDNSConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  DNSConfig
	}{
		{name: "no nameserver", cfg: DNSConfig{Service: "vllm"}},
		{name: "missing resolv.conf", cfg: DNSConfig{Service: "vllm", ResolvConf: "/nonexistent/resolv.conf"}},
		{name: "bad scheme", cfg: DNSConfig{Service: "vllm", Server: "127.0.0.1", Scheme: "grpc"}},
		{name: "bad family", cfg: DNSConfig{Service: "vllm", Server: "127.0.0.1", IPFamily: "ipv5"}},
		{name: "bad base path", cfg: DNSConfig{Service: "vllm", Server: "127.0.0.1", BasePath: "v1"}},
		{name: "min above interval", cfg: DNSConfig{Service: "vllm", Server: "127.0.0.1", Interval: time.Second, MinInterval: time.Minute}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, _ := newFleet(t, quietOptions())
			if err := f.AddDNS(tc.cfg); !errors.Is(err, ErrBadConfig) {
				t.Fatalf("err = %v, want ErrBadConfig", err)
			}
		})
	}
}

// TestDNSScaleUpAndDown follows a headless Service through a scale-up and a
// scale-down: the new pod joins the Set, the removed one leaves it at once,
// drains until its last request ends, and only then is dropped (OnRemove).
func TestDNSScaleUpAndDown(t *testing.T) {
	srv := startDNS(t)
	removed := make(chan *Endpoint, 4)
	o := quietOptions()
	o.OnRemove = func(e *Endpoint) { removed <- e }
	f, rec := newFleet(t, o)
	if err := f.AddDNS(fastDNS(srv, "vllm.ns.svc.cluster.local:8000")); err != nil {
		t.Fatal(err)
	}
	pool := f.Pool()
	changed := pool.Changed()
	run(t, f)

	recv(t, changed, "a new Set")
	set := pool.Load()
	if got, want := urls(set.Endpoints), []string{"http://10.0.0.1:8000", "http://10.0.0.2:8000"}; !slices.Equal(got, want) {
		t.Fatalf("first set = %v, want %v", got, want)
	}
	leaving, staying := set.Endpoints[0], set.Endpoints[1]
	staying.requests.Add(7)
	leaving.inFlight.Add(1) // a stream in flight on the pod about to leave

	t.Run("scale up", func(t *testing.T) {
		changed := pool.Changed()
		srv.set("vllm.ns.svc.cluster.local", "A", 5, "10.0.0.1", "10.0.0.2", "10.0.0.3")
		recv(t, changed, "a new Set")
		set := pool.Load()
		if got := urls(set.Endpoints); len(got) != 3 || got[2] != "http://10.0.0.3:8000" {
			t.Fatalf("set = %v, want the new pod", got)
		}
		if byURL(set, staying.URL) != staying || staying.Requests() != 7 {
			t.Error("an endpoint present before lost its *Endpoint or counters")
		}
	})

	t.Run("scale down drains", func(t *testing.T) {
		changed := pool.Changed()
		srv.set("vllm.ns.svc.cluster.local", "A", 5, "10.0.0.2", "10.0.0.3")
		recv(t, changed, "a new Set")
		set := pool.Load()
		if byURL(set, leaving.URL) != nil || slices.Contains(set.Mixed, leaving) {
			t.Fatalf("removed pod still routable in %v", urls(set.Endpoints))
		}
		if leaving.Routable() || leaving.State() != StateDraining {
			t.Errorf("leaving pod: routable %v, state %v; want draining", leaving.Routable(), leaving.State())
		}
		if d := pool.Draining(); len(d) != 1 || d[0] != leaving {
			t.Fatalf("draining = %v, want the leaving pod", urls(d))
		}
		st := f.Endpoints()
		if last := st[len(st)-1]; last.URL != leaving.URL || last.State != StateDraining || last.InFlight != 1 {
			t.Errorf("introspection's last entry = %+v, want the draining pod", last)
		}
		// Several more reaps and lookups: still draining while in flight.
		m := rec.mark()
		rec.wait(t, m, "dns-ok", nil, 3)
		select {
		case e := <-removed:
			t.Fatalf("%s removed with a request in flight", e.URL)
		default:
		}
		leaving.inFlight.Add(-1) // the stream ends
		select {
		case e := <-removed:
			if e != leaving {
				t.Fatalf("removed %s, want %s", e.URL, leaving.URL)
			}
		case <-time.After(waitTimeout):
			t.Fatal("drained pod never removed")
		}
		if d := pool.Draining(); len(d) != 0 {
			t.Errorf("draining = %v after removal", urls(d))
		}
	})

	t.Run("return while draining revives the same endpoint", func(t *testing.T) {
		e2 := byURL(pool.Load(), "http://10.0.0.2:8000")
		e2.inFlight.Add(1)
		changed := pool.Changed()
		srv.set("vllm.ns.svc.cluster.local", "A", 5, "10.0.0.3")
		recv(t, changed, "a new Set")
		if !slices.Contains(pool.Draining(), e2) {
			t.Fatal("10.0.0.2 not draining")
		}
		changed = pool.Changed()
		srv.set("vllm.ns.svc.cluster.local", "A", 5, "10.0.0.2", "10.0.0.3")
		recv(t, changed, "a new Set")
		if got := byURL(pool.Load(), e2.URL); got != e2 || !e2.Routable() || len(pool.Draining()) != 0 {
			t.Fatalf("returning pod: same %v, routable %v, draining %v", got == e2, e2.Routable(), urls(pool.Draining()))
		}
		e2.inFlight.Add(-1)
	})
}

// TestDNSOutageKeepsLastGoodSet: whatever the failure, the last good
// endpoints stay, the failure is counted and logged once per outage, and
// the source recovers.
func TestDNSOutageKeepsLastGoodSet(t *testing.T) {
	for _, tc := range []struct {
		name   string
		outage func(s *dnsServer)
	}{
		{name: "SERVFAIL", outage: func(s *dnsServer) { s.setFailure(dns.RcodeServerFailure, false) }},
		{name: "REFUSED", outage: func(s *dnsServer) { s.setFailure(dns.RcodeRefused, false) }},
		{name: "no answer (timeouts)", outage: func(s *dnsServer) { s.setFailure(0, true) }},
		{name: "records gone (NXDOMAIN)", outage: func(s *dnsServer) { s.set("vllm.ns.svc.cluster.local", "A", 5) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := startDNS(t)
			core, logs := observer.New(zap.WarnLevel)
			o := quietOptions()
			o.Logger = zap.New(core)
			f, rec := newFleet(t, o)
			cfg := fastDNS(srv, "vllm.ns.svc.cluster.local:8000")
			cfg.Timeout = 20 * time.Millisecond
			if err := f.AddDNS(cfg); err != nil {
				t.Fatal(err)
			}
			run(t, f)
			rec.wait(t, 0, "dns-ok", nil, 1)
			before := f.Pool().Load()

			m := rec.mark()
			tc.outage(srv)
			rec.wait(t, m, "dns-error", nil, 3)
			if after := f.Pool().Load(); after != before {
				t.Fatalf("set changed during the outage: %v", urls(after.Endpoints))
			}
			if n := logs.FilterMessage("DNS lookup failed; keeping the last good endpoints").Len(); n != 1 {
				t.Errorf("outage logged %d times, want once", n)
			}
			if got := counterValue(t, f, "kvroute_discovery_dns_failures_total"); got < 3 {
				t.Errorf("dns failures counted %v, want ≥ 3", got)
			}

			changed := f.Pool().Changed()
			srv.setFailure(0, false)
			srv.set("vllm.ns.svc.cluster.local", "A", 5, "10.0.0.1", "10.0.0.2", "10.0.0.9")
			recv(t, changed, "a new Set")
			if got := f.Pool().Load().Len(); got != 3 {
				t.Fatalf("after recovery: %d endpoints, want 3", got)
			}
		})
	}
}

// TestDNSHonoursShortTTL: records whose TTL is shorter than the interval
// are looked up again when the TTL expires (never sooner than MinInterval).
func TestDNSHonoursShortTTL(t *testing.T) {
	for _, tc := range []struct {
		name string
		ttl  int
	}{
		{name: "ttl 0 floors at min interval", ttl: 0},
		{name: "ttl 1s below a 1h interval", ttl: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := startDNS(t)
			srv.set("vllm.ns.svc.cluster.local", "A", tc.ttl, "10.0.0.1")
			f, rec := newFleet(t, quietOptions())
			cfg := fastDNS(srv, "vllm.ns.svc.cluster.local:8000")
			cfg.Interval = time.Hour
			if err := f.AddDNS(cfg); err != nil {
				t.Fatal(err)
			}
			run(t, f)
			rec.wait(t, 0, "dns-ok", nil, 1)
			srv.set("vllm.ns.svc.cluster.local", "A", tc.ttl, "10.0.0.1", "10.0.0.5")
			rec.wait(t, 0, "dns-ok", nil, 2) // an hour-long interval would time this out
			if got := f.Pool().Load().Len(); got != 2 {
				t.Errorf("%d endpoints after the TTL expired, want 2", got)
			}
		})
	}
}

// resolutionCase is one lookup and what it must return.
type resolutionCase struct {
	name string
	cfg  func(t *testing.T) DNSConfig
	// edit runs before the lookup (and is undone by a fresh server
	// per case where needed).
	edit      func()
	want      []string
	firstName string // the first name queried, when checked
	wantTCP   bool
}

// run resolves tc's configuration against srv once and checks the answer
// and the queries sent.
func (tc resolutionCase) run(t *testing.T, srv *dnsServer) {
	srv.setTruncate(false)
	if tc.edit != nil {
		tc.edit()
	}
	d, err := newDNSSource(tc.cfg(t))
	if err != nil {
		t.Fatal(err)
	}
	before := len(srv.seen())
	eps, _, err := d.resolve(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if got := urls(eps); !slices.Equal(got, tc.want) {
		t.Errorf("endpoints = %v, want %v", got, tc.want)
	}
	qs := srv.seen()[before:]
	if tc.firstName != "" && qs[0].name != tc.firstName {
		t.Errorf("first query %q, want %q (all: %v)", qs[0].name, tc.firstName, qs)
	}
	if tc.wantTCP != slices.ContainsFunc(qs, func(q dnsQuery) bool { return q.net == "tcp" }) {
		t.Errorf("TCP used = %v, want %v (%v)", !tc.wantTCP, tc.wantTCP, qs)
	}
}

// TestDNSResolution covers what one lookup returns: SRV named ports,
// address families, TCP fallback.
func TestDNSResolution(t *testing.T) {
	srv := startDNS(t)
	for _, tc := range []resolutionCase{
		{
			name: "numeric port",
			cfg:  func(*testing.T) DNSConfig { return fastDNS(srv, "vllm.ns.svc.cluster.local:8000") },
			want: []string{"http://10.0.0.1:8000", "http://10.0.0.2:8000"},
		},
		{
			name: "default port, https and base path",
			cfg: func(*testing.T) DNSConfig {
				c := fastDNS(srv, "decode.ns.svc.cluster.local")
				c.Scheme, c.BasePath, c.Role = "https", "/engine", RoleDecode
				return c
			},
			want: []string{"https://10.0.2.1:8000/engine", "https://10.0.2.2:8000/engine"},
		},
		{
			name: "named port: SRV ports and additional addresses",
			cfg:  func(*testing.T) DNSConfig { return fastDNS(srv, "vllm.ns.svc.cluster.local:http") },
			want: []string{"http://10.0.0.1:8000", "http://10.0.0.2:8001"},
		},
		{
			name: "IPv6-only service",
			cfg:  func(*testing.T) DNSConfig { return fastDNS(srv, "v6.ns.svc.cluster.local:8000") },
			want: []string{"http://[fd00::1]:8000"},
		},
		{
			name: "dual stack counts each pod once",
			cfg:  func(*testing.T) DNSConfig { return fastDNS(srv, "dual.ns.svc.cluster.local:8000") },
			want: []string{"http://10.0.3.1:8000"},
		},
		{
			name: "dual stack, ipv6 chosen",
			cfg: func(*testing.T) DNSConfig {
				c := fastDNS(srv, "dual.ns.svc.cluster.local:8000")
				c.IPFamily = "ipv6"
				return c
			},
			want: []string{"http://[fd00::3:1]:8000"},
		},
		{
			name:    "truncated UDP answer retried over TCP",
			cfg:     func(*testing.T) DNSConfig { return fastDNS(srv, "prefill.ns.svc.cluster.local:8000") },
			edit:    func() { srv.setTruncate(true) },
			want:    []string{"http://10.0.1.1:8000"},
			wantTCP: true,
		},
	} {
		t.Run(tc.name, func(t *testing.T) { tc.run(t, srv) })
	}
}

// TestDNSSearchPath covers the resolver configuration: search paths and
// ndots from resolv.conf, as in a pod.
func TestDNSSearchPath(t *testing.T) {
	srv := startDNS(t)
	for _, tc := range []resolutionCase{
		{
			name: "search path with ndots 5 (a pod's resolv.conf)",
			cfg: func(t *testing.T) DNSConfig {
				return DNSConfig{Service: "vllm:8000", ResolvConf: srv.resolvConf(t,
					"search ns.svc.cluster.local svc.cluster.local cluster.local", "options ndots:5")}
			},
			want:      []string{"http://10.0.0.1:8000", "http://10.0.0.2:8000"},
			firstName: "vllm.ns.svc.cluster.local.",
		},
		{
			name: "search path: name.namespace",
			cfg: func(t *testing.T) DNSConfig {
				return DNSConfig{Service: "prefill.ns:8000", ResolvConf: srv.resolvConf(t,
					"search ns.svc.cluster.local svc.cluster.local cluster.local", "options ndots:5")}
			},
			want:      []string{"http://10.0.1.1:8000"},
			firstName: "prefill.ns.ns.svc.cluster.local.",
		},
		{
			name: "ndots 1: a dotted name is tried as is first",
			cfg: func(t *testing.T) DNSConfig {
				return DNSConfig{Service: "prefill.ns:8000", ResolvConf: srv.resolvConf(t,
					"search svc.cluster.local", "options ndots:1")}
			},
			want:      []string{"http://10.0.1.1:8000"},
			firstName: "prefill.ns.",
		},
		{
			name: "named port through the search path",
			cfg: func(t *testing.T) DNSConfig {
				return DNSConfig{Service: "vllm:http", ResolvConf: srv.resolvConf(t,
					"search ns.svc.cluster.local svc.cluster.local cluster.local", "options ndots:5")}
			},
			want:      []string{"http://10.0.0.1:8000", "http://10.0.0.2:8001"},
			firstName: "_http._tcp.vllm.ns.svc.cluster.local.",
		},
	} {
		t.Run(tc.name, func(t *testing.T) { tc.run(t, srv) })
	}
}

// TestDNSSRVTargetLookup: SRV targets missing from the additional section
// are looked up themselves; an SRV answer's ports are honoured.
func TestDNSSRVTargetLookup(t *testing.T) {
	srv := startDNS(t)
	srv.set("_p._tcp.pd.ns.svc.cluster.local", "SRV", 5,
		"0 50 9000 a.pd.ns.svc.cluster.local.", "0 50 9001 b.pd.ns.svc.cluster.local.", "0 50 9002 gone.pd.ns.svc.cluster.local.")
	srv.set("a.pd.ns.svc.cluster.local", "AAAA", 5, "fd00::a")
	srv.set("b.pd.ns.svc.cluster.local", "AAAA", 5, "fd00::b")
	d, err := newDNSSource(fastDNS(srv, "pd.ns.svc.cluster.local:p"))
	if err != nil {
		t.Fatal(err)
	}
	eps, _, err := d.resolve(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if got, want := urls(eps), []string{"http://[fd00::a]:9000", "http://[fd00::b]:9001"}; !slices.Equal(got, want) {
		t.Errorf("endpoints = %v, want %v", got, want)
	}
}

// counterValue sums the samples of a counter family the Fleet collects.
func counterValue(t *testing.T, f *Fleet, name string) float64 {
	t.Helper()
	var total float64
	for _, mf := range gather(t, f) {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				total += m.GetCounter().GetValue() + m.GetGauge().GetValue()
			}
		}
	}
	return total
}

// gather collects f's metrics through a registry.
func gather(t *testing.T, f *Fleet) []*dto.MetricFamily {
	t.Helper()
	reg := newRegistry()
	if err := reg.Register(f); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	return mfs
}

// A Resolver looks a service up as a DNS source does, for the replicas'
// gossip: the caller's default port when the spec has none, a named
// port's SRV ports, the spec's own port; no records is ErrNoRecords.
func TestResolverLookup(t *testing.T) {
	srv := startDNS(t)
	for _, tc := range []struct {
		spec string
		want []string
	}{
		{"vllm.ns.svc.cluster.local", []string{"10.0.0.1:7946", "10.0.0.2:7946"}},
		{"vllm.ns.svc.cluster.local:9999", []string{"10.0.0.1:9999", "10.0.0.2:9999"}},
		{"vllm.ns.svc.cluster.local:http", []string{"10.0.0.1:8000", "10.0.0.2:8001"}},
	} {
		r, err := NewResolver(fastDNS(srv, tc.spec), 7946)
		if err != nil {
			t.Fatal(err)
		}
		got, err := r.Lookup(t.Context())
		slices.Sort(got)
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("%s: %v, %v; want %v", tc.spec, got, err, tc.want)
		}
	}
	r, err := NewResolver(fastDNS(srv, "nothing.ns.svc.cluster.local"), 7946)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := r.Lookup(t.Context()); !errors.Is(err, ErrNoRecords) {
		t.Errorf("a name without records: %v, %v", got, err)
	}
	if _, err := NewResolver(DNSConfig{Service: "bad name:", Server: srv.addr}, 7946); err == nil {
		t.Error("a bad spec accepted")
	}
}
