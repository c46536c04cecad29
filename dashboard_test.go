package main

// The Grafana dashboard deploy/grafana/kvroute.json queries only metrics
// kvroute exports: every PromQL expression in it (panel targets, nested
// rows' panels, template variable queries) is parsed with Prometheus's own
// parser, and every metric it selects must be in testdata/metrics.golden
// (read at test time) or be one of the Go runtime and process metrics the
// router registers, with labels that metric has, counters under rate() or
// increase(), and histograms through their _bucket, _sum and _count series.

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/prometheus/promql/parser"
)

const (
	dashboardFile = "deploy/grafana/kvroute.json"
	metricsGolden = "testdata/metrics.golden"
)

// dashTargetLabels are the labels Prometheus attaches to every series of a
// scraped pod (job and instance always; namespace, pod and container with
// the usual Kubernetes service discovery relabelling).
var dashTargetLabels = []string{"job", "instance", "namespace", "pod", "container"}

// dashRequired are the metrics the dashboard must chart (the operator's
// questions: hit ratio, latency, throughput, routing, endpoints, PD
// stages, errors, learned costs, build).
var dashRequired = []string{
	"llm_router_cache_hit_ratio", "kvroute_prefix_engine_cached_tokens_total", "kvroute_routed_prompt_tokens_total",
	"kvroute_time_to_first_byte_seconds", "llm_request_e2e_seconds", "kvroute_requests_total",
	"kvroute_routing_decisions_total", "kvroute_endpoint_in_flight_requests", "llm_decode_kv_cache_usage_percent",
	"kvroute_discovery_endpoints", "kvroute_pd_prefill_leg_seconds", "llm_prefill_queue_seconds",
	"kvroute_pd_handoff_to_first_byte_seconds", "kvroute_pd_decisions_total", "kvroute_upstream_errors_total",
	"kvroute_retries_total", "kvroute_retries_budget_exhausted_total", "kvroute_overload_rejections_total",
	"kvroute_endpoint_prefill_tokens_per_second", "kvroute_build_info",
}

// dashMetric is one exported metric family.
type dashMetric struct {
	Type   string // counter, gauge, histogram, summary, untyped
	Labels []string
}

// dashLoadMetrics reads testdata/metrics.golden and adds the Go runtime and
// process collectors' families, registered as the router registers them.
func dashLoadMetrics(t *testing.T) map[string]dashMetric {
	t.Helper()
	data, err := os.ReadFile(metricsGolden)
	if err != nil {
		t.Fatalf("%s: %v (the list of every metric kvroute exports)", metricsGolden, err)
	}
	out := map[string]dashMetric{}
	for i, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		if len(f) != 3 {
			t.Fatalf("%s:%d: %q: want \"name type labels\"", metricsGolden, i+1, line)
		}
		var labels []string
		if f[2] != "-" {
			labels = strings.Split(f[2], ",")
		}
		if !slices.Contains([]string{"counter", "gauge", "histogram", "summary", "untyped"}, f[1]) {
			t.Fatalf("%s:%d: unknown type %q", metricsGolden, i+1, f[1])
		}
		out[f[0]] = dashMetric{Type: f[1], Labels: labels}
	}
	if len(out) == 0 {
		t.Fatalf("%s lists no metric", metricsGolden)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		m := dashMetric{Type: strings.ToLower(mf.GetType().String())}
		if mf.GetType() == dto.MetricType_GAUGE_HISTOGRAM {
			m.Type = "histogram"
		}
		for _, s := range mf.GetMetric() {
			for _, l := range s.GetLabel() {
				if !slices.Contains(m.Labels, l.GetName()) {
					m.Labels = append(m.Labels, l.GetName())
				}
			}
		}
		if _, ok := out[mf.GetName()]; !ok {
			out[mf.GetName()] = m
		}
	}
	return out
}

