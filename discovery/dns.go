package discovery

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/miekg/dns"
)

// Sentinel errors of DNS discovery.
var (
	// ErrBadService: a service spec is not NAME[:PORT].
	ErrBadService = errors.New("discovery: bad service spec")
	// ErrDNS: no nameserver gave an answer (timeout, SERVFAIL, REFUSED).
	ErrDNS = errors.New("discovery: DNS lookup failed")
	// ErrNoRecords: the name exists nowhere on the search path, or has no
	// address. kvroute treats it as an outage and keeps the last good
	// endpoints rather than dropping them all.
	ErrNoRecords = errors.New("discovery: no DNS records")
)

// DNSConfig configures one headless-Service DNS source. A zero field takes
// its default.
type DNSConfig struct {
	// Service is NAME[:PORT]. NAME is resolved as a pod's resolver does it
	// (search domains and ndots of ResolvConf), e.g. "vllm" or
	// "vllm.ns.svc.cluster.local". PORT is numeric (default 8000, vLLM's),
	// or a named Service port, in which case the SRV records
	// _PORT._tcp.NAME give the targets and their ports.
	Service string
	// Role is the role of the endpoints found.
	Role Role
	// Scheme is "http" (default) or "https".
	Scheme string
	// BasePath is prepended to every forwarded path ("" for none).
	BasePath string
	// ResolvConf is the resolver configuration file whose nameservers,
	// search domains, ndots and attempts are used, normally
	// "/etc/resolv.conf". "" reads none: NAME is then absolute and Server
	// is required. A nameserver written host:port (not valid in glibc)
	// is accepted, for tests.
	ResolvConf string
	// Server, host[:port] (port 53 by default), replaces ResolvConf's
	// nameservers.
	Server string
	// IPFamily chooses the address records: "" (A records, or AAAA ones
	// when a name has no A record; a dual-stack Service is not counted
	// twice), "ipv4" (A only) or "ipv6" (AAAA only).
	IPFamily string
	// Interval is the longest time between two lookups. Default 5 s, the
	// TTL CoreDNS's kubernetes plugin gives Service records. Records with
	// a shorter TTL are looked up again when it expires.
	Interval time.Duration
	// MinInterval is the shortest time between two lookups, whatever the
	// TTL (0 s TTLs are common), and the first retry delay after a
	// failure; retries double up to Interval. Default 1 s.
	MinInterval time.Duration
	// Timeout of one query to one nameserver. Default 2 s.
	Timeout time.Duration

	// defaultPort replaces DefaultServicePort (NewResolver).
	defaultPort uint16
}

// Defaults of DNSConfig.
const (
	DefaultDNSInterval    = 5 * time.Second
	DefaultDNSMinInterval = time.Second
	DefaultDNSTimeout     = 2 * time.Second
	// DefaultServicePort is vLLM's default port.
	DefaultServicePort = 8000
	// dnsUDPSize is the EDNS0 buffer size advertised (the DNS flag day 2020
	// value, safe from fragmentation); larger answers come over TCP.
	dnsUDPSize = 1232
)

// dnsSource resolves one service. It is used by one goroutine at a time.
type dnsSource struct {
	cfg      DNSConfig
	name     string // NAME of the spec
	port     uint16 // numeric PORT, 0 with a named port
	portName string // named PORT
	servers  []string
	search   []string
	ndots    int
	attempts int
	udp, tcp *dns.Client
}

