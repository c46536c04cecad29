package app

import (
	"context"
	"fmt"
	"net/url"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// The OTLP exporter behind --otlp-endpoint; the spans themselves are made
// on the data plane (proxy/tracing.go).

// otlpURL returns the OTLP/HTTP traces URL of endpoint: a base URL gets the
// signal's path, /v1/traces.
func otlpURL(endpoint string) (string, error) {
	u, err := url.Parse(endpoint)
	switch {
	case err != nil:
		return "", err
	case u.Scheme != "http" && u.Scheme != "https":
		return "", fmt.Errorf("%q: want an http:// or https:// URL of an OTLP/HTTP collector (e.g. http://otel-collector:4318)", endpoint)
	case u.Host == "":
		return "", fmt.Errorf("%q: no host", endpoint)
	}
	if u.Path == "" || u.Path == "/" {
		u.Path = "/v1/traces"
	}
	return u.String(), nil
}

// newTracerProvider exports spans to endpoint in batches, sampling
// ratio of new traces and following a sampled parent.
func newTracerProvider(endpoint string, ratio float64, version string) (*sdktrace.TracerProvider, error) {
	u, err := otlpURL(endpoint)
	if err != nil {
		return nil, err
	}
	exp, err := otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(u))
	if err != nil {
		return nil, fmt.Errorf("otlp exporter: %w", err)
	}
	attrs := []attribute.KeyValue{attribute.String("service.name", "kvroute")}
	if version != "" {
		attrs = append(attrs, attribute.String("service.version", version))
	}
	return sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(ratio))),
		sdktrace.WithResource(resource.NewSchemaless(attrs...)),
	), nil
}
