// Package bench measures kvroute the way the field measures LLM serving:
// a load generator speaking the OpenAI API to any base URL (kvroute, one
// pod, a real vLLM deployment), seeded workloads (SGLang's generated shared
// prefix, vLLM's multi-turn, random, hot prefix, Mooncake trace replay),
// vLLM `bench serve` metrics, and a scenario runner that starts a simulated
// fleet (bench/sim) and an in-process kvroute per routing policy, drives the
// same workload through each, and writes tables, charts and raw results.
package bench

import (
	"errors"
	"fmt"
	"strings"
)

// Sentinel errors.
var (
	// ErrConfig is wrapped by every configuration error.
	ErrConfig = errors.New("bench: invalid config")
	// ErrTrace is wrapped by errors reading a Mooncake trace.
	ErrTrace = errors.New("bench: bad trace")
)

// API selects the OpenAI endpoint requests are sent to.
type API uint8

// APIs.
const (
	// APICompletions posts {"prompt": …} to /v1/completions.
	APICompletions API = iota
	// APIChat posts {"messages": […]} to /v1/chat/completions.
	APIChat
)

// String returns the API's flag spelling.
func (a API) String() string {
	if a == APIChat {
		return "chat"
	}
	return "completions"
}

// Path returns the API's request path.
func (a API) Path() string {
	if a == APIChat {
		return "/v1/chat/completions"
	}
	return "/v1/completions"
}

// MarshalText implements encoding.TextMarshaler.
func (a API) MarshalText() ([]byte, error) { return []byte(a.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (a *API) UnmarshalText(b []byte) error {
	v, err := ParseAPI(string(b))
	*a = v
	return err
}

// ParseAPI converts a flag value ("completions" or "chat") to an API.
func ParseAPI(s string) (API, error) {
	switch strings.ToLower(s) {
	case "completions", "completion", "":
		return APICompletions, nil
	case "chat":
		return APIChat, nil
	}
	return 0, fmt.Errorf("%w: unknown API %q (want completions or chat)", ErrConfig, s)
}

// mix hashes a seed and a few integers into a well-spread 64-bit value
// (SplitMix64's finaliser folded over the inputs), so every piece of a
// workload gets its own reproducible seed.
func mix(seed uint64, parts ...uint64) uint64 {
	x := splitmix(seed)
	for _, p := range parts {
		x = splitmix(x ^ splitmix(p+0x632be59bd9b4e019))
	}
	return x
}

func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}