// newDNSSource validates c and reads its resolver configuration.
func newDNSSource(c DNSConfig) (*dnsSource, error) {
	c.Scheme = orDefault(c.Scheme, "http")
	c.Interval = orDefault(c.Interval, DefaultDNSInterval)
	c.MinInterval = orDefault(c.MinInterval, DefaultDNSMinInterval)
	c.Timeout = orDefault(c.Timeout, DefaultDNSTimeout)
	d := &dnsSource{cfg: c, ndots: 1, attempts: 2}
	if err := d.parseService(c.Service); err != nil {
		return nil, err
	}
	switch {
	case c.Scheme != "http" && c.Scheme != "https":
		return nil, fmt.Errorf("%w: scheme %q: want http or https", ErrBadConfig, c.Scheme)
	case c.IPFamily != "" && c.IPFamily != "ipv4" && c.IPFamily != "ipv6":
		return nil, fmt.Errorf("%w: IP family %q: want ipv4, ipv6 or empty", ErrBadConfig, c.IPFamily)
	case c.Interval < 0 || c.MinInterval < 0 || c.Timeout < 0 || c.MinInterval > c.Interval:
		return nil, fmt.Errorf("%w: DNS intervals and timeout must be positive, min interval at most interval", ErrBadConfig)
	case c.BasePath != "" && (c.BasePath[0] != '/' || strings.ContainsAny(c.BasePath, "?#")):
		return nil, fmt.Errorf("%w: base path %q must start with / and hold no query", ErrBadConfig, c.BasePath)
	}
	if c.ResolvConf != "" {
		cc, err := dns.ClientConfigFromFile(c.ResolvConf)
		if err != nil {
			return nil, fmt.Errorf("%w: %v", ErrBadConfig, err)
		}
		d.search, d.ndots, d.attempts = cc.Search, cc.Ndots, cc.Attempts
		for _, s := range cc.Servers {
			d.servers = append(d.servers, withPort(s, cc.Port))
		}
	}
	if c.Server != "" {
		d.servers = []string{withPort(c.Server, "53")}
	}
	if len(d.servers) == 0 {
		return nil, fmt.Errorf("%w: %s: no nameserver (set a resolv.conf or a server)", ErrBadConfig, c.Service)
	}
	d.attempts = max(d.attempts, 1)
	d.udp = &dns.Client{Net: "udp", Timeout: c.Timeout, UDPSize: dnsUDPSize}
	d.tcp = &dns.Client{Net: "tcp", Timeout: c.Timeout}
	return d, nil
}

// CheckService reports whether spec is a valid NAME[:PORT] service spec
// (ErrBadService wrapped when not), without looking it up.
func CheckService(spec string) error { return (&dnsSource{}).parseService(spec) }

// parseService splits NAME[:PORT].
func (d *dnsSource) parseService(spec string) error {
	name, port := spec, ""
	if i := strings.LastIndexByte(spec, ':'); i >= 0 {
		name, port = spec[:i], spec[i+1:]
		if port == "" {
			return fmt.Errorf("%w: %q: empty port", ErrBadService, spec)
		}
	}
	if name == "" || strings.ContainsAny(name, ":/ ") {
		return fmt.Errorf("%w: %q: want NAME[:PORT]", ErrBadService, spec)
	}
	if _, ok := dns.IsDomainName(name); !ok {
		return fmt.Errorf("%w: %q: bad DNS name", ErrBadService, spec)
	}
	d.name = name
	switch {
	case port == "" && d.cfg.defaultPort != 0:
		d.port = d.cfg.defaultPort
	case port == "":
		d.port = DefaultServicePort
	case port[0] >= '0' && port[0] <= '9':
		n, err := strconv.ParseUint(port, 10, 16)
		if err != nil || n == 0 {
			return fmt.Errorf("%w: %q: port must be 1-65535 or a port name", ErrBadService, spec)
		}
		d.port = uint16(n)
	default:
		// A Kubernetes port name (an IANA service name): at most 15
		// lower-case letters, digits and hyphens.
		if len(port) > 15 || strings.Trim(port, "abcdefghijklmnopqrstuvwxyz0123456789-") != "" {
			return fmt.Errorf("%w: %q: bad port name", ErrBadService, spec)
		}
		d.portName = port
	}
	return nil
}

// withPort returns host:port, adding port when s has none.
func withPort(s, port string) string {
	if _, _, err := net.SplitHostPort(s); err == nil {
		return s
	}
	return net.JoinHostPort(s, port)
}

// nameList is the names to try for name, in order (search path and ndots
// as glibc applies them).
func (d *dnsSource) nameList(name string) []string {
	cc := dns.ClientConfig{Search: d.search, Ndots: d.ndots}
	return cc.NameList(name)
}

