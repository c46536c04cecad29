package metrics

import "github.com/prometheus/client_golang/prometheus"

// PeersSample is the replicas' gossip at one scrape (peers.Stats).
type PeersSample struct {
	Members                                         int   // live replicas besides this one
	SentMessages, SentBytes                         int64 // gossip messages sent (one per peer) and their bytes
	ReceivedMessages, ReceivedBytes                 int64
	Merged, Unknown, Mismatched, Dropped, BadFormat int64 // placements (or messages) by outcome
	States, Imported                                int64 // peers' states merged (push/pull) and the claims they added
	ImportedHomes                                   int64 // the prompt homes they added
	Links                                           int64 // engine truth's links they sent, merged
}

// RegisterPeers reports the replicas' gossip through read at each scrape.
func RegisterPeers(reg prometheus.Registerer, read func() PeersSample) {
	reg.MustRegister(&peersCollector{read: read})
}

var (
	descPeers        = prometheus.NewDesc(Namespace+"_peers", "Live router replicas this one gossips with (besides itself).", nil, nil)
	descPeerMessages = prometheus.NewDesc(Namespace+"_peer_messages_total", "Gossip datagrams (placements and load), by direction (one per peer sent to).", []string{"direction"}, nil)
	descPeerBytes    = prometheus.NewDesc(Namespace+"_peer_bytes_total", "Bytes of gossip datagrams (placements and load), by direction.", []string{"direction"}, nil)
	descPeerStates   = prometheus.NewDesc(Namespace+"_peer_states_total", "Peers' whole states (their prefix index, at a join and every 30 s) merged into this replica's.", nil, nil)
	descPeerImported = prometheus.NewDesc(Namespace+"_peer_state_claims_total", "Claims (a block on an endpoint) that peers' states added to this replica's prefix index.", nil, nil)
	descPeerHomes    = prometheus.NewDesc(Namespace+"_peer_state_homes_total", "Prompt homes (a prompt key on the endpoint it is homed on) that peers' states added to this replica's, for keys it did not know.", nil, nil)
	descPeerLinks    = prometheus.NewDesc(Namespace+"_peer_links_total", "Links of engine truth (a block of the prefix index and its last token block in the engines' KV events) that peers learned by tokenizing the prompts they forwarded and sent to this replica.", nil, nil)
	descPeerOutcomes = prometheus.NewDesc(Namespace+"_peer_placements_total", "Peers' placements (or whole messages, for mismatched, dropped and malformed) by what became of them: merged into the index, unknown_endpoint (not an endpoint of this replica), mismatched (another hashing configuration), dropped (no room), malformed.", []string{"outcome"}, nil)
)

type peersCollector struct{ read func() PeersSample }

func (c *peersCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descPeers
	ch <- descPeerMessages
	ch <- descPeerBytes
	ch <- descPeerOutcomes
	ch <- descPeerStates
	ch <- descPeerImported
	ch <- descPeerHomes
	ch <- descPeerLinks
}

func (c *peersCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.read()
	ch <- prometheus.MustNewConstMetric(descPeers, prometheus.GaugeValue, float64(s.Members))
	for _, d := range []struct {
		dir             string
		messages, bytes int64
	}{{"sent", s.SentMessages, s.SentBytes}, {"received", s.ReceivedMessages, s.ReceivedBytes}} {
		ch <- prometheus.MustNewConstMetric(descPeerMessages, prometheus.CounterValue, float64(d.messages), d.dir)
		ch <- prometheus.MustNewConstMetric(descPeerBytes, prometheus.CounterValue, float64(d.bytes), d.dir)
	}
	for _, o := range []struct {
		name string
		v    int64
	}{{"merged", s.Merged}, {"unknown_endpoint", s.Unknown}, {"mismatched", s.Mismatched}, {"dropped", s.Dropped}, {"malformed", s.BadFormat}} {
		ch <- prometheus.MustNewConstMetric(descPeerOutcomes, prometheus.CounterValue, float64(o.v), o.name)
	}
	ch <- prometheus.MustNewConstMetric(descPeerStates, prometheus.CounterValue, float64(s.States))
	ch <- prometheus.MustNewConstMetric(descPeerImported, prometheus.CounterValue, float64(s.Imported))
	ch <- prometheus.MustNewConstMetric(descPeerHomes, prometheus.CounterValue, float64(s.ImportedHomes))
	ch <- prometheus.MustNewConstMetric(descPeerLinks, prometheus.CounterValue, float64(s.Links))
}