// dashResolve maps a selected series name to its family: a histogram's
// name_bucket, name_sum and name_count belong to name.
func dashResolve(metrics map[string]dashMetric, name string) (family string, m dashMetric, suffix string, ok bool) {
	if m, ok := metrics[name]; ok {
		return name, m, "", true
	}
	for _, suf := range []string{"_bucket", "_sum", "_count"} {
		if base, cut := strings.CutSuffix(name, suf); cut {
			if m, ok := metrics[base]; ok && (m.Type == "histogram" || (m.Type == "summary" && suf != "_bucket")) {
				return base, m, suf, true
			}
		}
	}
	return "", dashMetric{}, "", false
}

// dashQuery is one PromQL expression of the dashboard and where it is.
type dashQuery struct {
	Where, Expr, Legend string
	// LabelOf, for a label_values(expr, label) variable query, is label.
	LabelOf string
}

// dashPanels returns every panel, the panels nested in rows included.
func dashPanels(panels []any) []map[string]any {
	var out []map[string]any
	for _, p := range panels {
		pm, ok := p.(map[string]any)
		if !ok {
			continue
		}
		out = append(out, pm)
		if nested, ok := pm["panels"].([]any); ok {
			out = append(out, dashPanels(nested)...)
		}
	}
	return out
}

var (
	dashRangeVars = regexp.MustCompile(`\$\{?__(rate_interval|interval|range|range_ms|range_s|interval_ms)\}?`)
	dashVarRef    = regexp.MustCompile(`\$\{([A-Za-z_]\w*)(?::[^}]*)?\}|\$([A-Za-z_]\w*)|\[\[([A-Za-z_]\w*)\]\]`)
	dashLegendVar = regexp.MustCompile(`\{\{\s*([A-Za-z_]\w*)\s*\}\}`)
	dashLabelVals = regexp.MustCompile(`(?s)^\s*label_values\((.*),\s*([A-Za-z_]\w*)\s*\)\s*$`)
	dashQueryRes  = regexp.MustCompile(`(?s)^\s*query_result\((.*)\)\s*$`)
)

// dashSubstitute replaces Grafana's variables with valid PromQL: range
// variables with a duration, the others (inside label matcher strings)
// with a word. It returns the variables the expression refers to.
func dashSubstitute(expr string) (string, []string) {
	expr = dashRangeVars.ReplaceAllString(expr, "5m")
	var vars []string
	expr = dashVarRef.ReplaceAllStringFunc(expr, func(m string) string {
		sm := dashVarRef.FindStringSubmatch(m)
		vars = append(vars, sm[1]+sm[2]+sm[3])
		return "placeholder"
	})
	return expr, vars
}

// dashLoad reads the dashboard and collects its expressions.
func dashLoad(t *testing.T) (dash map[string]any, queries []dashQuery, vars map[string]map[string]any) {
	t.Helper()
	data, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(strings.NewReader(string(data)))
	if err := dec.Decode(&dash); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	vars = map[string]map[string]any{}
	if tpl, ok := dash["templating"].(map[string]any); ok {
		list, _ := tpl["list"].([]any)
		for _, v := range list {
			vm, _ := v.(map[string]any)
			name, _ := vm["name"].(string)
			vars[name] = vm
			if vm["type"] != "query" {
				continue
			}
			q := vm["query"]
			if qm, ok := q.(map[string]any); ok {
				q = qm["query"]
			}
			qs, _ := q.(string)
			where := "variable $" + name
			switch {
			case dashLabelVals.MatchString(qs):
				sm := dashLabelVals.FindStringSubmatch(qs)
				queries = append(queries, dashQuery{Where: where, Expr: sm[1], LabelOf: sm[2]})
			case dashQueryRes.MatchString(qs):
				queries = append(queries, dashQuery{Where: where, Expr: dashQueryRes.FindStringSubmatch(qs)[1]})
			default:
				t.Errorf("%s: query %q: want label_values(EXPR, LABEL) or query_result(EXPR)", where, qs)
			}
		}
	}
	panels, _ := dash["panels"].([]any)
	for _, p := range dashPanels(panels) {
		title, _ := p["title"].(string)
		targets, _ := p["targets"].([]any)
		for i, tg := range targets {
			tm, _ := tg.(map[string]any)
			expr, _ := tm["expr"].(string)
			legend, _ := tm["legendFormat"].(string)
			if expr == "" {
				t.Errorf("panel %q target %d has no expr", title, i)
				continue
			}
			queries = append(queries, dashQuery{Where: fmt.Sprintf("panel %q target %v", title, tm["refId"]), Expr: expr, Legend: legend})
		}
	}
	return dash, queries, vars
}

