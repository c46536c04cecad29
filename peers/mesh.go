package peers

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/zeebo/xxh3"
	"go.uber.org/zap"
)

// Config configures a Mesh.
type Config struct {
	// Name is this replica's name among its peers, unique ("": the host
	// name and a random suffix, so that a pod restarted under a new
	// address is a new member).
	Name string
	// Listen is the gossip address, host:port (TCP and UDP; port 0: any
	// free port, see Addr).
	Listen string
	// Advertise is the host:port peers reach this replica at ("": the
	// Listen address, or memberlist's pick of a private address when
	// Listen's host is unspecified).
	Advertise string
	// Seeds are other replicas' gossip addresses, host:port, joined at
	// the start and again whenever this replica finds itself alone; they
	// may include its own.
	Seeds []string
	// Lookup, when set, finds more seeds each time the replica is alone:
	// its peers' gossip addresses, host:port (a headless Service of
	// kvroute's pods; discovery.Resolver), this replica's own among them.
	Lookup func(ctx context.Context) ([]string, error)
	// Keys are the gossip keys (ReadKeys), the first the primary: every
	// message is encrypted and authenticated (AES-GCM). None means
	// plaintext, allowed only on loopback addresses.
	Keys [][]byte
	// Fingerprint is the hashing configuration (Fingerprint): replicas
	// whose block hashes could never match ignore each other's messages.
	Fingerprint uint32
	// SyncTimeout bounds how long Ready waits for the first join when
	// there are seeds (0: 10 s): the first replica of a fleet finds none.
	SyncTimeout time.Duration
	// Known reports whether id is one of this replica's endpoints: a
	// peer's placement on an endpoint this replica does not route to is
	// dropped.
	Known func(id uint64) bool
	// Record merges a peer's placement: endpoint id was sent a request
	// whose chain (or a piece of it, first block first) is hashes. It is
	// the prefix index's Record; hashes is only valid during the call.
	Record func(id uint64, hashes []uint64)
	// Export and Import carry the index's state to a replica that joins
	// (memberlist's push/pull, at the join and every 30 s after): Export
	// yields up to max claims (endpoint, block hash, age in seconds),
	// most recently used first; Import adds a peer's claims on one
	// endpoint into its free room (prefix.Index's). Without them no state
	// is exchanged.
	Export func(max int, yield func(id, h uint64, age uint32))
	Import func(id uint64, hashes []uint64, ages []uint32) int
	// ExportHomes and ImportHomes carry the prompts' homes the same way
	// (routing.Prefix's): ExportHomes yields up to max keys, most
	// recently used first, each with the endpoint it is homed on, whether
	// it recurs and its age; ImportHomes takes a peer's, oldest first,
	// and reports whether it added the key (a key it knows is its own).
	// A replica that joins so homes the prompts its index does not show
	// warm where its peers do, instead of placing them afresh.
	ExportHomes func(max int, yield func(key, id uint64, recurring bool, age uint32))
	ImportHomes func(key, id uint64, recurring bool, age uint32) bool
	// Load yields this replica's own requests in flight per endpoint
	// (never the peers' it was told of), sent to the peers every tenth
	// of a second when it changed; SetLoad is told, per endpoint, the
	// peers' requests in flight there, summed (0 once none is fresh).
	// Without them no load is exchanged.
	Load    func(yield func(id uint64, inFlight int64))
	SetLoad func(id uint64, peers int64)
	// Links takes the links a peer learned from the engines' tokens
	// (Linked's; prefix.Truth's PeerLinked): byte block blocks[i] ends at
	// the token block keyed tokens[i]; both are only valid during the
	// call. Without it (no engine events) no links are merged.
	Links func(blocks, tokens []uint64)
	// Sequences takes a conversation's turn a peer placed (Sequenced's;
	// routing's PeerSequenced) on an endpoint this replica routes to.
	// Without it none are merged.
	Sequences func(id, from, to uint64)
	// Outcomes takes what a peer's answers said of a sequence on an
	// endpoint this replica routes to (Outcome's; routing's PeerOutcome):
	// at that distance the engine still held it, or not. Without it none
	// are merged.
	Outcomes func(id uint64, distance int, held bool)
	// Logger receives memberlist's events and the mesh's (nil: none).
	Logger *zap.Logger
}