// resolve looks the service up once and returns its endpoints (sorted by
// URL) and the smallest TTL of the records used.
func (d *dnsSource) resolve(ctx context.Context) ([]*Endpoint, time.Duration, error) {
	targets, ttl, err := d.targets(ctx)
	if err != nil {
		return nil, 0, err
	}
	eps := make([]*Endpoint, 0, len(targets))
	for _, t := range targets {
		u := d.cfg.Scheme + "://" + t.String() + d.cfg.BasePath
		e, err := NewEndpoint(u, d.cfg.Role)
		if err != nil {
			continue // cannot happen for an address and a port
		}
		eps = append(eps, e)
	}
	if len(eps) == 0 {
		return nil, 0, fmt.Errorf("%w: %s", ErrNoRecords, d.cfg.Service)
	}
	return eps, ttl, nil
}

// targets looks the service up once and returns its addresses and ports
// (none with port 0) and the smallest TTL of the records used.
func (d *dnsSource) targets(ctx context.Context) ([]netip.AddrPort, time.Duration, error) {
	var targets []netip.AddrPort
	add := func(addrs []netip.Addr, port uint16) {
		for _, a := range addrs {
			if port != 0 {
				targets = append(targets, netip.AddrPortFrom(a, port))
			}
		}
	}
	var ttl uint32
	if d.portName == "" {
		addrs, t, err := d.lookupAddrs(ctx, d.nameList(d.name))
		if err != nil {
			return nil, 0, err
		}
		ttl = t
		add(addrs, d.port)
	} else {
		srvs, msg, t, err := d.lookupSRV(ctx, d.nameList("_"+d.portName+"._tcp."+d.name))
		if err != nil {
			return nil, 0, err
		}
		ttl = t
		for _, srv := range srvs {
			addrs, t := d.additional(msg, srv.Target)
			if len(addrs) == 0 {
				var err error
				addrs, t, err = d.lookupAddrs(ctx, []string{dns.Fqdn(srv.Target)})
				if errors.Is(err, ErrNoRecords) {
					continue // a target without an address serves nothing
				}
				if err != nil {
					return nil, 0, err
				}
			}
			ttl = min(ttl, t)
			add(addrs, srv.Port)
		}
	}
	if len(targets) == 0 {
		return nil, 0, fmt.Errorf("%w: %s", ErrNoRecords, d.cfg.Service)
	}
	return targets, time.Duration(ttl) * time.Second, nil
}

// Resolver looks a headless Service's pods up as a DNS source does (the
// same resolver configuration, search path and SRV records for a named
// port), for a caller other than the fleet: the router replicas' gossip
// finds its peers with it. Safe for use by one goroutine at a time.
type Resolver struct{ d *dnsSource }

// NewResolver validates c (its Service, resolver and timeout; the
// intervals are the caller's) for a service whose port, when the spec
// names none, is port.
func NewResolver(c DNSConfig, port uint16) (*Resolver, error) {
	c.defaultPort = port
	d, err := newDNSSource(c)
	if err != nil {
		return nil, err
	}
	return &Resolver{d}, nil
}

// Lookup returns the service's pods as host:port, ErrNoRecords wrapped
// when it has none.
func (r *Resolver) Lookup(ctx context.Context) ([]string, error) {
	targets, _, err := r.d.targets(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]string, len(targets))
	for i, t := range targets {
		out[i] = t.String()
	}
	return out, nil
}

// lookupAddrs returns the addresses of the first name in names that has
// any, and their smallest TTL.
func (d *dnsSource) lookupAddrs(ctx context.Context, names []string) ([]netip.Addr, uint32, error) {
	for _, name := range names {
		var types []uint16
		switch d.cfg.IPFamily {
		case "ipv4":
			types = []uint16{dns.TypeA}
		case "ipv6":
			types = []uint16{dns.TypeAAAA}
		default:
			types = []uint16{dns.TypeA, dns.TypeAAAA}
		}
		for _, qt := range types {
			r, err := d.query(ctx, name, qt)
			if err != nil {
				return nil, 0, err
			}
			if r.Rcode == dns.RcodeNameError {
				break // the name does not exist: next name
			}
			addrs, ttl := addrsOf(r.Answer, qt)
			if len(addrs) > 0 {
				return addrs, ttl, nil
			}
		}
	}
	return nil, 0, fmt.Errorf("%w: %s", ErrNoRecords, d.cfg.Service)
}

