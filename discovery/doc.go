// Package discovery owns the model-server endpoints kvroute routes to: their
// identity, their live per-endpoint state (atomics only: counters, health,
// the engine's own load), and the immutable Set snapshots that a Fleet
// publishes through an atomic pointer from static lists and headless-Service
// DNS. Beside the request path, the Fleet detects each endpoint's engine
// dialect (vLLM, SGLang, llama.cpp's llama-server, Ollama: dialect.go),
// probes its liveness the dialect's way, reads its models and capacity,
// scrapes the engines' /metrics where they have them and drains endpoints
// that leave; the request path loads one Set per request and never locks. The engines' KV-cache events are
// package kvevents's, which follows a Pool; an endpoint's URL only names
// its publisher's port (Endpoint.KVEventsPort).
package discovery
