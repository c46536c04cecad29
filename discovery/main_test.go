package discovery

import (
	"context"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv(cpuHelperEnv) != "" {
		serveMetricsForever() // the child process of TestScrapeCPU100Pods
		return
	}
	goleak.VerifyTestMain(m)
}

// waitTimeout bounds every wait of these tests; it is a deadlock guard, not
// a speed assertion.
const waitTimeout = 10 * time.Second

// recv returns the next value from ch (the zero value once ch is
// closed), failing the test if none comes within waitTimeout.
func recv[T any](t testing.TB, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(waitTimeout):
		t.Fatalf("timed out waiting for %s", what)
		var zero T
		return zero
	}
}

// event is one Fleet trace event.
type event struct {
	name string
	e    *Endpoint
}

// recorder collects a Fleet's trace events; tests wait on it instead of
// sleeping.
type recorder struct {
	mu     sync.Mutex
	events []event
	notify chan struct{}
}

// record attaches a new recorder to f (before Run).
func record(f *Fleet) *recorder {
	r := &recorder{notify: make(chan struct{})}
	f.trace = func(name string, e *Endpoint) {
		r.mu.Lock()
		r.events = append(r.events, event{name, e})
		close(r.notify)
		r.notify = make(chan struct{})
		r.mu.Unlock()
	}
	return r
}

// mark returns the number of events so far, for wait's from.
func (r *recorder) mark() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.events)
}

// count returns the events named name (for e, when e is not nil) at or
// after index from.
func (r *recorder) count(from int, name string, e *Endpoint) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, ev := range r.events[min(from, len(r.events)):] {
		if ev.name == name && (e == nil || ev.e == e) {
			n++
		}
	}
	return n
}

// wait blocks until n events named name (for e, when not nil) happened at
// or after index from.
func (r *recorder) wait(t *testing.T, from int, name string, e *Endpoint, n int) {
	t.Helper()
	deadline := time.After(waitTimeout)
	for {
		r.mu.Lock()
		ch := r.notify
		r.mu.Unlock()
		if r.count(from, name, e) >= n {
			return
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("timed out waiting for %d %q events (saw %d)", n, name, r.count(from, name, e))
		}
	}
}

// until blocks until cond holds, re-checking at every event.
func (r *recorder) until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.After(waitTimeout)
	for {
		r.mu.Lock()
		ch := r.notify
		r.mu.Unlock()
		if cond() {
			return
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("timed out waiting until %s", what)
		}
	}
}

// quietOptions returns Options with probing and scraping off, and the fast
// reaping tests want.
func quietOptions() Options {
	return Options{Health: HealthConfig{Disabled: true}, Scrape: ScrapeConfig{Disabled: true}}
}

// newFleet builds a Fleet that reaps at once.
func newFleet(t *testing.T, o Options) (*Fleet, *recorder) {
	t.Helper()
	f, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	f.reapEvery, f.reapGrace = 5*time.Millisecond, 0
	return f, record(f)
}

// run runs f until the test ends.
func run(t *testing.T, f *Fleet) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := recv(t, done, "Run to return"); err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

// urls returns the URLs of eps.
func urls(eps []*Endpoint) []string {
	out := make([]string, len(eps))
	for i, e := range eps {
		out[i] = e.URL
	}
	return out
}

// byURL returns the endpoint of set with url, or nil.
func byURL(set *Set, url string) *Endpoint {
	for _, e := range set.Endpoints {
		if e.URL == url {
			return e
		}
	}
	return nil
}

// dnsServer is an authoritative test server for cluster.local. on
// 127.0.0.1, UDP and TCP on the same port, whose records tests edit.
type dnsServer struct {
	addr string
	udp  *dns.Server
	tcp  *dns.Server

	mu      sync.Mutex
	rrs     []dns.RR
	rcode   int  // answer every query with this rcode when non-zero
	drop    bool // answer nothing (a dead nameserver)
	trunc   bool // truncate every UDP answer
	queries []dnsQuery
}

// dnsQuery is one question the server received.
type dnsQuery struct {
	name, qtype, net string
}

