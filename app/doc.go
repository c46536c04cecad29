// Package app is kvroute's composition root: the whole router's
// configuration (Config, DefaultConfig, Validate, which names the
// command-line flags), the building of its parts from it (New: discovery
// over the pools, the routing policy, the data-plane server of package
// proxy, engine truth from the engines' KV events, the Prometheus
// registry, the OTLP exporter), the admin listener's handler, and Run,
// which serves and drains. main.go binds flags to Config (Flags groups
// them); the benchmark builds routers the same way.
package app
