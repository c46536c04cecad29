// Package app is kvroute's composition root: the whole router's
// configuration (Config, DefaultConfig, Validate, which names the
// command-line flags), the building of its parts from it (New: discovery
// over the pools, the routing policy, the data-plane server of package
// proxy, engine truth from the engines' KV events, the Prometheus
// registry, the OTLP exporter), the admin listener's handler, and Run,
// which serves and drains. Engine truth is kvevents.EngineTruth, run
// beside discovery; the proxy gets its tokenizer as a proxy.Tokenizer.
// main.go binds flags to Config (Flags groups them); the benchmark builds
// routers the same way.
package app

import (
	"github.com/kvroute/kvroute/kvevents"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/proxy"
	"github.com/kvroute/kvroute/routing"
)

// The interfaces the parts wired here meet, checked at compile time where
// the types are chosen (New) rather than at each use.
var (
	_ routing.Picker  = (*routing.Prefix)(nil)
	_ proxy.Learner   = (*routing.Prefix)(nil)
	_ proxy.Explainer = (*routing.Prefix)(nil)
	_ proxy.Tunable   = (*routing.Prefix)(nil)
	_ proxy.Tokenizer = (*kvevents.Tokenizer)(nil)
	_ kvevents.Linker = (*prefix.Truth)(nil)
	_ kvevents.Sink   = (*kvevents.EngineTruth)(nil)
)