// dashCountersOK are the functions a counter (or a histogram's series)
// may be an argument of, through a range selector.
var dashCountersOK = []string{"rate", "irate", "increase"}

// dashCheckExpr checks one parsed expression against the exported metrics
// and returns the families it selects.
func dashCheckExpr(expr parser.Expr, metrics map[string]dashMetric) (families []string, errs []string) {
	bad := func(format string, a ...any) { errs = append(errs, fmt.Sprintf(format, a...)) }
	parser.Inspect(expr, func(node parser.Node, path []parser.Node) error {
		switch n := node.(type) {
		case *parser.VectorSelector:
			name := n.Name
			if name == "" {
				bad("selector %s names no metric", n)
				return nil
			}
			family, m, suffix, ok := dashResolve(metrics, name)
			if !ok {
				bad("%s is not a metric kvroute exports (%s)", name, metricsGolden)
				return nil
			}
			families = append(families, family)
			if m.Type == "histogram" && suffix == "" {
				bad("%s is a histogram: select %s_bucket, _sum or _count", name, name)
			}
			allowed := append(slices.Clone(m.Labels), dashTargetLabels...)
			if suffix == "_bucket" {
				allowed = append(allowed, "le")
			}
			for _, lm := range n.LabelMatchers {
				if lm.Name != "__name__" && !slices.Contains(allowed, lm.Name) {
					bad("%s has no label %q (it has %v)", name, lm.Name, m.Labels)
				}
			}
			counter := m.Type == "counter" || m.Type == "histogram" || (m.Type == "summary" && suffix != "")
			var call *parser.Call
			if len(path) >= 2 {
				if _, isMatrix := path[len(path)-1].(*parser.MatrixSelector); isMatrix {
					call, _ = path[len(path)-2].(*parser.Call)
				}
			}
			inRate := call != nil && slices.Contains(dashCountersOK, call.Func.Name)
			switch {
			case counter && !inRate:
				bad("%s is a counter: use it under rate() or increase()", name)
			case !counter && inRate:
				bad("%s is a %s: %s() of it means nothing", name, m.Type, call.Func.Name)
			}
		case *parser.Call:
			if n.Func.Name == "histogram_quantile" && len(n.Args) == 2 {
				if !slices.Contains(dashOutputLabels(n.Args[1], metrics), "le") {
					bad("histogram_quantile over %s: its argument must keep the le label (sum by (le, ...))", n.Args[1])
				}
			}
		case *parser.AggregateExpr:
			if n.Without {
				return nil
			}
			have := dashOutputLabels(n.Expr, metrics)
			for _, g := range n.Grouping {
				if !slices.Contains(have, g) {
					bad("%s by (%s): no selected series has the label %q", n.Op, strings.Join(n.Grouping, ", "), g)
				}
			}
		}
		return nil
	})
	return families, errs
}

// dashOutputLabels approximates the labels of an expression's result.
func dashOutputLabels(e parser.Expr, metrics map[string]dashMetric) []string {
	switch n := e.(type) {
	case *parser.VectorSelector:
		_, m, suffix, ok := dashResolve(metrics, n.Name)
		if !ok {
			return nil
		}
		out := append(slices.Clone(m.Labels), dashTargetLabels...)
		if suffix == "_bucket" {
			out = append(out, "le")
		}
		return out
	case *parser.MatrixSelector:
		return dashOutputLabels(n.VectorSelector, metrics)
	case *parser.ParenExpr:
		return dashOutputLabels(n.Expr, metrics)
	case *parser.UnaryExpr:
		return dashOutputLabels(n.Expr, metrics)
	case *parser.StepInvariantExpr:
		return dashOutputLabels(n.Expr, metrics)
	case *parser.SubqueryExpr:
		return dashOutputLabels(n.Expr, metrics)
	case *parser.AggregateExpr:
		if n.Without {
			return slices.DeleteFunc(dashOutputLabels(n.Expr, metrics), func(l string) bool { return slices.Contains(n.Grouping, l) })
		}
		return n.Grouping
	case *parser.Call:
		var out []string
		for _, a := range n.Args {
			out = append(out, dashOutputLabels(a, metrics)...)
		}
		if n.Func.Name == "histogram_quantile" {
			out = slices.DeleteFunc(out, func(l string) bool { return l == "le" })
		}
		return out
	case *parser.BinaryExpr:
		if l := dashOutputLabels(n.LHS, metrics); len(l) > 0 {
			return l
		}
		return dashOutputLabels(n.RHS, metrics)
	}
	return nil
}

