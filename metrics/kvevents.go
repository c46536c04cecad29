package metrics

import "github.com/prometheus/client_golang/prometheus"

// KVEventsSample is engine truth's state at a scrape: the KV-event
// subscriber's counters, the residency it built, the tokenizer's, and
// which source each endpoint's cache view is on.
type KVEventsSample struct {
	// Events by kind (stored, removed, cleared), batches, and batches that
	// did not decode; gaps in sequence numbers, batches replayed, resets
	// by cause (restart, gap, lost), batches from unknown publishers.
	Events                  map[string]uint64
	Batches, DecodeErrors   uint64
	Gaps, Replayed          uint64
	Resets                  map[string]uint64
	UnmatchedTopics         uint64
	Blocks                  [3]int // token blocks held, by tier: gpu, cpu, storage
	Links, Bytes            int
	Confirmed, Dropped      uint64 // index blocks confirmed by stores or links; dropped by removals
	Orphans                 uint64 // stored blocks whose parent block was unknown
	Tokenized, TokenizeFail uint64
	TokenizeDropped         uint64
	// Sources is, per endpoint URL, whether its cache view is on engine
	// truth (events) or learned from routing.
	Sources map[string]bool
}

// RegisterKVEvents reports engine truth through read at each scrape.
func RegisterKVEvents(reg prometheus.Registerer, read func() KVEventsSample) {
	reg.MustRegister(&kvEventsCollector{read: read})
}

var (
	descKVEvents = prometheus.NewDesc(Namespace+"_kv_events_total",
		"KV-cache events received from the engines, by kind (stored, removed, cleared).", []string{"kind"}, nil)
	descKVBatches = prometheus.NewDesc(Namespace+"_kv_event_batches_total",
		"KV-cache event batches received from the engines.", nil, nil)
	descKVDecodeErrors = prometheus.NewDesc(Namespace+"_kv_event_decode_errors_total",
		"KV-cache event batches that did not decode (dropped).", nil, nil)
	descKVGaps = prometheus.NewDesc(Namespace+"_kv_event_gaps_total",
		"Gaps in an engine's event sequence numbers.", nil, nil)
	descKVReplayed = prometheus.NewDesc(Namespace+"_kv_event_replayed_batches_total",
		"Missed event batches recovered from an engine's replay endpoint.", nil, nil)
	descKVResets = prometheus.NewDesc(Namespace+"_kv_event_resets_total",
		"Times an endpoint's engine truth was reset, by cause: restart (the engine restarted: its cache is empty), gap (missed events replay could not fill), lost (the publisher went away).", []string{"cause"}, nil)
	descKVUnmatched = prometheus.NewDesc(Namespace+"_kv_event_unmatched_batches_total",
		"Event batches whose topic names no discovered endpoint (dropped).", nil, nil)
	descKVBlocks = prometheus.NewDesc(Namespace+"_kv_truth_blocks",
		"Engine KV blocks the engines' events say they hold, by tier (gpu, cpu, storage).", []string{"tier"}, nil)
	descKVLinks = prometheus.NewDesc(Namespace+"_kv_truth_links",
		"Engine token blocks linked to prefix-index blocks (learned by tokenizing forwarded prompts).", nil, nil)
	descKVBytes = prometheus.NewDesc(Namespace+"_kv_truth_bytes",
		"Estimated heap bytes of engine truth (held blocks and links).", nil, nil)
	descKVConfirmed = prometheus.NewDesc(Namespace+"_kv_truth_confirmed_total",
		"Prefix-index blocks confirmed on an endpoint by its engine's stores.", nil, nil)
	descKVDropped = prometheus.NewDesc(Namespace+"_kv_truth_dropped_total",
		"Prefix-index claims dropped because the engine announced their eviction.", nil, nil)
	descKVOrphans = prometheus.NewDesc(Namespace+"_kv_truth_orphan_blocks_total",
		"Stored blocks ignored because their parent block was unknown (evicted, or stored before the subscription).", nil, nil)
	descTokenize = prometheus.NewDesc(Namespace+"_tokenize_requests_total",
		"Tokenize requests kvroute sent to engines off the request path, by outcome (ok, error), and offers dropped on a full queue (dropped).", []string{"outcome"}, nil)
	descKVSource = prometheus.NewDesc(Namespace+"_endpoint_kv_events_source",
		"1 while the endpoint's cache view is on engine truth (its KV events), 0 while it is learned from routing history.", []string{"endpoint"}, nil)
)

type kvEventsCollector struct{ read func() KVEventsSample }

func (c *kvEventsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descKVEvents, descKVBatches, descKVDecodeErrors, descKVGaps, descKVReplayed,
		descKVResets, descKVUnmatched, descKVBlocks, descKVLinks, descKVBytes, descKVConfirmed, descKVDropped,
		descKVOrphans, descTokenize, descKVSource} {
		ch <- d
	}
}

func (c *kvEventsCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.read()
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	for _, k := range []string{"stored", "removed", "cleared"} {
		counter(descKVEvents, s.Events[k], k)
	}
	counter(descKVBatches, s.Batches)
	counter(descKVDecodeErrors, s.DecodeErrors)
	counter(descKVGaps, s.Gaps)
	counter(descKVReplayed, s.Replayed)
	for _, k := range []string{"restart", "gap", "lost"} {
		counter(descKVResets, s.Resets[k], k)
	}
	counter(descKVUnmatched, s.UnmatchedTopics)
	for i, tier := range []string{"gpu", "cpu", "storage"} {
		gauge(descKVBlocks, float64(s.Blocks[i]), tier)
	}
	gauge(descKVLinks, float64(s.Links))
	gauge(descKVBytes, float64(s.Bytes))
	counter(descKVConfirmed, s.Confirmed)
	counter(descKVDropped, s.Dropped)
	counter(descKVOrphans, s.Orphans)
	counter(descTokenize, s.Tokenized, "ok")
	counter(descTokenize, s.TokenizeFail, "error")
	counter(descTokenize, s.TokenizeDropped, "dropped")
	for url, on := range s.Sources {
		v := 0.0
		if on {
			v = 1
		}
		gauge(descKVSource, v, url)
	}
}
