package kvevents

import (
	"context"
	"errors"
	"strings"
	"testing"
)

// TestParseEndpoint: ZeroMQ endpoints as vLLM and llm-d write them
// (tcp://host:port) and as host:port; other transports are refused with
// an error naming what is accepted.
func TestParseEndpoint(t *testing.T) {
	tests := []struct {
		name, endpoint string
		want           string // "" when refused
	}{
		{name: "host:port", endpoint: "127.0.0.1:5557", want: "127.0.0.1:5557"},
		{name: "tcp://", endpoint: "tcp://127.0.0.1:5557", want: "127.0.0.1:5557"},
		{name: "tcp:// with a name", endpoint: "tcp://kvroute.ns.svc:5557", want: "kvroute.ns.svc:5557"},
		{name: "tcp:// IPv6", endpoint: "tcp://[::1]:5557", want: "[::1]:5557"},
		{name: "tcp:// every interface", endpoint: "tcp://*:5557", want: ":5557"},
		{name: "every interface", endpoint: "*:5557", want: ":5557"},
		{name: "empty host", endpoint: ":5557", want: ":5557"},
		{name: "any port", endpoint: "tcp://127.0.0.1:0", want: "127.0.0.1:0"},
		{name: "ipc", endpoint: "ipc:///tmp/kv-events"},
		{name: "inproc", endpoint: "inproc://kv-events"},
		{name: "TCP in capitals", endpoint: "TCP://127.0.0.1:5557"},
		{name: "http", endpoint: "http://127.0.0.1:5557"},
		{name: "no port", endpoint: "tcp://127.0.0.1"},
		{name: "no port, no scheme", endpoint: "nowhere"},
		{name: "empty", endpoint: ""},
		{name: "tcp:// alone", endpoint: "tcp://"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseEndpoint(tt.endpoint)
			if tt.want == "" {
				if !errors.Is(err, ErrBadEndpoint) {
					t.Fatalf("ParseEndpoint(%q) = %q, %v; want ErrBadEndpoint", tt.endpoint, got, err)
				}
				if !strings.Contains(err.Error(), "want tcp://HOST:PORT or HOST:PORT") {
					t.Fatalf("error %q does not say what is accepted", err)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("ParseEndpoint(%q) = %q, %v; want %q", tt.endpoint, got, err, tt.want)
			}
		})
	}
}

// TestSubscriberListenEndpoint: the subscriber binds a tcp:// endpoint
// and refuses another transport as a bad configuration.
func TestSubscriberListenEndpoint(t *testing.T) {
	pool, _ := kvPool(t)
	s := runKVSub(t, Config{Listen: "tcp://127.0.0.1:0"}, pool, newTestSink(), nil)
	if addr := recv(t, s.bound, "the listener").String(); !strings.HasPrefix(addr, "127.0.0.1:") {
		t.Fatalf("bound %s", addr)
	}
	err := NewSubscriber(Config{Listen: "ipc:///tmp/kv-events"}, pool, newTestSink(), nil).Run(context.Background())
	if !errors.Is(err, ErrBadConfig) || !errors.Is(err, ErrBadEndpoint) {
		t.Fatalf("Run: %v, want ErrBadConfig and ErrBadEndpoint", err)
	}
}