// TestDashboardQueriesUseExportedMetrics is the dashboard's contract with
// metrics.golden (see the file comment).
func TestDashboardQueriesUseExportedMetrics(t *testing.T) {
	metrics := dashLoadMetrics(t)
	_, queries, vars := dashLoad(t)
	if len(queries) < 20 {
		t.Fatalf("%s: only %d PromQL expressions found", dashboardFile, len(queries))
	}
	p := parser.NewParser(parser.Options{})
	used := map[string]bool{}
	for _, q := range queries {
		src, refs := dashSubstitute(q.Expr)
		for _, v := range refs {
			if _, ok := vars[v]; !ok {
				t.Errorf("%s: $%s is no template variable of the dashboard", q.Where, v)
			}
		}
		expr, err := p.ParseExpr(src)
		if err != nil {
			t.Errorf("%s: %q does not parse: %v", q.Where, q.Expr, err)
			continue
		}
		families, errs := dashCheckExpr(expr, metrics)
		for _, e := range errs {
			t.Errorf("%s: %s\n\t%s", q.Where, e, q.Expr)
		}
		for _, f := range families {
			used[f] = true
		}
		out := dashOutputLabels(expr, metrics)
		if q.LabelOf != "" && !slices.Contains(out, q.LabelOf) {
			t.Errorf("%s: label_values(..., %s): the expression has no label %s", q.Where, q.LabelOf, q.LabelOf)
		}
		for _, m := range dashLegendVar.FindAllStringSubmatch(q.Legend, -1) {
			if !slices.Contains(out, m[1]) {
				t.Errorf("%s: legend {{%s}}: the result has no such label (it has %v)", q.Where, m[1], out)
			}
		}
	}
	for _, name := range dashRequired {
		if _, ok := metrics[name]; !ok {
			t.Errorf("%s, which the dashboard must chart, is missing from %s", name, metricsGolden)
		} else if !used[name] {
			t.Errorf("no panel charts %s", name)
		}
	}
	var unused []string
	for name := range maps.Keys(metrics) {
		if !used[name] && (strings.HasPrefix(name, "kvroute_") || strings.HasPrefix(name, "llm_")) {
			unused = append(unused, name)
		}
	}
	slices.Sort(unused)
	t.Logf("exported but not charted: %v", unused)
}

