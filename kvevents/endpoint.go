package kvevents

import (
	"errors"
	"fmt"
	"net"
	"strings"
)

// ErrBadEndpoint is wrapped by ParseEndpoint's errors.
var ErrBadEndpoint = errors.New("kvevents: bad ZeroMQ endpoint")

// ParseEndpoint returns the TCP address (host:port, for net.Listen or
// net.Dial) of a ZeroMQ endpoint written as ZeroMQ writes it,
// "tcp://host:port" (vLLM's and llm-d's configurations), or as
// "host:port". Host "*" is every interface, as in libzmq's bind
// ("tcp://*:5557" is ":5557"). Other transports (ipc://, inproc://, ...)
// are refused: kvroute speaks ZMTP over TCP only.
func ParseEndpoint(endpoint string) (string, error) {
	addr := endpoint
	if scheme, rest, ok := strings.Cut(endpoint, "://"); ok {
		if scheme != "tcp" {
			return "", fmt.Errorf("%w %q: transport %s:// is not supported, want tcp://HOST:PORT or HOST:PORT",
				ErrBadEndpoint, endpoint, scheme)
		}
		addr = rest
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("%w %q: want tcp://HOST:PORT or HOST:PORT: %v", ErrBadEndpoint, endpoint, err)
	}
	if host == "*" {
		host = ""
	}
	return net.JoinHostPort(host, port), nil
}
