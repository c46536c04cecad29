// Package discovery owns the model-server endpoints kvroute routes to: their
// identity, their live per-endpoint counters (atomics only), and the immutable
// Set snapshots that sources publish through an atomic pointer. The request
// path loads one Set per request and never locks.
package discovery

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync/atomic"
)

// ErrBadURL is returned for a backend URL kvroute cannot route to.
var ErrBadURL = errors.New("discovery: bad backend URL")

// Role is the part an endpoint plays in serving.
type Role uint8

// Roles. Mixed endpoints serve whole requests; prefill and decode endpoints
// serve one leg of a disaggregated request.
const (
	RoleMixed Role = iota
	RolePrefill
	RoleDecode
)

// String returns the role's flag spelling.
func (r Role) String() string {
	switch r {
	case RolePrefill:
		return "prefill"
	case RoleDecode:
		return "decode"
	default:
		return "mixed"
	}
}

// Endpoint is one model-server pod. Its identity fields are set once by
// NewEndpoint and never change; its counters are atomics, safe for concurrent
// use, and survive from one Set to the next for as long as the address stays.
type Endpoint struct {
	// URL is the base URL as configured, without a trailing slash
	// (e.g. "http://10.0.0.7:8000").
	URL string
	// Addr is host:port, the dial address.
	Addr string
	// TLS is true for https base URLs.
	TLS bool
	// BasePath is a path prefix prepended to every forwarded path ("" for none).
	BasePath string
	// Role is the endpoint's serving role.
	Role Role
	// ID is a stable 64-bit identity derived from URL (used by rendezvous
	// hashing so independent router replicas agree).
	ID uint64
	// InFlight is the number of requests kvroute has dispatched to this
	// endpoint and not yet finished (taken before dispatch, released on every
	// exit path).
	InFlight atomic.Int64
	// InFlightPrefill is the prompt tokens of this router's in-flight
	// requests that the endpoint still has to compute: added at pick time,
	// released at the first response byte (or on any earlier exit).
	InFlightPrefill atomic.Int64
	// Requests counts every request dispatched to this endpoint.
	Requests atomic.Uint64
	// Failures counts upstream failures (connection errors and 5xx).
	Failures atomic.Uint64
}

// NewEndpoint parses a base URL ("http://host:port[/base]", or "host:port",
// which means http) into an Endpoint with zeroed counters.
func NewEndpoint(raw string, role Role) (*Endpoint, error) {
	s := strings.TrimSpace(raw)
	if s == "" {
		return nil, fmt.Errorf("%w: empty", ErrBadURL)
	}
	if !strings.Contains(s, "://") {
		s = "http://" + s
	}
	u, err := url.Parse(s)
	if err != nil {
		return nil, fmt.Errorf("%w: %q: %v", ErrBadURL, raw, err)
	}
	var tls bool
	switch u.Scheme {
	case "http":
	case "https":
		tls = true
	default:
		return nil, fmt.Errorf("%w: %q: scheme must be http or https", ErrBadURL, raw)
	}
	if u.Host == "" || u.Hostname() == "" {
		return nil, fmt.Errorf("%w: %q: no host", ErrBadURL, raw)
	}
	if u.RawQuery != "" || u.Fragment != "" || u.User != nil {
		return nil, fmt.Errorf("%w: %q: query, fragment and user info are not allowed", ErrBadURL, raw)
	}
	port := u.Port()
	if port == "" {
		port = "80"
		if tls {
			port = "443"
		}
	}
	base := strings.TrimRight(u.EscapedPath(), "/")
	ep := &Endpoint{
		Addr:     net.JoinHostPort(u.Hostname(), port),
		TLS:      tls,
		BasePath: base,
		Role:     role,
	}
	ep.URL = u.Scheme + "://" + ep.Addr + base
	ep.ID = hashString(ep.URL)
	return ep, nil
}

// String returns the endpoint's URL.
func (e *Endpoint) String() string { return e.URL }

// hashString is FNV-1a 64, a fixed function so IDs agree across processes.
func hashString(s string) uint64 {
	h := uint64(14695981039346656037)
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= 1099511628211
	}
	return h
}