// DefaultPort is memberlist's (and so the gossip listener's) default port.
const DefaultPort = 7946

const (
	// flushEvery is how often placements go out: a burst's followers on
	// another replica see the first placement within it, well under a
	// cold prefill.
	flushEvery = 10 * time.Millisecond
	// maxPending bounds the hashes waiting for a flush (2 MB); beyond,
	// placements are dropped and counted (later ones heal the loss).
	maxPending = 256 << 10
	// maxPendingLinks bounds the links waiting for a flush (1 MB); beyond,
	// they are dropped and counted (the peers then tokenize the prompt
	// themselves when they forward it).
	maxPendingLinks = 64 << 10
	// maxPendingSeqs bounds the turns waiting for a flush (1.5 MB);
	// beyond, they are dropped and counted.
	maxPendingSeqs = 64 << 10
	// maxOutcomeDistance bounds a peer's outcome's distance (routing
	// tracks 32; a larger one is refused).
	maxOutcomeDistance = 1 << 10
	// maxRecent bounds the chains remembered as sent this second.
	maxRecent = 1 << 16
	// inbox is the received messages waiting to be merged; beyond it
	// they are dropped and counted (memberlist's receive loop never
	// waits for the merge).
	inbox = 4096
	// rejoinEvery is how often a replica alone tries its seeds again.
	rejoinEvery = 2 * time.Second
	// defaultSyncTimeout is Config.SyncTimeout's default.
	defaultSyncTimeout = 10 * time.Second
	// sharedFor is how long a replica that lost its last peer still
	// routes as one of several (Shared): every change of mode moves homes,
	// and a peer restarting is back within it.
	sharedFor = time.Minute
)

// Mesh is one replica's membership in its peers' gossip: it sends the
// placements this replica makes to every other replica and merges theirs
// into its index, so that a prefix placed by any replica is a warm route
// for all of them. New validates; Run joins and runs until its context
// ends. Safe for concurrent use.
type Mesh struct {
	cfg    Config
	sender uint64 // xxh3 of the name

	seeds       []string      // the seeds but this replica's own address (set by Run before start)
	others      atomic.Int64  // live members besides this one
	echo        atomic.Uint64 // Echo (math.Float64bits), once echoLearned
	echoLearned atomic.Bool
	rank        atomic.Int64 // Rank
	// ranked is when the rank was last computed, and of how many others
	// (Run's loop only).
	ranked       time.Time
	rankedOthers int
	joined       atomic.Bool  // a peer's state was merged since the start
	shared       atomic.Bool  // Shared
	alone        time.Time    // when the last peer left (Run's loop only)
	start        atomic.Int64 // Run's start, unix ns (0: not running)
	ml           atomic.Pointer[memberlist.Memberlist]
	bound        chan struct{} // closed once the listener is bound

	mu      sync.Mutex
	pending []pendingEntry // placements since the last flush
	flat    []uint64       // their hashes
	recent  map[uint64]int64
	spare   []uint64 // the flush's buffer
	spareP  []pendingEntry
	links   []uint64 // links since the last flush: block, token, block, token, …
	spareL  []uint64
	seqs    []uint64 // turns since the last flush: endpoint, from, to, …
	spareS  []uint64
	outs    []uint64 // outcomes since the last flush: endpoint, distance, held, …
	spareO  []uint64

	in chan []byte

	loads loads

	stats counters
}

type pendingEntry struct {
	endpoint   uint64
	start, end int
}

// counters are the mesh's traffic and merge counts (Stats).
type counters struct {
	sentMessages, sentBytes, receivedMessages, receivedBytes atomic.Int64
	merged, unknown, mismatched, dropped, decodeErrors       atomic.Int64
	links, sequences, outcomes                               atomic.Int64
	states, imported, importedHomes                          atomic.Int64
}

