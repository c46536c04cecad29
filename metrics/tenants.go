package metrics

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// tenantMetrics are the per-tenant families. Tenant labels are bounded by
// the proxy (its first tenants by hash, the rest "other"); class is a
// service tier (priority, default, flex).
type tenantMetrics struct {
	tQueued   *prometheus.GaugeVec   // tenant
	tRequests *prometheus.CounterVec // tenant, class
	tShed     *prometheus.CounterVec // tenant, class, reason
	tWait     *prometheus.CounterVec // tenant
	tTokens   *prometheus.CounterVec // tenant, kind
	waitHist  *prometheus.HistogramVec
	tCache    sync.Map // label tuple → collector
}

func (m *Metrics) registerTenants(reg prometheus.Registerer) {
	t := &m.tenants
	t.tQueued = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: Namespace, Name: "tenant_queued_requests",
		Help: "Requests waiting in kvroute's queue, by tenant (a hash of its API key or tenant header; the first tenants seen, the rest as other).",
	}, []string{"tenant"})
	t.tRequests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "tenant_admitted_requests_total",
		Help: "Requests that went to the fleet, at once or from the queue, by tenant and class (service tier).",
	}, []string{"tenant", "class"})
	t.tShed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "tenant_shed_requests_total",
		Help: "Requests answered 429 from kvroute's queue, by tenant, class and reason: queue_full, tenant_full (the tenant's bound), timeout (waited --queue-timeout), evicted (a higher class took its place).",
	}, []string{"tenant", "class", "reason"})
	t.tWait = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "tenant_queue_wait_seconds_total",
		Help: "Seconds requests waited in kvroute's queue before they went to the fleet, by tenant.",
	}, []string{"tenant"})
	t.tTokens = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "tenant_tokens_total",
		Help: "Tokens of answered inference requests as the engines reported them (usage), by tenant and kind: prompt, cached, output.",
	}, []string{"tenant", "kind"})
	t.waitHist = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: Namespace, Name: "queue_wait_seconds",
		Help:    "Time requests that waited in kvroute's queue waited before they went to the fleet, by class.",
		Buckets: latencyBuckets,
	}, []string{"class"})
	reg.MustRegister(t.tQueued, t.tRequests, t.tShed, t.tWait, t.tTokens, t.waitHist)
	// The default tenant's series start at 0, so that rate() and alerts
	// see them before the first overload.
	t.tQueued.WithLabelValues("default")
	t.tRequests.WithLabelValues("default", "default")
	t.tShed.WithLabelValues("default", "default", "timeout")
	t.tWait.WithLabelValues("default")
	for _, k := range []string{"prompt", "cached", "output"} {
		t.tTokens.WithLabelValues("default", k)
	}
	t.waitHist.WithLabelValues("default")
}

type tenantKey struct{ fam, a, b, c string }

func (t *tenantMetrics) counter(vec *prometheus.CounterVec, fam string, labels ...string) prometheus.Counter {
	k := tenantKey{fam: fam}
	ls := []*string{&k.a, &k.b, &k.c}
	for i, l := range labels {
		*ls[i] = l
	}
	if c, ok := t.tCache.Load(k); ok {
		return c.(prometheus.Counter)
	}
	c, _ := t.tCache.LoadOrStore(k, vec.WithLabelValues(labels...))
	return c.(prometheus.Counter)
}

// TenantQueued moves the requests waiting in the queue by d, tenant's
// and in all.
func (m *Metrics) TenantQueued(tenant string, d float64) {
	m.queued.Add(d)
	m.tenants.tQueued.WithLabelValues(tenant).Add(d)
}

// TenantAdmitted counts a request of tenant and class that went to the
// fleet after waiting wait seconds in the queue (0: it did not wait).
func (m *Metrics) TenantAdmitted(tenant, class string, wait float64, queued bool) {
	t := &m.tenants
	t.counter(t.tRequests, "r", tenant, class).Inc()
	if queued {
		t.counter(t.tWait, "w", tenant).Add(wait)
		t.waitHist.WithLabelValues(class).Observe(wait)
	}
}

// TenantShed counts a request of tenant and class answered 429 from the
// queue for reason.
func (m *Metrics) TenantShed(tenant, class, reason string) {
	t := &m.tenants
	t.counter(t.tShed, "s", tenant, class, reason).Inc()
}

// TenantTokens counts an answered request's tokens for tenant.
func (m *Metrics) TenantTokens(tenant string, prompt, cached, output int) {
	t := &m.tenants
	t.counter(t.tTokens, "t", tenant, "prompt").Add(float64(prompt))
	t.counter(t.tTokens, "t", tenant, "cached").Add(float64(cached))
	t.counter(t.tTokens, "t", tenant, "output").Add(float64(output))
}
