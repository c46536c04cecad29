package discovery

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// rawDNS is a nameserver on 127.0.0.1 (UDP and TCP, one port) that answers
// every query with the same bytes, whatever they are, with the query's id
// written over the first two.
type rawDNS struct {
	addr   string
	answer atomic.Pointer[[]byte]
	pc     net.PacketConn
	ln     net.Listener
	wg     sync.WaitGroup
}

func startRawDNS(tb testing.TB) *rawDNS {
	tb.Helper()
	s := &rawDNS{}
	for range 20 { // a port free for both UDP and TCP
		pc, err := net.ListenPacket("udp", "127.0.0.1:0")
		if err != nil {
			tb.Fatal(err)
		}
		if ln, err := net.Listen("tcp", pc.LocalAddr().String()); err == nil {
			s.pc, s.ln = pc, ln
			break
		}
		pc.Close()
	}
	if s.pc == nil {
		tb.Fatal("no port free for both UDP and TCP")
	}
	s.addr = s.pc.LocalAddr().String()
	s.wg.Add(2)
	go s.serveUDP()
	go s.serveTCP()
	tb.Cleanup(func() {
		s.pc.Close()
		s.ln.Close()
		s.wg.Wait()
	})
	return s
}

// reply is the answer to query: the fuzzed bytes with query's id.
func (s *rawDNS) reply(query []byte) []byte {
	a := *s.answer.Load()
	out := append([]byte(nil), a...)
	if len(out) >= 2 && len(query) >= 2 {
		copy(out[:2], query[:2])
	}
	return out
}

func (s *rawDNS) serveUDP() {
	defer s.wg.Done()
	buf := make([]byte, 64<<10)
	for {
		n, from, err := s.pc.ReadFrom(buf)
		if err != nil {
			return
		}
		_, _ = s.pc.WriteTo(s.reply(buf[:n]), from)
	}
}

func (s *rawDNS) serveTCP() {
	defer s.wg.Done()
	var conns sync.WaitGroup
	defer conns.Wait()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		conns.Go(func() {
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			for {
				var l [2]byte
				if _, err := readFull(c, l[:]); err != nil {
					return
				}
				q := make([]byte, binary.BigEndian.Uint16(l[:]))
				if _, err := readFull(c, q); err != nil {
					return
				}
				r := s.reply(q)
				if len(r) > 65535 {
					r = r[:65535]
				}
				out := binary.BigEndian.AppendUint16(nil, uint16(len(r)))
				if _, err := c.Write(append(out, r...)); err != nil {
					return
				}
			}
		})
	}
}