// Stats are a Mesh's figures since it started.
type Stats struct {
	// Members is the live replicas besides this one.
	Members int `json:"members"`
	// Echo is how many of the peers' requests one of this replica's is
	// taken to stand for until their gossip tells (Mesh.Echo).
	Echo float64 `json:"echo"`
	// Joined is whether a peer's state was ever merged.
	Joined bool `json:"joined"`
	// SentMessages and SentBytes count gossip messages sent (one per
	// peer), ReceivedMessages and ReceivedBytes those received.
	SentMessages     int64 `json:"sent_messages"`
	SentBytes        int64 `json:"sent_bytes"`
	ReceivedMessages int64 `json:"received_messages"`
	ReceivedBytes    int64 `json:"received_bytes"`
	// Merged counts peers' placements merged into the index; Unknown
	// those on an endpoint this replica does not route to; Mismatched
	// messages of a replica with another hashing configuration;
	// Dropped placements or messages dropped for want of room;
	// DecodeErrors messages refused as malformed.
	Merged       int64 `json:"merged"`
	Unknown      int64 `json:"unknown_endpoint"`
	Mismatched   int64 `json:"mismatched"`
	Dropped      int64 `json:"dropped"`
	DecodeErrors int64 `json:"decode_errors"`
	// Links counts peers' links merged (Config.Links).
	Links int64 `json:"links"`
	// Sequences counts peers' conversation turns merged (Config.Sequences).
	Sequences int64 `json:"sequences"`
	// Outcomes counts peers' sequence outcomes merged (Config.Outcomes).
	Outcomes int64 `json:"outcomes"`
	// States counts peers' states merged (push/pull), Imported the
	// claims they added to the index, ImportedHomes the homes.
	States        int64 `json:"states"`
	Imported      int64 `json:"imported_claims"`
	ImportedHomes int64 `json:"imported_homes"`
}

// Fingerprint is the hashing configuration's fingerprint: the block size,
// whether prompts are normalised, and render, a version of the request
// rendering that changes whenever hashes of the same request would.
func Fingerprint(blockBytes int, normalize bool, render string) uint32 {
	return uint32(xxh3.HashString("kvroute-peers/1 " + strconv.Itoa(blockBytes) + " " + strconv.FormatBool(normalize) + " " + render))
}

// New validates cfg (Check) and returns a mesh that is not running yet.
func New(cfg Config) (*Mesh, error) {
	if cfg.Record == nil || cfg.Known == nil {
		return nil, errors.New("gossip: no index to merge into")
	}
	if err := Check(cfg); err != nil {
		return nil, err
	}
	if cfg.Name == "" {
		h, _ := os.Hostname()
		var b [4]byte
		_, _ = rand.Read(b[:])
		cfg.Name = h + "-" + hex.EncodeToString(b[:])
	}
	if cfg.SyncTimeout <= 0 {
		cfg.SyncTimeout = defaultSyncTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	return &Mesh{cfg: cfg, sender: xxh3.HashString(cfg.Name), bound: make(chan struct{}),
		recent: make(map[uint64]int64), in: make(chan []byte, inbox)}, nil
}

// Check validates cfg's addresses, and refuses plaintext gossip off
// loopback: anyone who reached the port could join and claim placements.
func Check(cfg Config) error {
	host, _, err := splitHostPort(cfg.Listen)
	if err != nil {
		return fmt.Errorf("gossip listen address %q: %w", cfg.Listen, err)
	}
	if len(cfg.Keys) == 0 && !loopback(host) {
		return fmt.Errorf("gossip on %q without a key: anyone who reaches the port could join and claim placements; "+
			"give a key file (one base64 key of 16, 24 or 32 bytes a line, e.g. openssl rand -base64 32) or listen on a loopback address", cfg.Listen)
	}
	for _, s := range cfg.Seeds {
		if _, _, err := splitHostPort(s); err != nil {
			return fmt.Errorf("gossip peer %q: %w", s, err)
		}
	}
	if cfg.Advertise != "" {
		if _, _, err := splitHostPort(cfg.Advertise); err != nil {
			return fmt.Errorf("gossip advertise address %q: %w", cfg.Advertise, err)
		}
	}
	return nil
}

// splitHostPort splits a host:port whose port is a number (0 allowed).
func splitHostPort(s string) (string, int, error) {
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return "", 0, err
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		return "", 0, fmt.Errorf("port %q is not a number", port)
	}
	return host, int(p), nil
}

// loopback reports whether host is a loopback address or localhost.
func loopback(host string) bool {
	if host == "localhost" {
		return true
	}
	a, err := netip.ParseAddr(host)
	return err == nil && a.IsLoopback()
}

// Name is this replica's name among its peers.
func (m *Mesh) Name() string { return m.cfg.Name }