// startDNS serves testdata/dns/cluster.zone until the test ends.
func startDNS(t *testing.T) *dnsServer {
	t.Helper()
	s := &dnsServer{rrs: loadZone(t, "../testdata/dns/cluster.zone")}
	var pc net.PacketConn
	var ln net.Listener
	for range 20 { // find a port free for both UDP and TCP
		p, err := net.ListenPacket("udp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		l, err := net.Listen("tcp", p.LocalAddr().String())
		if err == nil {
			pc, ln = p, l
			break
		}
		p.Close()
	}
	if pc == nil {
		t.Fatal("no port free for both UDP and TCP")
	}
	s.addr = pc.LocalAddr().String()
	mux := dns.NewServeMux()
	mux.HandleFunc(".", s.serve)
	var started sync.WaitGroup
	started.Add(2)
	s.udp = &dns.Server{PacketConn: pc, Handler: mux, NotifyStartedFunc: started.Done}
	s.tcp = &dns.Server{Listener: ln, Handler: mux, NotifyStartedFunc: started.Done}
	var stopped sync.WaitGroup
	for _, srv := range []*dns.Server{s.udp, s.tcp} {
		stopped.Go(func() { _ = srv.ActivateAndServe() })
	}
	started.Wait()
	t.Cleanup(func() {
		_ = s.udp.Shutdown()
		_ = s.tcp.Shutdown()
		stopped.Wait()
	})
	return s
}

func loadZone(t *testing.T, path string) []dns.RR {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zp := dns.NewZoneParser(f, "", path)
	var rrs []dns.RR
	for rr, ok := zp.Next(); ok; rr, ok = zp.Next() {
		rrs = append(rrs, rr)
	}
	if err := zp.Err(); err != nil {
		t.Fatal(err)
	}
	return rrs
}

func (s *dnsServer) serve(w dns.ResponseWriter, r *dns.Msg) {
	s.mu.Lock()
	defer s.mu.Unlock()
	q := r.Question[0]
	netw := w.RemoteAddr().Network()
	s.queries = append(s.queries, dnsQuery{strings.ToLower(q.Name), dns.TypeToString[q.Qtype], netw})
	if s.drop {
		return
	}
	m := new(dns.Msg)
	m.SetReply(r)
	m.Authoritative = true
	if s.rcode != 0 {
		m.Rcode = s.rcode
		_ = w.WriteMsg(m)
		return
	}
	if s.trunc && netw == "udp" {
		m.Truncated = true
		_ = w.WriteMsg(m)
		return
	}
	exists := false
	for _, rr := range s.rrs {
		if !strings.EqualFold(rr.Header().Name, q.Name) {
			continue
		}
		exists = true
		if rr.Header().Rrtype == q.Qtype {
			m.Answer = append(m.Answer, dns.Copy(rr))
		}
	}
	for _, rr := range m.Answer {
		if srv, ok := rr.(*dns.SRV); ok {
			for _, a := range s.rrs {
				if strings.EqualFold(a.Header().Name, srv.Target) && a.Header().Rrtype == dns.TypeA {
					m.Extra = append(m.Extra, dns.Copy(a))
				}
			}
		}
	}
	if !exists {
		m.Rcode = dns.RcodeNameError
	}
	_ = w.WriteMsg(m)
}

// set replaces the records of name and type rrtype ("A", "AAAA") with one
// record per value, with ttl.
func (s *dnsServer) set(name, rrtype string, ttl int, values ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	name = dns.Fqdn(name)
	t := dns.StringToType[rrtype]
	kept := s.rrs[:0]
	for _, rr := range s.rrs {
		if !(strings.EqualFold(rr.Header().Name, name) && rr.Header().Rrtype == t) {
			kept = append(kept, rr)
		}
	}
	s.rrs = kept
	for _, v := range values {
		rr, err := dns.NewRR(name + " " + strconv.Itoa(ttl) + " IN " + rrtype + " " + v)
		if err != nil {
			panic(err)
		}
		s.rrs = append(s.rrs, rr)
	}
}

// setFailure makes the server answer rcode (0: normally) or drop queries.
func (s *dnsServer) setFailure(rcode int, drop bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rcode, s.drop = rcode, drop
}

func (s *dnsServer) setTruncate(v bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.trunc = v
}

// seen returns the queries received so far.
func (s *dnsServer) seen() []dnsQuery {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]dnsQuery(nil), s.queries...)
}

// resolvConf writes a resolv.conf naming the server and returns its path.
func (s *dnsServer) resolvConf(t *testing.T, lines ...string) string {
	t.Helper()
	p := t.TempDir() + "/resolv.conf"
	body := "nameserver " + s.addr + "\n" + strings.Join(lines, "\n") + "\n"
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