// TestDashboardModel checks the JSON model itself: a Prometheus datasource
// variable every panel and target uses, unique panel ids, and a layout.
func TestDashboardModel(t *testing.T) {
	dash, _, vars := dashLoad(t)
	if v, _ := dash["schemaVersion"].(float64); v < 36 {
		t.Errorf("schemaVersion %v: want 36 or later (datasource references by uid)", dash["schemaVersion"])
	}
	for _, k := range []string{"title", "uid"} {
		if s, _ := dash[k].(string); s == "" {
			t.Errorf("dashboard has no %s", k)
		}
	}
	ds := vars["datasource"]
	if ds == nil || ds["type"] != "datasource" || ds["query"] != "prometheus" {
		t.Errorf("want a template variable datasource of type datasource, query prometheus; got %v", ds)
	}
	dsRef := func(where string, v any) {
		m, _ := v.(map[string]any)
		if uid, _ := m["uid"].(string); uid != "${datasource}" && uid != "$datasource" {
			t.Errorf("%s: datasource %v, want {type: prometheus, uid: ${datasource}}", where, v)
		}
	}
	for name, v := range vars {
		if v["type"] == "query" {
			dsRef("variable $"+name, v["datasource"])
		}
	}
	panels, _ := dash["panels"].([]any)
	all := dashPanels(panels)
	ids := map[float64]string{}
	charts := 0
	for _, p := range all {
		title, _ := p["title"].(string)
		id, ok := p["id"].(float64)
		if !ok {
			t.Errorf("panel %q has no id", title)
		} else if other, dup := ids[id]; dup {
			t.Errorf("panels %q and %q share id %v", other, title, id)
		}
		ids[id] = title
		if gp, ok := p["gridPos"].(map[string]any); !ok || gp["w"] == nil || gp["h"] == nil {
			t.Errorf("panel %q has no gridPos", title)
		}
		if p["type"] == "row" || p["type"] == "text" {
			continue
		}
		charts++
		if title == "" {
			t.Errorf("panel %v has no title", id)
		}
		dsRef(fmt.Sprintf("panel %q", title), p["datasource"])
		targets, _ := p["targets"].([]any)
		if len(targets) == 0 {
			t.Errorf("panel %q has no targets", title)
		}
		refs := map[string]bool{}
		for _, tg := range targets {
			tm, _ := tg.(map[string]any)
			if d, ok := tm["datasource"]; ok {
				dsRef(fmt.Sprintf("panel %q target", title), d)
			}
			ref, _ := tm["refId"].(string)
			if ref == "" || refs[ref] {
				t.Errorf("panel %q: refId %q missing or repeated", title, ref)
			}
			refs[ref] = true
		}
	}
	if charts < 15 {
		t.Errorf("%d panels: the dashboard is missing charts", charts)
	}
}

// TestDashboardCheckerRejects makes sure the checks above fail on what they
// should.
func TestDashboardCheckerRejects(t *testing.T) {
	metrics := map[string]dashMetric{
		"kvroute_requests_total":             {Type: "counter", Labels: []string{"class", "code"}},
		"kvroute_time_to_first_byte_seconds": {Type: "histogram", Labels: []string{"class"}},
		"kvroute_in_flight_requests":         {Type: "gauge"},
	}
	p := parser.NewParser(parser.Options{})
	for expr, want := range map[string]string{
		`sum(rate(kvroute_requests_total{job=~"$job"}[$__rate_interval]))`:                                         "",
		`histogram_quantile(0.9, sum by (le) (rate(kvroute_time_to_first_byte_seconds_bucket[$__rate_interval])))`: "",
		`kvroute_requests_total`:                                                                                      "counter",
		`sum(rate(kvroute_request_total[5m]))`:                                                                        "not a metric",
		`sum(rate(kvroute_requests_total{model="x"}[5m]))`:                                                            "no label",
		`rate(kvroute_in_flight_requests[5m])`:                                                                        "gauge",
		`rate(kvroute_time_to_first_byte_seconds[5m])`:                                                                "histogram",
		`histogram_quantile(0.9, sum by (class) (rate(kvroute_time_to_first_byte_seconds_bucket[5m])))`:               "le label",
		`sum by (endpoint) (kvroute_in_flight_requests)`:                                                              "no selected series",
		`sum(rate(kvroute_time_to_first_byte_seconds_sum{le="1"}[5m]))`:                                               "no label",
		`sum(rate(kvroute_time_to_first_byte_seconds_count[5m])) / sum(rate(kvroute_requests_total{code="200"}[5m]))`: "",
	} {
		src, _ := dashSubstitute(expr)
		e, err := p.ParseExpr(src)
		if err != nil {
			t.Errorf("%s: %v", expr, err)
			continue
		}
		_, errs := dashCheckExpr(e, metrics)
		got := strings.Join(errs, "; ")
		if (want == "") != (got == "") || !strings.Contains(got, want) {
			t.Errorf("%s: errors %q, want %q", expr, got, want)
		}
	}
	if _, err := os.Stat(filepath.FromSlash(dashboardFile)); err != nil {
		t.Error(err)
	}
}
