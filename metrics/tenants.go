package metrics

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// tenantMetrics are the per-tenant families. Tenant labels are bounded by
// the proxy (its busiest tenants by hash, the rest "other"); class is a
// service tier (priority, default, flex).
type tenantMetrics struct {
	tQueued   *prometheus.GaugeVec   // tenant
	tRunning  *prometheus.GaugeVec   // tenant
	tRequests *prometheus.CounterVec // tenant, class
	tShed     *prometheus.CounterVec // tenant, class, reason
	tWait     *prometheus.CounterVec // tenant
	tTokens   *prometheus.CounterVec // tenant, kind
	waitHist  *prometheus.HistogramVec
	reloads   *prometheus.CounterVec // result
	tCache    sync.Map               // tenant label → *tenantSeries
}

func (m *Metrics) registerTenants(reg prometheus.Registerer) {
	t := &m.tenants
	counters := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: name, Help: help}, labels)
	}
	t.tQueued = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: Namespace, Name: "tenant_queued_requests",
		Help: "Requests waiting in kvroute's queue, by tenant (a hash of its API key or tenant header; the busiest tenants, the rest as other).",
	}, []string{"tenant"})
	t.tRunning = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: Namespace, Name: "tenant_in_flight_requests",
		Help: "Inference requests that went to the fleet and have not ended, by tenant (a budget's max_concurrency bounds them).",
	}, []string{"tenant"})
	t.reloads = counters("tenant_budgets_reloads_total",
		"Changes of the --tenant-budgets file: ok put in force, error refused (the budgets in force stay).", "result")
	t.tRequests = counters("tenant_admitted_requests_total",
		"Inference requests that went to the fleet, at once or from the queue, by tenant and class (service tier).", "tenant", "class")
	t.tShed = counters("tenant_shed_requests_total",
		"Requests answered 429 by kvroute, by tenant, class and reason: queue_full, tenant_full (the tenant's bound), timeout (waited --queue-timeout), evicted (a higher class took its place), rate_limit (its budget's tokens or requests per minute).",
		"tenant", "class", "reason")
	t.tWait = counters("tenant_queue_wait_seconds_total",
		"Seconds requests waited in kvroute's queue before they went to the fleet, by tenant.", "tenant")
	t.tTokens = counters("tenant_tokens_total",
		"Tokens of answered inference requests as the engines reported them (usage), by tenant and kind: prompt, cached, output.", "tenant", "kind")
	t.waitHist = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: Namespace, Name: "queue_wait_seconds",
		Help:    "Time requests that waited in kvroute's queue waited before they went to the fleet, by class.",
		Buckets: latencyBuckets,
	}, []string{"class"})
	reg.MustRegister(t.tQueued, t.tRunning, t.tRequests, t.tShed, t.tWait, t.tTokens, t.waitHist, t.reloads)
	// The default tenant's series start at 0, so that rate() and alerts
	// see them before the first overload.
	t.tQueued.WithLabelValues("default")
	t.tRunning.WithLabelValues("default")
	t.reloads.WithLabelValues("ok")
	t.reloads.WithLabelValues("error")
	t.tRequests.WithLabelValues("default", "default")
	t.tShed.WithLabelValues("default", "default", "timeout")
	t.tWait.WithLabelValues("default")
	for _, k := range []string{"prompt", "cached", "output"} {
		t.tTokens.WithLabelValues("default", k)
	}
	t.waitHist.WithLabelValues("default")
}

// tenantSeries are one tenant's children of the per-tenant families,
// looked up once per tenant (the shed counters, rare, are looked up each
// time).
type tenantSeries struct {
	queued   prometheus.Gauge
	running  prometheus.Gauge
	admitted sync.Map // class → prometheus.Counter
	wait     prometheus.Counter
	prompt   prometheus.Counter
	cached   prometheus.Counter
	output   prometheus.Counter
}

func (t *tenantMetrics) series(tenant string) *tenantSeries {
	if v, ok := t.tCache.Load(tenant); ok {
		return v.(*tenantSeries)
	}
	s := &tenantSeries{queued: t.tQueued.WithLabelValues(tenant), running: t.tRunning.WithLabelValues(tenant), wait: t.tWait.WithLabelValues(tenant),
		prompt: t.tTokens.WithLabelValues(tenant, "prompt"), cached: t.tTokens.WithLabelValues(tenant, "cached"),
		output: t.tTokens.WithLabelValues(tenant, "output")}
	v, _ := t.tCache.LoadOrStore(tenant, s)
	return v.(*tenantSeries)
}

// TenantQueued moves the requests waiting in the queue by d, tenant's
// and in all.
func (m *Metrics) TenantQueued(tenant string, d float64) {
	m.queued.Add(d)
	m.tenants.series(tenant).queued.Add(d)
}

// TenantAdmitted counts a request of tenant and class that went to the
// fleet, after waiting wait seconds in the queue when queued.
func (m *Metrics) TenantAdmitted(tenant, class string, wait float64, queued bool) {
	t := &m.tenants
	s := t.series(tenant)
	c, ok := s.admitted.Load(class)
	if !ok {
		c, _ = s.admitted.LoadOrStore(class, t.tRequests.WithLabelValues(tenant, class))
	}
	c.(prometheus.Counter).Inc()
	if queued {
		s.wait.Add(wait)
		t.waitHist.WithLabelValues(class).Observe(wait)
	}
}

// DropTenant deletes tenant's series (a label the proxy gave another
// tenant, with nothing of its own queued or in flight).
func (m *Metrics) DropTenant(tenant string) {
	t := &m.tenants
	t.tCache.Delete(tenant)
	l := prometheus.Labels{"tenant": tenant}
	t.tQueued.DeletePartialMatch(l)
	t.tRunning.DeletePartialMatch(l)
	t.tRequests.DeletePartialMatch(l)
	t.tShed.DeletePartialMatch(l)
	t.tWait.DeletePartialMatch(l)
	t.tTokens.DeletePartialMatch(l)
}

// TenantShed counts a request of tenant and class answered 429 from the
// queue for reason.
func (m *Metrics) TenantShed(tenant, class, reason string) {
	m.tenants.tShed.WithLabelValues(tenant, class, reason).Inc()
}

// TenantTokens counts an answered request's tokens for tenant.
func (m *Metrics) TenantTokens(tenant string, prompt, cached, output int) {
	s := m.tenants.series(tenant)
	s.prompt.Add(float64(prompt))
	s.cached.Add(float64(cached))
	s.output.Add(float64(output))
}

// TenantInFlight moves tenant's requests in flight by d.
func (m *Metrics) TenantInFlight(tenant string, d float64) {
	m.tenants.series(tenant).running.Add(d)
}

// BudgetsReload counts a change of the budgets file, put in force (ok) or
// refused.
func (m *Metrics) BudgetsReload(ok bool) {
	r := "error"
	if ok {
		r = "ok"
	}
	m.tenants.reloads.WithLabelValues(r).Inc()
}