// Bound is closed once Run has bound the gossip listener.
func (m *Mesh) Bound() <-chan struct{} { return m.bound }

// Addr is the gossip address peers reach this replica at (after Bound).
func (m *Mesh) Addr() string {
	ml := m.ml.Load()
	if ml == nil {
		return ""
	}
	return ml.LocalNode().Address()
}

// Members is the live replicas besides this one.
func (m *Mesh) Members() int { return int(m.others.Load()) }

// Rank is this replica's place (0..Members) among the live replicas
// ordered by name: the same order on every replica that sees the same
// members, so that each can take its own turn where they would otherwise
// decide alike (routing's turnOf).
func (m *Mesh) Rank() int { return int(m.rank.Load()) }

// rankAmong returns name's place among the names of nodes in order (the
// number of names before it).
func rankAmong(name string, nodes []*memberlist.Node) int {
	n := 0
	for _, x := range nodes {
		if x.Name < name {
			n++
		}
	}
	return n
}

// Shared reports whether other replicas route to the same engines: a peer
// is live, or was within the last minute. One atomic load.
func (m *Mesh) Shared() bool { return m.shared.Load() }

// Ready reports whether the replica may take traffic: once it has merged a
// peer's state (memberlist's join merges it before the join returns), when
// it has no seeds but itself, or when SyncTimeout has passed since Run
// started (the first replica of a fleet has no one to meet).
// Once ready it stays so: a gossip outage never takes a router out of
// service.
func (m *Mesh) Ready() error {
	if m.joined.Load() || len(m.cfg.Seeds) == 0 && m.cfg.Lookup == nil {
		return nil
	}
	start := m.start.Load()
	if start == 0 {
		return errors.New("gossip: not started")
	}
	if len(m.seeds) == 0 && m.cfg.Lookup == nil || time.Since(time.Unix(0, start)) >= m.cfg.SyncTimeout {
		return nil
	}
	if m.cfg.Lookup != nil {
		return fmt.Errorf("gossip: joining peers %v and those of the peers' service (up to %s)", m.seeds, m.cfg.SyncTimeout)
	}
	return fmt.Errorf("gossip: joining peers %v (up to %s)", m.seeds, m.cfg.SyncTimeout)
}

// Stats returns the mesh's figures.
func (m *Mesh) Stats() Stats {
	c := &m.stats
	return Stats{Members: m.Members(), Echo: m.Echo(), Joined: m.joined.Load(),
		SentMessages: c.sentMessages.Load(), SentBytes: c.sentBytes.Load(),
		ReceivedMessages: c.receivedMessages.Load(), ReceivedBytes: c.receivedBytes.Load(),
		Merged: c.merged.Load(), Unknown: c.unknown.Load(), Mismatched: c.mismatched.Load(),
		Dropped: c.dropped.Load(), DecodeErrors: c.decodeErrors.Load(), Links: c.links.Load(), Sequences: c.sequences.Load(), Outcomes: c.outcomes.Load(),
		States: c.states.Load(), Imported: c.imported.Load(), ImportedHomes: c.importedHomes.Load()}
}

// Placed notes that this replica sent endpoint id a request whose chain is
// hashes, for the next flush to its peers. It is on the request path: one
// atomic load without peers; with them, a copy under a mutex. A chain
// already queued for the same endpoint within the same second is not
// queued again (a hot prefix costs one message a second, and the peers'
// index refreshes it as often as its own would).
func (m *Mesh) Placed(id uint64, hashes []uint64) {
	if len(hashes) == 0 || m.others.Load() == 0 {
		return
	}
	key := id ^ hashes[len(hashes)-1]
	now := time.Now().Unix()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.recent[key] == now {
		return
	}
	if len(m.flat)+len(hashes) > maxPending {
		m.stats.dropped.Add(1)
		return
	}
	if len(m.recent) >= maxRecent {
		clear(m.recent)
	}
	m.recent[key] = now
	start := len(m.flat)
	m.flat = append(m.flat, hashes...)
	m.pending = append(m.pending, pendingEntry{endpoint: id, start: start, end: len(m.flat)})
}

