// Package discovery owns the model-server endpoints kvroute routes to: their
// identity, their live per-endpoint state (atomics only: counters, health,
// the engine's own load), and the immutable Set snapshots that a Fleet
// publishes through an atomic pointer from static lists and headless-Service
// DNS. Beside the request path, the Fleet probes /health, scrapes the
// engines' /metrics and drains endpoints that leave; the request path loads
// one Set per request and never locks. The engines' KV-cache events are
// package kvevents's, which follows a Pool; an endpoint's URL only names
// its publisher's port (Endpoint.KVEventsPort).
package discovery