func readFull(c net.Conn, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		k, err := c.Read(b[n:])
		n += k
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// packed returns m packed, for the seeds.
func packed(tb testing.TB, m *dns.Msg) []byte {
	b, err := m.Pack()
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

func mustRR(tb testing.TB, s string) dns.RR {
	rr, err := dns.NewRR(s)
	if err != nil {
		tb.Fatal(err)
	}
	return rr
}

// FuzzDNSAnswer feeds DNS answers (packed messages, any bytes) to a
// service's resolution: dnsSource.resolve, the function that turns a
// nameserver's answers into endpoints, over a real UDP/TCP exchange on
// 127.0.0.1. mode picks the service form (numeric port or named port, SRV)
// and the IP family. resolve must not panic, must fail only with its
// sentinel errors, and must return usable endpoints (a valid address, a
// non-zero port) when it succeeds.
func FuzzDNSAnswer(f *testing.F) {
	const svc = "vllm.ns.svc.cluster.local."
	answer := func(rcode int, rrs []string, extra []string, mut func(*dns.Msg)) []byte {
		m := new(dns.Msg)
		m.SetQuestion(svc, dns.TypeA)
		m.Response, m.Authoritative, m.Rcode = true, true, rcode
		for _, s := range rrs {
			m.Answer = append(m.Answer, mustRR(f, s))
		}
		for _, s := range extra {
			m.Extra = append(m.Extra, mustRR(f, s))
		}
		if mut != nil {
			mut(m)
		}
		return packed(f, m)
	}
	seeds := [][]byte{
		answer(dns.RcodeSuccess, []string{svc + " 5 IN A 10.0.0.1", svc + " 5 IN A 10.0.0.2"}, nil, nil),
		answer(dns.RcodeSuccess, []string{svc + " 5 IN AAAA fd00::1", svc + " 30 IN AAAA ::ffff:10.0.0.9"}, nil, nil),
		answer(dns.RcodeSuccess, []string{svc + " 5 IN CNAME pods." + svc, "pods." + svc + " 1 IN A 10.0.0.3"}, nil, nil),
		answer(dns.RcodeSuccess, []string{"_http._tcp." + svc + " 5 IN SRV 0 50 8000 pod-a." + svc,
			"_http._tcp." + svc + " 5 IN SRV 0 50 0 pod-b." + svc},
			[]string{"pod-a." + svc + " 5 IN A 10.0.0.4", "POD-A." + svc + " 5 IN AAAA fd00::4"}, nil),
		answer(dns.RcodeSuccess, []string{"_http._tcp." + svc + " 5 IN SRV 0 50 8080 pod-c." + svc, svc + " 0 IN A 10.0.0.5"}, nil, nil),
		answer(dns.RcodeNameError, nil, nil, nil),
		answer(dns.RcodeServerFailure, nil, nil, nil),
		answer(dns.RcodeSuccess, nil, nil, func(m *dns.Msg) { m.Truncated = true }),
		answer(dns.RcodeSuccess, []string{svc + " 5 IN TXT \"10.0.0.1\"", svc + " 5 IN A 0.0.0.0"}, nil, nil),
		answer(dns.RcodeSuccess, []string{svc + " 4294967295 IN A 255.255.255.255"}, nil, func(m *dns.Msg) { m.Compress = true }),
		{},
		{0, 0},
		make([]byte, 12),
	}
	for _, s := range seeds {
		for mode := range uint8(6) {
			f.Add(mode, s)
		}
	}

	srv := startRawDNS(f)
	sources := map[uint8]*dnsSource{}
	for mode := range uint8(6) {
		service := svc[:len(svc)-1] + ":8000"
		if mode%2 == 1 {
			service = svc[:len(svc)-1] + ":http"
		}
		d, err := newDNSSource(DNSConfig{Service: service, Server: srv.addr, IPFamily: []string{"", "ipv4", "ipv6"}[mode/2],
			Timeout: 500 * time.Millisecond, Scheme: "http", BasePath: "/engine"})
		if err != nil {
			f.Fatal(err)
		}
		d.attempts = 1
		sources[mode] = d
	}

	f.Fuzz(func(t *testing.T, mode uint8, msg []byte) {
		if len(msg) > 4096 {
			return // larger answers only slow the exchange down
		}
		d := sources[mode%6]
		srv.answer.Store(&msg)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		eps, ttl, err := d.resolve(ctx)
		if err != nil {
			if len(eps) != 0 {
				t.Fatalf("endpoints %v with error %v", eps, err)
			}
			if !errors.Is(err, ErrNoRecords) && !errors.Is(err, ErrDNS) {
				t.Fatalf("resolve: unexpected error %v", err)
			}
			return
		}
		if len(eps) == 0 || ttl < 0 {
			t.Fatalf("%d endpoints, TTL %v, no error", len(eps), ttl)
		}
		for _, e := range eps {
			u, err := url.Parse(e.URL)
			if err != nil || u.Scheme != "http" || u.Path != "/engine" {
				t.Fatalf("endpoint URL %q: %v", e.URL, err)
			}
			ap, err := netip.ParseAddrPort(u.Host)
			if err != nil || ap.Port() == 0 || !ap.Addr().IsValid() || ap.Addr().Is4In6() {
				t.Fatalf("endpoint address %q: %v", u.Host, err)
			}
			if e.Addr != ap.String() || e.BasePath != "/engine" || e.Role != d.cfg.Role || e.TLS {
				t.Fatalf("endpoint %q: dials %q, base path %q, role %v, TLS %v", e.URL, e.Addr, e.BasePath, e.Role, e.TLS)
			}
		}
	})
}
