package routing

import (
	"math/rand/v2"
	"slices"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/prefix"
)

// Picker chooses the endpoint for a request from a Set. Implementations
// must be safe for concurrent use and must not retain r. The proxy calls
// Pick once per attempt; an attempt goes to d.Endpoint, or fails with 503
// when it is nil.
type Picker interface {
	Pick(r *Request, set *discovery.Set) Decision
}

// PolicyConfig is what the policies of the table are built from.
type PolicyConfig struct {
	// BlockBytes is the prefix hashing block size in bytes of the
	// canonical rendering (the proxy hashes with the same size).
	BlockBytes int
	// Index sizes the prefix policy's index.
	Index prefix.IndexConfig
	// Prefix are the prefix policy's parameters.
	Prefix PrefixParams
	// Intn is the source of randomness of the random and least-request
	// policies, safe for concurrent use; nil means math/rand/v2.IntN.
	Intn func(int) int
}

// NewPolicy builds a policy from a PolicyConfig.
type NewPolicy func(PolicyConfig) Picker

// Policies returns the table of kvroute's policies by name, a new map on
// every call so that a caller (the benchmark, with its peer baselines) may
// extend its copy.
func Policies() map[string]NewPolicy {
	return map[string]NewPolicy{
		"prefix": func(c PolicyConfig) Picker {
			return NewPrefix(prefix.NewIndex(c.Index), c.BlockBytes, c.Prefix)
		},
		"round-robin":   func(PolicyConfig) Picker { return NewRoundRobin() },
		"random":        func(c PolicyConfig) Picker { return NewRandom(c.Intn) },
		"least-request": func(c PolicyConfig) Picker { return NewLeastRequest(c.Intn) },
	}
}

// PolicyNames returns the names of a policy table, sorted.
func PolicyNames(table map[string]NewPolicy) []string {
	names := make([]string, 0, len(table))
	for n := range table {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

func intnOrDefault(intn func(int) int) func(int) int {
	if intn == nil {
		return rand.IntN
	}
	return intn
}
