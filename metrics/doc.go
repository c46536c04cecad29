// Package metrics holds kvroute's Prometheus collectors: one Metrics struct
// built from a prometheus.Registerer, with no package-global state. Hot-path
// label children are resolved once at construction so recording a request
// costs a few atomic adds.
package metrics
