package app

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/kvroute/kvroute/bench/proc"
	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/peers"
)

// freeGossipAddr returns a loopback address whose TCP and UDP ports are
// both free (proc.FreePort: below the ephemeral range).
func freeGossipAddr(t *testing.T) string {
	t.Helper()
	addr, err := proc.FreeLoopback()
	if err != nil {
		t.Fatal(err)
	}
	return addr
}

// Two router replicas over one fleet, each given both gossip addresses as
// --peers (as a static deployment lists them): they meet, a prompt sent
// through one lands in the other's index on the same endpoint before the
// other has routed anything, and the other's admin listener shows its
// peer in /debug/peers and the merged placements in its metrics.
func TestReplicasGossipPlacements(t *testing.T) {
	fleet := startSimFleet(t, 2, sim.DefaultConfig())
	addrs := []string{freeGossipAddr(t), freeGossipAddr(t)}
	var rts []*Router
	var urls []string
	for i := range 2 {
		cfg := DefaultConfig()
		cfg.Backends, cfg.AccessLog = fleet.URLs(), false
		cfg.Peers, cfg.GossipListen, cfg.GossipName = addrs, addrs[i], fmt.Sprintf("replica-%d", i)
		if err := cfg.Validate(); err != nil {
			t.Fatal(err)
		}
		rt, url := startRouter(t, cfg)
		rts, urls = append(rts, rt), append(urls, url)
	}
	a, b := rts[0], rts[1]
	deadline := time.Now().Add(15 * time.Second) // a deadlock guard, not a speed assertion
	for a.Mesh.Members() != 1 || b.Mesh.Members() != 1 || b.Mesh.Ready() != nil {
		if time.Now().After(deadline) {
			t.Fatalf("replicas did not meet: %+v / %+v", a.Mesh.Status(), b.Mesh.Status())
		}
		time.Sleep(20 * time.Millisecond)
	}
	prompt := strings.Repeat("A system prompt both replicas should know about. ", 200)
	body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, sim.DefaultConfig().Model, prompt)
	resp, err := testClient.Post(urls[0]+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
	for b.Prefix.Index().Stats().Entries == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("b merged nothing: %+v", b.Mesh.Stats())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if ea, eb := a.Prefix.Index().Stats().Entries, b.Prefix.Index().Stats().Entries; ea != eb {
		t.Errorf("index entries: %d where the request went, %d merged", ea, eb)
	}

	rec := httptest.NewRecorder()
	b.AdminHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/debug/peers", nil))
	var st peers.Status
	if err := json.Unmarshal(rec.Body.Bytes(), &st); err != nil || len(st.Members) != 1 || st.Members[0].Name != "replica-0" || st.Stats.Merged == 0 {
		t.Fatalf("/debug/peers: %v %s", err, rec.Body)
	}
	rec = httptest.NewRecorder()
	b.AdminHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	for _, want := range []string{"kvroute_peers 1", `kvroute_peer_placements_total{outcome="merged"}`, "kvroute_peer_states_total"} {
		if !strings.Contains(rec.Body.String(), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}

	// A replica started later (a rollout, an autoscaler) is warm when it
	// reports ready: it merged a peer's index at its join.
	cfg := DefaultConfig()
	cfg.Backends, cfg.AccessLog = fleet.URLs(), false
	cfg.Peers, cfg.GossipListen, cfg.GossipName = addrs[:1], freeGossipAddr(t), "replica-2"
	c, _ := startRouter(t, cfg)
	for c.Mesh.Ready() != nil {
		if time.Now().After(deadline) {
			t.Fatalf("the late replica is not ready: %+v", c.Mesh.Status())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if ea, ec := a.Prefix.Index().Stats().Entries, c.Prefix.Index().Stats().Entries; ec != ea {
		t.Errorf("the late replica is ready with %d index entries, its peer has %d", ec, ea)
	}
}

// startPeersDNS serves, on 127.0.0.1 (UDP), the SRV records of a headless
// Service of kvroute's pods with a named gossip port,
// _gossip._tcp.kvroute-peers.test., one target a gossip address, until the
// test ends; it returns the server's address.
func startPeersDNS(t *testing.T, gossip ...string) string {
	t.Helper()
	var srvs, extra []dns.RR
	for i, a := range gossip {
		ap := netip.MustParseAddrPort(a)
		target := fmt.Sprintf("r%d.kvroute-peers.test.", i)
		srvs = append(srvs, &dns.SRV{Hdr: dns.RR_Header{Name: "_gossip._tcp.kvroute-peers.test.", Rrtype: dns.TypeSRV, Class: dns.ClassINET, Ttl: 5},
			Priority: 0, Weight: 50, Port: ap.Port(), Target: target})
		extra = append(extra, &dns.A{Hdr: dns.RR_Header{Name: target, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 5}, A: ap.Addr().AsSlice()})
	}
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	mux := dns.NewServeMux()
	mux.HandleFunc(".", func(w dns.ResponseWriter, r *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(r)
		if q := r.Question[0]; q.Qtype == dns.TypeSRV && strings.EqualFold(q.Name, "_gossip._tcp.kvroute-peers.test.") {
			m.Answer, m.Extra = srvs, extra
		} else {
			m.Rcode = dns.RcodeNameError
		}
		_ = w.WriteMsg(m)
	})
	started := make(chan struct{})
	srv := &dns.Server{PacketConn: pc, Handler: mux, NotifyStartedFunc: func() { close(started) }}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.ActivateAndServe() }()
	<-started
	t.Cleanup(func() { _ = srv.Shutdown(); <-done })
	return pc.LocalAddr().String()
}

// Replicas found through a headless Service (--peers-service, its named
// gossip port's SRV records, served by a DNS server on 127.0.0.1): each
// finds the other there, itself among them, and they meet.
func TestPeersService(t *testing.T) {
	fleet := startSimFleet(t, 2, sim.DefaultConfig())
	addrs := []string{freeGossipAddr(t), freeGossipAddr(t)}
	server := startPeersDNS(t, addrs...)
	var rts []*Router
	for i := range 2 {
		cfg := DefaultConfig()
		cfg.Backends, cfg.AccessLog = fleet.URLs(), false
		cfg.PeersService, cfg.DNSServer, cfg.DNSResolvConf = "kvroute-peers.test:gossip", server, ""
		cfg.GossipListen, cfg.GossipName = addrs[i], fmt.Sprintf("replica-%d", i)
		if err := cfg.Validate(); err != nil {
			t.Fatal(err)
		}
		rt, _ := startRouter(t, cfg)
		rts = append(rts, rt)
	}
	deadline := time.Now().Add(15 * time.Second) // a deadlock guard, not a speed assertion
	for rts[0].Mesh.Members() != 1 || rts[1].Mesh.Members() != 1 || rts[0].Mesh.Ready() != nil || rts[1].Mesh.Ready() != nil {
		if time.Now().After(deadline) {
			t.Fatalf("replicas did not meet through the service: %+v / %+v", rts[0].Mesh.Status(), rts[1].Mesh.Status())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Gossip configuration errors are reported by Validate with the flags:
// plaintext off loopback, a bad peer, a bad key file, gossip without the
// prefix policy.
func TestGossipConfig(t *testing.T) {
	for name, set := range map[string]func(*Config){
		"plaintext off loopback": func(c *Config) { c.Peers, c.GossipListen = []string{"10.0.0.2:7946"}, ":7946" },
		"bad peer":               func(c *Config) { c.Peers, c.GossipListen = []string{"kvroute-1"}, "127.0.0.1:7946" },
		"missing key file":       func(c *Config) { c.Peers, c.GossipKeyFile = []string{"10.0.0.2:7946"}, "/nonexistent/key" },
		"bad peers service": func(c *Config) {
			c.PeersService, c.DNSServer, c.GossipListen = "kvroute peers:7946", "127.0.0.1:53", "127.0.0.1:7946"
		},
	} {
		c := DefaultConfig()
		c.Backends = []string{"http://127.0.0.1:9"}
		set(&c)
		if err := c.Validate(); err == nil {
			t.Errorf("%s: validated", name)
		}
	}
	c := DefaultConfig()
	c.Backends, c.Policy, c.Peers, c.GossipListen = []string{"http://127.0.0.1:9"}, "round-robin", []string{"127.0.0.1:7947"}, "127.0.0.1:0"
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if _, err := New(c, nil); err == nil || !strings.Contains(err.Error(), "--policy prefix") {
		t.Errorf("gossip under round-robin: %v", err)
	}
}