// Linked notes links this replica's engine truth learned (prefix.Truth's
// OnLinked): byte block blocks[i] ends at the token block keyed
// tokens[i]. They go to the peers with the next flush. Off the request
// path (the tokenizer's).
func (m *Mesh) Linked(blocks, tokens []uint64) {
	n := min(len(blocks), len(tokens))
	if n == 0 || m.others.Load() == 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.links)+2*n > 2*maxPendingLinks {
		m.stats.dropped.Add(1)
		return
	}
	for i := range n {
		m.links = append(m.links, blocks[i], tokens[i])
	}
}

// Sequenced notes that this replica sent endpoint id a turn whose prompt
// is marked to (routing's sequences), continuing the earlier prompt marked
// from (0: none), for the next flush. On the request path: one atomic load
// without peers.
func (m *Mesh) Sequenced(id, from, to uint64) {
	if m.others.Load() == 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.seqs) >= 3*maxPendingSeqs {
		m.stats.dropped.Add(1)
		return
	}
	m.seqs = append(m.seqs, id, from, to)
}

// Outcome notes what an answer said of a sequence on endpoint id
// (routing's sequences): at distance, the engine still held it or not,
// for the next flush, so that every replica learns from all the answers.
// Off the request path (an answer's end).
func (m *Mesh) Outcome(id uint64, distance int, held bool) {
	if m.others.Load() == 0 || distance < 0 {
		return
	}
	var h uint64
	if held {
		h = 1
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.outs) >= 3*maxPendingSeqs {
		m.stats.dropped.Add(1)
		return
	}
	m.outs = append(m.outs, id, uint64(distance), h)
}

// Run joins the seeds and gossips until ctx ends, then leaves the mesh
// (telling the peers at once) and shuts memberlist down.
func (m *Mesh) Run(ctx context.Context) error {
	ml, err := memberlist.Create(m.memberlistConfig())
	if err != nil {
		return fmt.Errorf("gossip: %w", err)
	}
	m.ml.Store(ml)
	self := ml.LocalNode().Address()
	for _, a := range m.cfg.Seeds {
		if a != self {
			m.seeds = append(m.seeds, a)
		}
	}
	m.start.Store(time.Now().UnixNano())
	close(m.bound)
	m.cfg.Logger.Info("gossip listening", zap.String("name", m.cfg.Name), zap.String("addr", ml.LocalNode().Address()),
		zap.Strings("peers", m.cfg.Seeds), zap.Bool("encrypted", len(m.cfg.Keys) > 0))
	var wg sync.WaitGroup
	wg.Go(func() { m.merge(ctx) })
	wg.Go(func() { m.join(ctx, ml) })
	t := time.NewTicker(flushEvery)
	defer t.Stop()
	for done := false; !done; {
		select {
		case <-ctx.Done():
			done = true
		case <-t.C:
			m.tick(ml)
			m.sendLoad(ml, time.Now())
		}
	}
	// Leave first (the peers learn at once), then shut down, which also
	// ends a join still waiting on an unreachable seed.
	err = errors.Join(ml.Leave(time.Second), ml.Shutdown())
	wg.Wait()
	return err
}

// tick counts the members, ranks this replica among them (when their
// number changed, else every second), tells whether the fleet is shared,
// and flushes the placements.
func (m *Mesh) tick(ml *memberlist.Memberlist) {
	others := max(ml.NumMembers()-1, 0)
	m.others.Store(int64(others))
	now := time.Now()
	if others != m.rankedOthers || now.Sub(m.ranked) >= time.Second {
		m.ranked, m.rankedOthers = now, others
		m.rank.Store(int64(rankAmong(m.cfg.Name, ml.Members())))
	}
	switch {
	case others > 0:
		m.alone = time.Time{}
		m.shared.Store(true)
	case m.alone.IsZero():
		m.alone = now
	case now.Sub(m.alone) >= sharedFor:
		m.shared.Store(false)
	}
	m.flush(ml)
}

