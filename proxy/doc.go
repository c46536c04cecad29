// Package proxy is kvroute's data plane: a fasthttp server that reads each
// request once, parses inference bodies into a routing.Request, asks a
// Picker for an endpoint, forwards the request, and streams the response
// back with a flush per chunk. It owns retries, the mapping of failures to
// statuses, header hygiene, the access log and the admin listener.
package proxy