// lookupSRV returns the SRV records of the first name in names that has
// any, the answer holding them (for its additional section) and the
// smallest TTL.
func (d *dnsSource) lookupSRV(ctx context.Context, names []string) ([]*dns.SRV, *dns.Msg, uint32, error) {
	for _, name := range names {
		r, err := d.query(ctx, name, dns.TypeSRV)
		if err != nil {
			return nil, nil, 0, err
		}
		var srvs []*dns.SRV
		ttl := uint32(1<<32 - 1)
		for _, rr := range r.Answer {
			ttl = min(ttl, rr.Header().Ttl)
			if s, ok := rr.(*dns.SRV); ok {
				srvs = append(srvs, s)
			}
		}
		if len(srvs) > 0 {
			return srvs, r, ttl, nil
		}
	}
	return nil, nil, 0, fmt.Errorf("%w: %s", ErrNoRecords, d.cfg.Service)
}

// additional returns the addresses msg's additional section gives for
// target (CoreDNS sends a headless Service's pod addresses there).
func (d *dnsSource) additional(msg *dns.Msg, target string) ([]netip.Addr, uint32) {
	var mine []dns.RR
	for _, rr := range msg.Extra {
		if strings.EqualFold(dns.Fqdn(rr.Header().Name), dns.Fqdn(target)) {
			mine = append(mine, rr)
		}
	}
	switch d.cfg.IPFamily {
	case "ipv4":
		return addrsOf(mine, dns.TypeA)
	case "ipv6":
		return addrsOf(mine, dns.TypeAAAA)
	}
	if a, ttl := addrsOf(mine, dns.TypeA); len(a) > 0 {
		return a, ttl
	}
	return addrsOf(mine, dns.TypeAAAA)
}

// addrsOf returns the addresses of the records of type qt in rrs (other
// records, e.g. the CNAMEs leading to them, count for the TTL only).
func addrsOf(rrs []dns.RR, qt uint16) ([]netip.Addr, uint32) {
	var addrs []netip.Addr
	ttl := uint32(1<<32 - 1)
	for _, rr := range rrs {
		var ip net.IP
		switch r := rr.(type) {
		case *dns.A:
			if qt == dns.TypeA {
				ip = r.A
			}
		case *dns.AAAA:
			if qt == dns.TypeAAAA {
				ip = r.AAAA
			}
		case *dns.CNAME:
		default:
			continue
		}
		ttl = min(ttl, rr.Header().Ttl)
		if a, ok := netip.AddrFromSlice(ip); ok {
			addrs = append(addrs, a.Unmap())
		}
	}
	return addrs, ttl
}

// query asks the nameservers in turn (for d.attempts rounds) and returns
// the first definite answer: NOERROR (possibly without records) or
// NXDOMAIN. A truncated UDP answer is asked again over TCP.
func (d *dnsSource) query(ctx context.Context, name string, qtype uint16) (*dns.Msg, error) {
	m := new(dns.Msg)
	m.SetQuestion(name, qtype)
	m.SetEdns0(dnsUDPSize, false)
	var last error
	for range d.attempts {
		for _, srv := range d.servers {
			r, err := d.exchange(ctx, m, srv)
			if err != nil {
				if ctx.Err() != nil {
					return nil, ctx.Err()
				}
				last = err
				continue
			}
			switch r.Rcode {
			case dns.RcodeSuccess, dns.RcodeNameError:
				return r, nil
			}
			last = fmt.Errorf("%s %s from %s: %s", name, dns.TypeToString[qtype], srv, dns.RcodeToString[r.Rcode])
		}
	}
	return nil, fmt.Errorf("%w: %v", ErrDNS, last)
}

// exchange sends m to srv over UDP, then over TCP if the answer was
// truncated.
func (d *dnsSource) exchange(ctx context.Context, m *dns.Msg, srv string) (*dns.Msg, error) {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.Timeout)
	defer cancel()
	r, _, err := d.udp.ExchangeContext(ctx, m, srv)
	if err == nil && r.Truncated {
		r, _, err = d.tcp.ExchangeContext(ctx, m, srv)
	}
	return r, err
}