// join joins the seeds (and those Lookup finds) at the start and again
// every rejoinEvery while this replica is alone. Once it has met a peer,
// memberlist's gossip tells it of every other.
func (m *Mesh) join(ctx context.Context, ml *memberlist.Memberlist) {
	if len(m.seeds) == 0 && m.cfg.Lookup == nil {
		return
	}
	t := time.NewTicker(rejoinEvery)
	defer t.Stop()
	logged := false
	self := ml.LocalNode().Address()
	for {
		if ml.NumMembers() < 2 {
			seeds, err := m.seeds, error(nil)
			if m.cfg.Lookup != nil {
				var found []string
				found, err = m.cfg.Lookup(ctx)
				seeds = slices.Clone(seeds)
				for _, a := range found {
					if a != self && !slices.Contains(seeds, a) {
						seeds = append(seeds, a)
					}
				}
			}
			if len(seeds) > 0 {
				_, err = ml.Join(seeds)
			}
			if err != nil && !logged && ml.NumMembers() < 2 && ctx.Err() == nil {
				m.cfg.Logger.Info("gossip: no peer reached yet; retrying", zap.Strings("peers", seeds), zap.Error(err))
				logged = true
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// flush sends the placements and links queued since the last flush to
// every other live member.
func (m *Mesh) flush(ml *memberlist.Memberlist) {
	m.mu.Lock()
	if len(m.pending) == 0 && len(m.links) == 0 && len(m.seqs) == 0 && len(m.outs) == 0 {
		m.mu.Unlock()
		return
	}
	pending, flat, links, seqs, outs := m.pending, m.flat, m.links, m.seqs, m.outs
	m.pending, m.flat, m.links, m.seqs, m.outs = m.spareP[:0], m.spare[:0], m.spareL[:0], m.spareS[:0], m.spareO[:0]
	m.mu.Unlock()
	h := header{sender: m.sender, fingerprint: m.cfg.Fingerprint}
	var msgs [][]byte
	if len(pending) > 0 {
		ps := make([]placement, len(pending))
		for i, p := range pending {
			ps[i] = placement{endpoint: p.endpoint, hashes: flat[p.start:p.end]}
		}
		msgs = encodePlacements(msgs, h, ps)
	}
	msgs = encodeLinks(msgs, h, links)
	msgs = encodeSequences(msgs, h, seqs)
	msgs = encodeOutcomes(msgs, h, outs)
	m.sendAll(ml, msgs)
	m.loads.placed = m.loads.placed || len(pending) > 0
	m.mu.Lock()
	m.spareP, m.spare, m.spareL, m.spareS, m.spareO = pending[:0], flat[:0], links[:0], seqs[:0], outs[:0]
	m.mu.Unlock()
}

// sendAll sends msgs to every other live member, as UDP datagrams.
func (m *Mesh) sendAll(ml *memberlist.Memberlist, msgs [][]byte) {
	self := ml.LocalNode().Name
	for _, n := range ml.Members() {
		if n.Name == self {
			continue
		}
		for _, b := range msgs {
			if err := ml.SendBestEffort(n, b); err != nil {
				m.stats.dropped.Add(1)
				continue
			}
			m.stats.sentMessages.Add(1)
			m.stats.sentBytes.Add(int64(len(b)))
		}
	}
}

// merge decodes the peers' messages and merges their placements into the
// index, and their load into the endpoints', until ctx ends.
func (m *Mesh) merge(ctx context.Context) {
	var sc scratch
	for {
		var b []byte
		select {
		case <-ctx.Done():
			return
		case b = <-m.in:
		}
		m.apply(b, &sc)
	}
}

// scratch are merge's reused buffers.
type scratch struct {
	ps             []placement
	flat           []uint64
	load           []loadEntry
	blocks, tokens []uint64
	seqs           []uint64
	placed         []loadEntry // a placements message's endpoints, each once
}

// apply merges one message.
func (m *Mesh) apply(b []byte, sc *scratch) {
	h, body, err := readHeader(b)
	switch {
	case err != nil:
		m.stats.decodeErrors.Add(1)
		return
	case h.sender == m.sender:
		return
	case h.fingerprint != m.cfg.Fingerprint:
		m.stats.mismatched.Add(1)
		return
	}
	switch h.kind {
	case kindPlacement:
		if sc.ps, sc.flat, err = decodePlacements(body, sc.ps, sc.flat); err != nil {
			break
		}
		sc.placed = sc.placed[:0]
		for _, p := range sc.ps {
			if !m.cfg.Known(p.endpoint) {
				m.stats.unknown.Add(1)
				continue
			}
			m.cfg.Record(p.endpoint, p.hashes)
			m.stats.merged.Add(1)
			if !slices.Contains(sc.placed, loadEntry{p.endpoint, 1}) {
				sc.placed = append(sc.placed, loadEntry{p.endpoint, 1})
			}
		}
		m.placedLoad(h.sender, sc.placed, time.Now())
	case kindLoad:
		if sc.load, err = decodeLoad(body, sc.load); err == nil {
			m.mergeLoad(h.sender, sc.load, time.Now())
		}
	case kindLinks:
		if sc.blocks, sc.tokens, err = decodeLinks(body, sc.blocks, sc.tokens); err == nil && m.cfg.Links != nil {
			m.cfg.Links(sc.blocks, sc.tokens)
			m.stats.links.Add(int64(len(sc.blocks)))
		}
	case kindSequences:
		if sc.seqs, err = decodeSequences(body, sc.seqs); err == nil && m.cfg.Sequences != nil {
			for i := 0; i < len(sc.seqs); i += 3 {
				if !m.cfg.Known(sc.seqs[i]) {
					m.stats.unknown.Add(1)
					continue
				}
				m.cfg.Sequences(sc.seqs[i], sc.seqs[i+1], sc.seqs[i+2])
				m.stats.sequences.Add(1)
			}
		}
	case kindOutcomes:
		if sc.seqs, err = decodeSequences(body, sc.seqs); err == nil && m.cfg.Outcomes != nil {
			for i := 0; i < len(sc.seqs); i += 3 {
				switch {
				case sc.seqs[i+1] >= maxOutcomeDistance || sc.seqs[i+2] > 1:
					m.stats.decodeErrors.Add(1)
					continue
				case !m.cfg.Known(sc.seqs[i]):
					m.stats.unknown.Add(1)
					continue
				}
				m.cfg.Outcomes(sc.seqs[i], int(sc.seqs[i+1]), sc.seqs[i+2] == 1)
				m.stats.outcomes.Add(1)
			}
		}
	default:
		err = fmt.Errorf("%w: kind %d", ErrBadMessage, h.kind)
	}
	if err != nil {
		m.stats.decodeErrors.Add(1)
	}
}

// receive takes a message from memberlist's receive loop: copied, never
// waited for.
func (m *Mesh) receive(b []byte) {
	m.stats.receivedMessages.Add(1)
	m.stats.receivedBytes.Add(int64(len(b)))
	c := make([]byte, len(b))
	copy(c, b)
	select {
	case m.in <- c:
	default:
		m.stats.dropped.Add(1)
	}
}

// memberlistConfig is memberlist's configuration for m: its LAN defaults
// (failure detection within seconds), m's name and addresses, the keys,
// and the delegate that carries the placements.
func (m *Mesh) memberlistConfig() *memberlist.Config {
	c := memberlist.DefaultLANConfig()
	c.Name = m.cfg.Name
	c.BindAddr, c.BindPort, _ = splitHostPort(m.cfg.Listen) // validated by New
	if c.BindAddr == "" {
		c.BindAddr = "0.0.0.0"
	}
	c.AdvertisePort = c.BindPort
	if m.cfg.Advertise != "" {
		c.AdvertiseAddr, c.AdvertisePort, _ = splitHostPort(m.cfg.Advertise)
	}
	if len(m.cfg.Keys) > 0 {
		// Validated by ParseKeys: NewKeyring cannot fail on them.
		c.Keyring, _ = memberlist.NewKeyring(m.cfg.Keys, m.cfg.Keys[0])
		c.GossipVerifyIncoming, c.GossipVerifyOutgoing = true, true
	}
	c.Delegate = delegate{m}
	c.LogOutput = logWriter{m.cfg.Logger.Named("memberlist")}
	return c
}

// delegate is memberlist's hook into the mesh: user messages in, nothing
// piggybacked on its gossip (placements go straight to each peer), no
// node metadata; the index's state in push/pull.
type delegate struct{ m *Mesh }

func (d delegate) NodeMeta(int) []byte                  { return nil }
func (d delegate) NotifyMsg(b []byte)                   { d.m.receive(b) }
func (d delegate) GetBroadcasts(int, int) [][]byte      { return nil }
func (d delegate) LocalState(bool) []byte               { return d.m.localState() }
func (d delegate) MergeRemoteState(b []byte, join bool) { d.m.mergeState(b, join) }

// localState is the index's claims and the homes as a state message
// (empty without Export and ExportHomes).
func (m *Mesh) localState() []byte {
	var cs []claims
	if m.cfg.Export != nil {
		m.cfg.Export(maxStateClaims, func(id, h uint64, age uint32) {
			if n := len(cs); n == 0 || cs[n-1].endpoint != id {
				cs = append(cs, claims{endpoint: id})
			}
			c := &cs[len(cs)-1]
			c.hashes, c.ages = append(c.hashes, h), append(c.ages, age)
		})
	}
	var hs []home
	if m.cfg.ExportHomes != nil {
		m.cfg.ExportHomes(maxStateHomes, func(key, id uint64, recurring bool, age uint32) {
			hs = append(hs, home{key: key, endpoint: id, recurring: recurring, age: age})
		})
	}
	return encodeState(header{sender: m.sender, fingerprint: m.cfg.Fingerprint}, cs, hs)
}

// mergeState imports a peer's state: its claims on this replica's
// endpoints into the index's free room, and the homes on them of keys
// this replica does not know. A state merged at a join makes the replica
// ready (it starts warm).
func (m *Mesh) mergeState(b []byte, join bool) {
	h, body, err := readHeader(b)
	if err == nil && h.kind != kindState {
		err = fmt.Errorf("%w: kind %d in a state", ErrBadMessage, h.kind)
	}
	var cs []claims
	var hs []home
	if err == nil {
		cs, hs, err = decodeState(body)
	}
	switch {
	case err != nil:
		m.stats.decodeErrors.Add(1)
		m.cfg.Logger.Warn("gossip: a peer's state refused", zap.Error(err))
		return
	case h.sender == m.sender:
		return
	case h.fingerprint != m.cfg.Fingerprint:
		m.stats.mismatched.Add(1)
		return
	}
	imported := 0
	for _, c := range cs {
		if len(c.hashes) == 0 || m.cfg.Import == nil {
			continue
		}
		if !m.cfg.Known(c.endpoint) {
			m.stats.unknown.Add(1)
			continue
		}
		imported += m.cfg.Import(c.endpoint, c.hashes, c.ages)
	}
	homes := m.importHomes(hs)
	m.stats.states.Add(1)
	m.stats.imported.Add(int64(imported))
	m.stats.importedHomes.Add(int64(homes))
	if join && !m.joined.Swap(true) {
		m.cfg.Logger.Info("gossip: joined; a peer's state merged", zap.Int("claims", imported), zap.Int("homes", homes))
	}
}

// importHomes takes a peer's homes (most recently used first) on this
// replica's endpoints, oldest first, and returns how many were added.
func (m *Mesh) importHomes(hs []home) (n int) {
	if m.cfg.ImportHomes == nil {
		return 0
	}
	for _, x := range slices.Backward(hs) {
		if !m.cfg.Known(x.endpoint) {
			m.stats.unknown.Add(1)
			continue
		}
		if m.cfg.ImportHomes(x.key, x.endpoint, x.recurring, x.age) {
			n++
		}
	}
	return n
}

// Status is a mesh's state for /debug/peers.
type Status struct {
	Name      string `json:"name"`
	Addr      string `json:"addr"`
	Encrypted bool   `json:"encrypted"`
	// NotReady says why the replica is not ready yet ("": ready).
	NotReady string   `json:"not_ready,omitempty"`
	Seeds    []string `json:"seeds"`
	// Members are the live replicas besides this one.
	Members []Member `json:"members"`
	Stats   Stats    `json:"stats"`
}

// Member is a live peer.
type Member struct {
	Name string `json:"name"`
	Addr string `json:"addr"`
}

// Status returns the mesh's state.
func (m *Mesh) Status() Status {
	s := Status{Name: m.cfg.Name, Addr: m.Addr(), Encrypted: len(m.cfg.Keys) > 0, Seeds: m.cfg.Seeds, Members: []Member{}, Stats: m.Stats()}
	if err := m.Ready(); err != nil {
		s.NotReady = err.Error()
	}
	if ml := m.ml.Load(); ml != nil {
		for _, n := range ml.Members() {
			if n.Name != m.cfg.Name {
				s.Members = append(s.Members, Member{Name: n.Name, Addr: n.Address()})
			}
		}
	}
	return s
}
