package kvevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/kvroute/kvroute/discovery"
)

// Causes of Sink.KVReset.
const (
	// ResetRestart: the engine restarted (its sequence numbers went
	// back): its cache is empty.
	ResetRestart = "restart"
	// ResetGap: batches were missed and replay could not fill the gap:
	// what the engine holds is unknown.
	ResetGap = "gap"
	// ResetLost: the publisher went away (its connection dropped, or the
	// endpoint left the pool): what the engine holds is unknown.
	ResetLost = "lost"
)

// Sink receives a Subscriber's decoded batches. Calls for one endpoint
// come from one goroutine at a time, in sequence order; calls for distinct
// endpoints may come at once. The batch and its slices are the
// subscriber's and reused once KVBatch returns: a sink copies what it
// keeps. A slow sink delays reading that endpoint's events (its publisher
// then drops at its high-water mark, and the loss shows as a gap); it
// never touches the request path.
type Sink interface {
	KVBatch(e *discovery.Endpoint, b *Batch)
	// KVReset: what the sink learned from e's events is no longer known to
	// be true: cause is one of ResetRestart (the engine restarted: its
	// cache is empty; sequence numbers went back), ResetGap (a gap
	// replay could not fill), ResetLost (the publisher went away, e.g.
	// the endpoint left).
	KVReset(e *discovery.Endpoint, cause string)
}

// Config configures a Subscriber. With the zero value only endpoints that
// name their publisher are subscribed to.
type Config struct {
	// Port, when not 0, is the dial mode: a SUB connection to
	// tcp://<endpoint host>:Port for every endpoint of the pool (vLLM and
	// SGLang bind tcp://*:5557 by default). An endpoint whose URL names its
	// publisher (Endpoint.KVEventsPort, "#kv-events=PORT") is dialed at
	// that port instead, whatever Port is.
	Port int
	// ReplayPort is the engines' replay ROUTER port (vLLM's
	// --kv-events-config replay_endpoint, the llm-d simulator's
	// --kv-events-replay-endpoint); 0: no replay, and a gap is a
	// ResetGap. The data-parallel rank r of a batch is asked at
	// ReplayPort + r, as engines offset their ports by rank.
	ReplayPort int
	// Listen, when not "", is the bind mode: a listener at the ZeroMQ
	// endpoint Listen ("tcp://host:port" or "host:port", see
	// ParseEndpoint) for publishers that dial in (the llm-d simulator's
	// --zmq-endpoint). Their topic kv@<ip>:<port>@<model> names the
	// endpoint, matched against the endpoints' Addr: bind mode needs
	// endpoints addressed by IP, as DNS discovery gives them.
	Listen string
	// Topic is the subscription prefix; "" for all.
	Topic string
	// Ranks is the data-parallel ranks to dial per endpoint in dial mode,
	// at port + rank (vLLM and SGLang offset a rank's publisher port by
	// its rank); 0 or 1: one.
	Ranks int
}

// Tuning of a Subscriber.
const (
	// kvReplayTimeout bounds one replay: connecting, asking and reading
	// the missed batches (vLLM keeps the last 10,000; on a LAN they come
	// in well under a second). The endpoint's events wait meanwhile.
	kvReplayTimeout = 2 * time.Second
	// kvDialTimeout bounds a TCP connect to a publisher or replay socket.
	kvDialTimeout = 2 * time.Second
	// kvHandshakeTimeout bounds the ZMTP handshake of a new connection.
	kvHandshakeTimeout = 5 * time.Second
	// kvBackoffMin and kvBackoffMax bound the wait between dials of an
	// unreachable publisher, doubling from one to the other: a publisher
	// that never comes costs a dial every 5 s.
	kvBackoffMin = 100 * time.Millisecond
	kvBackoffMax = 5 * time.Second
	// kvMaxConns bounds the publishers connected at once in bind mode.
	kvMaxConns = 4096
	// kvMaxLoggedTopics bounds the unmatched topics remembered to log each
	// once.
	kvMaxLoggedTopics = 1024
	// kvKeepEvents and kvKeepElems bound the decoded batch kept for reuse
	// between batches (events, and hashes or tokens of one event).
	kvKeepEvents = 4096
	kvKeepElems  = 1 << 16
)

// Subscriber subscribes to the engines' KV-cache events over ZeroMQ
// (vLLM's ZmqEventPublisher, SGLang's, the llm-d simulator's): in dial
// mode to every endpoint of a Pool, in bind mode to the publishers that
// dial in, or both. It decodes their batches, checks their sequence numbers
// per endpoint and data-parallel rank, replays gaps from the engines'
// replay sockets, and hands batches and resets to a Sink.
//
// Sequence numbers. The first batch of a rank's stream (on a new
// connection) sets the expectation; a batch with the expected number is
// delivered; a greater number is a gap: the missed batches are asked from
// the replay socket and delivered in order before it, and when replay is
// off, fails or does not reach back, the sink gets ResetGap before it; a
// smaller number means the publisher's counter started over (vLLM counts
// from 0, the llm-d simulator from 1): the sink gets ResetRestart before
// it. Nothing is delivered twice: a replay is done synchronously by the
// goroutine reading the stream, only its batches from the expectation up
// to (not including) the batch that showed the gap are delivered, and the
// expectation then moves past that batch; a ZeroMQ connection delivers in
// order, at most once, so on a live stream no smaller number can be an
// echo of one delivered. A stream ends with its connection: the events of
// the outage are unknown, so the sink gets ResetLost (when it was
// delivered anything since its last reset), and the next connection's
// first batch sets a new expectation whatever its number, which also
// covers an engine that restarted while disconnected.
//
// NewSubscriber starts nothing; Run does the work. Status and Stats are
// safe for concurrent use.
type Subscriber struct {
	c    Config
	pool *discovery.Pool
	sink Sink
	log  *zap.Logger

	topic   []byte // c.Topic
	running atomic.Bool
	wg      sync.WaitGroup

	// pubAddr is the address of e's publisher of rank in dial mode; tests
	// replace it before Run.
	pubAddr func(ke *kvEndpoint, rank int) string
	// bound receives the listener's address in bind mode (tests read it).
	bound chan net.Addr

	// mu guards eps, byAddr and loggedTopics; it is never held with a
	// kvEndpoint's mu.
	mu           sync.Mutex
	eps          map[*discovery.Endpoint]*kvEndpoint
	byAddr       map[string]*discovery.Endpoint // bind mode: an endpoint's Addr → it, for the current Set
	loggedTopics map[string]struct{}

	st kvCounters
}

// kvCounters are a Subscriber's totals.
type kvCounters struct {
	batches, stored, removed, cleared, decodeErrors atomic.Uint64
	gaps, replays, replayed, unmatched              atomic.Uint64
	resetRestart, resetGap, resetLost               atomic.Uint64
	conns                                           atomic.Int64
}

// kvEndpoint is a Subscriber's state for one endpoint.
type kvEndpoint struct {
	e    *discovery.Endpoint
	host string // e's host, for its publisher and replay addresses

	// mu serialises the sink's calls for e and guards the fields below.
	mu      sync.Mutex
	streams map[int]*kvStream // by data-parallel rank
	dirty   bool              // a batch was delivered since the last reset
	gone    bool              // e left the pool: nothing more is delivered

	// Dial mode: cancel stops e's dial loops; done is closed when they
	// have ended.
	cancel context.CancelFunc
	done   chan struct{}

	// For Status.
	live                                                  atomic.Int32 // open publisher connections feeding e
	lastEvent                                             atomic.Int64 // Unix ns of the last batch delivered
	seq                                                   atomic.Int64 // of the last batch delivered; -1 before
	batches, events, gaps, replayed, resets, decodeErrors atomic.Uint64
}

// kvStream is one rank's sequence expectation while its connection lasts.
type kvStream struct{ next int64 }

// StreamStatus is a snapshot of one endpoint's event stream, for
// /debug/endpoints and metrics.
type StreamStatus struct {
	// Connected: a publisher connection for the endpoint is open (dial
	// mode: connected; bind mode: a connected publisher has sent it a
	// batch).
	Connected bool `json:"connected"`
	// LastEvent is when its last batch was delivered (zero: never).
	LastEvent time.Time `json:"last_event,omitzero"`
	// Batches and Events delivered (replayed ones included), gaps seen,
	// batches recovered by replay, resets (all causes), batches that did
	// not decode.
	Batches      uint64 `json:"batches"`
	Events       uint64 `json:"events"`
	Gaps         uint64 `json:"gaps"`
	Replayed     uint64 `json:"replayed"`
	Resets       uint64 `json:"resets"`
	DecodeErrors uint64 `json:"decode_errors"`
	// Seq is the sequence number of the last batch delivered; -1 before
	// the first.
	Seq int64 `json:"seq"`
}

// Stats are a Subscriber's totals since it was made.
type Stats struct {
	// Batches delivered (replayed ones included), and their events by kind.
	Batches uint64 `json:"batches"`
	Stored  uint64 `json:"stored"`
	Removed uint64 `json:"removed"`
	Cleared uint64 `json:"cleared"`
	// DecodeErrors counts messages dropped because they were not a
	// well-formed batch ([topic, 8-byte seq, payload] with a payload
	// DecodeBatch reads).
	DecodeErrors uint64 `json:"decode_errors"`
	// Gaps in sequence numbers, replay requests made, batches they
	// recovered.
	Gaps     uint64 `json:"gaps"`
	Replays  uint64 `json:"replays"`
	Replayed uint64 `json:"replayed"`
	// Resets by cause (ResetRestart, ResetGap, ResetLost).
	Resets map[string]uint64 `json:"resets"`
	// Unmatched counts bind-mode batches whose topic named no endpoint of
	// the pool (dropped).
	Unmatched uint64 `json:"unmatched"`
	// Connections is the publisher connections open now.
	Connections int64 `json:"connections"`
}

// NewSubscriber returns a subscriber of the events of pool's endpoints
// (dial mode) or of the publishers dialing in (bind mode) for sink. It
// starts nothing. A nil logger logs nothing.
func NewSubscriber(c Config, pool *discovery.Pool, sink Sink, logger *zap.Logger) *Subscriber {
	if logger == nil {
		logger = zap.NewNop()
	}
	s := &Subscriber{
		c: c, pool: pool, sink: sink, log: logger.Named("kvevents"), topic: []byte(c.Topic),
		bound:        make(chan net.Addr, 1),
		eps:          make(map[*discovery.Endpoint]*kvEndpoint),
		byAddr:       make(map[string]*discovery.Endpoint),
		loggedTopics: make(map[string]struct{}),
	}
	s.pubAddr = s.defaultPubAddr
	return s
}

// dialPort is the port e's publisher of rank 0 is dialed at; 0: e is not
// dialed.
func (s *Subscriber) dialPort(e *discovery.Endpoint) int {
	if e.KVEventsPort > 0 {
		return e.KVEventsPort
	}
	return s.c.Port
}

// defaultPubAddr is the address of ke's publisher of rank: its host at
// its dial port + rank.
func (s *Subscriber) defaultPubAddr(ke *kvEndpoint, rank int) string {
	return net.JoinHostPort(ke.host, strconv.Itoa(s.dialPort(ke.e)+rank))
}

// validate checks the configuration.
func (c Config) validate() error {
	switch {
	case c.Port < 0 || c.Port > 65535 || c.ReplayPort < 0 || c.ReplayPort > 65535:
		return fmt.Errorf("%w: KV events ports must be in [0, 65535]", ErrBadConfig)
	case c.Ranks < 0 || c.Ranks > maxDPRank:
		return fmt.Errorf("%w: KV events ranks must be in [0, %d]", ErrBadConfig, maxDPRank)
	case c.Port > 0 && c.Port+max(c.Ranks, 1)-1 > 65535:
		return fmt.Errorf("%w: KV events port %d + %d ranks is beyond 65535", ErrBadConfig, c.Port, c.Ranks)
	}
	if c.Listen != "" {
		if _, err := ParseEndpoint(c.Listen); err != nil {
			return fmt.Errorf("%w: KV events listen address: %w", ErrBadConfig, err)
		}
	}
	return nil
}

// Run subscribes until ctx is done, then closes every connection, waits
// for its goroutines and returns nil; after it returns the sink is not
// called again. It returns an error at once when the configuration is
// invalid or the bind-mode listener cannot be bound. With neither Port nor
// Listen it still follows the pool, for endpoints that name their
// publisher. It may be called once.
func (s *Subscriber) Run(ctx context.Context) error {
	if !s.running.CompareAndSwap(false, true) {
		return ErrRunning
	}
	if err := s.c.validate(); err != nil {
		return err
	}
	var ln net.Listener
	if s.c.Listen != "" {
		addr, _ := ParseEndpoint(s.c.Listen) // validated
		var lc net.ListenConfig
		var err error
		if ln, err = lc.Listen(ctx, "tcp", addr); err != nil {
			return fmt.Errorf("kvevents: KV events listener: %w", err)
		}
		s.log.Info("listening for KV-event publishers", zap.Stringer("addr", ln.Addr()))
	}
	if s.c.Port > 0 {
		s.log.Info("subscribing to the endpoints' KV events", zap.Int("port", s.c.Port), zap.Int("ranks", max(s.c.Ranks, 1)))
	}
	for {
		changed := s.pool.Changed()
		s.reconcile(ctx, s.pool.Load())
		if ln != nil {
			// Publishers are served once the pool's endpoints are known:
			// a batch read before that would be dropped as unmatched.
			l := ln
			ln = nil
			s.bound <- l.Addr()
			s.wg.Go(func() { s.serve(ctx, l) })
		}
		select {
		case <-changed:
		case <-ctx.Done():
			s.wg.Wait()
			return nil
		}
	}
}

// reconcile follows the pool's Set: an endpoint that left is retired
// (its dial loops stopped, ResetLost) before anything else, so that an
// endpoint coming back starts anew after the sink was told; an endpoint
// that appeared is dialed when it has a dial port.
func (s *Subscriber) reconcile(ctx context.Context, set *discovery.Set) {
	byAddr := make(map[string]*discovery.Endpoint, set.Len())
	present := make(map[*discovery.Endpoint]struct{}, set.Len())
	for _, e := range set.Endpoints {
		present[e] = struct{}{}
		if _, dup := byAddr[e.Addr]; !dup {
			byAddr[e.Addr] = e
		}
	}
	var gone, added []*kvEndpoint
	s.mu.Lock()
	s.byAddr = byAddr
	for e, ke := range s.eps {
		if _, ok := present[e]; !ok {
			delete(s.eps, e)
			gone = append(gone, ke)
		}
	}
	for _, e := range set.Endpoints {
		if s.eps[e] == nil && s.dialPort(e) > 0 {
			ke := newKVEndpoint(e)
			s.eps[e] = ke
			added = append(added, ke)
		}
	}
	s.mu.Unlock()
	for _, ke := range gone {
		s.retire(ctx, ke)
	}
	for _, ke := range added {
		kctx, cancel := context.WithCancel(ctx)
		ke.cancel, ke.done = cancel, make(chan struct{})
		s.wg.Go(func() {
			defer close(ke.done)
			var wg sync.WaitGroup
			for r := range min(max(s.c.Ranks, 1), 65536-s.dialPort(ke.e)) {
				wg.Go(func() { s.dialLoop(kctx, ke, r) })
			}
			wg.Wait()
		})
	}
}

func newKVEndpoint(e *discovery.Endpoint) *kvEndpoint {
	host, _, err := net.SplitHostPort(e.Addr)
	if err != nil {
		host = e.Addr
	}
	ke := &kvEndpoint{e: e, host: host, streams: make(map[int]*kvStream)}
	ke.seq.Store(-1)
	return ke
}

// retire ends an endpoint that left the pool: its dial loops stop (their
// connections close at once; a sink call in progress finishes), and the
// sink forgets what e's events said. It waits for a bind-mode replay of
// e in progress, kvReplayTimeout at most.
func (s *Subscriber) retire(ctx context.Context, ke *kvEndpoint) {
	if ke.cancel != nil {
		ke.cancel()
		<-ke.done
	}
	ke.mu.Lock()
	defer ke.mu.Unlock()
	ke.gone = true
	if ke.dirty && ctx.Err() == nil {
		s.reset(ke, ResetLost)
	}
	s.log.Debug("KV events: endpoint left", zap.String("endpoint", ke.e.URL))
}

// dialLoop keeps a SUB connection to ke's publisher of rank until ctx is
// done, redialing after a backoff that doubles from kvBackoffMin to
// kvBackoffMax while the publisher cannot be reached (or drops each
// connection at once: the backoff starts over only after a connection
// that lasted kvBackoffMax). An outage is logged once, when it starts,
// and once when it ends.
func (s *Subscriber) dialLoop(ctx context.Context, ke *kvEndpoint, rank int) {
	addr := s.pubAddr(ke, rank)
	kc := newKVConn(ke)
	backoff := kvBackoffMin
	down := false
	for {
		z, err := s.connect(ctx, addr, "SUB", "PUB", "XPUB")
		if err == nil {
			err = z.Subscribe(s.c.Topic)
			if err == nil {
				if down {
					s.log.Info("KV-event publisher reachable", zap.String("endpoint", ke.e.URL), zap.String("addr", addr))
					down = false
				}
				start := time.Now()
				ke.live.Add(1)
				err = s.consume(ctx, kc, z)
				ke.live.Add(-1)
				s.connLost(ctx, kc)
				if time.Since(start) >= kvBackoffMax {
					backoff = kvBackoffMin
				}
			}
			z.Close()
		}
		if ctx.Err() != nil {
			return
		}
		if !down {
			s.log.Info("KV-event publisher unreachable or gone; redialing with backoff", zap.String("endpoint", ke.e.URL),
				zap.String("addr", addr), zap.Error(err))
			down = true
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		backoff = min(2*backoff, kvBackoffMax)
	}
}

// connect dials addr and opens a ZMTP connection as a self socket.
func (s *Subscriber) connect(ctx context.Context, addr, self string, peers ...string) (*ZMTPConn, error) {
	d := net.Dialer{Timeout: kvDialTimeout}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { c.Close() })
	z, err := OpenZMTP(c, kvHandshakeTimeout, self, peers...)
	stop()
	if err == nil && ctx.Err() != nil {
		err = ctx.Err()
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	return z, nil
}

// serve accepts publishers dialing in until ctx is done.
func (s *Subscriber) serve(ctx context.Context, ln net.Listener) {
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	var conns atomic.Int32 // publishers connected, handshakes included
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			// Out of file descriptors and the like: wait a little.
			s.log.Debug("KV events: accept failed", zap.Error(err))
			t := time.NewTimer(kvBackoffMin)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			continue
		}
		if conns.Add(1) > kvMaxConns {
			conns.Add(-1)
			c.Close()
			continue
		}
		wg.Go(func() {
			defer conns.Add(-1)
			s.servePublisher(ctx, c)
		})
	}
}

// servePublisher reads one publisher that dialed in until it leaves or ctx
// is done.
func (s *Subscriber) servePublisher(ctx context.Context, c net.Conn) {
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	z, err := OpenZMTP(c, kvHandshakeTimeout, "SUB", "PUB", "XPUB")
	if err != nil {
		s.log.Debug("KV events: publisher handshake failed", zap.Stringer("remote", c.RemoteAddr()), zap.Error(err))
		return
	}
	if err := z.Subscribe(s.c.Topic); err != nil {
		return
	}
	s.log.Debug("KV-event publisher connected", zap.Stringer("remote", c.RemoteAddr()))
	kc := newKVConn(nil)
	err = s.consume(ctx, kc, z)
	s.connLost(ctx, kc)
	s.log.Debug("KV-event publisher left", zap.Stringer("remote", c.RemoteAddr()), zap.Error(err))
}

// kvConn is one publisher connection's reading state, owned by its
// goroutine (a dial loop keeps it across its connections).
type kvConn struct {
	dec *kvDecoder
	// batch is the batch read; replayed a batch of a replay.
	batch, replayed Batch
	// fixed is the endpoint of a dial-mode connection; nil in bind mode,
	// where the topic names it.
	fixed *kvEndpoint
	// fed is the streams the connection delivered to.
	fed []kvFed
	// warned: a bad message was logged on this connection.
	warned bool
}

// kvFed is a stream a connection delivered to.
type kvFed struct {
	ke   *kvEndpoint
	rank int
}

func newKVConn(fixed *kvEndpoint) *kvConn { return &kvConn{dec: newKVDecoder(), fixed: fixed} }

// consume reads z's messages until it fails or ctx is done.
func (s *Subscriber) consume(ctx context.Context, kc *kvConn, z *ZMTPConn) error {
	s.st.conns.Add(1)
	defer s.st.conns.Add(-1)
	stop := context.AfterFunc(ctx, func() { z.Close() })
	defer stop()
	for {
		frames, n, err := z.ReadMsg()
		if err != nil {
			return err
		}
		if n != 3 || len(frames[1]) != 8 || int64(binary.BigEndian.Uint64(frames[1])) < 0 {
			s.badMessage(kc, kc.fixed, fmt.Errorf("%w: a message of %d frames is not [topic, 8-byte sequence number, payload]", ErrBadBatch, n))
			continue
		}
		topic, seq, payload := frames[0], int64(binary.BigEndian.Uint64(frames[1])), frames[2]
		if !bytes.HasPrefix(topic, s.topic) {
			continue // the publisher filters too
		}
		ke := kc.fixed
		if ke == nil {
			if ke = s.byTopic(topic); ke == nil {
				continue
			}
		}
		if err := kc.dec.decode(payload, &kc.batch); err != nil {
			s.badMessage(kc, ke, err)
			continue
		}
		s.handle(ctx, kc, ke, seq)
		trimBatch(&kc.batch)
	}
}

// badMessage counts a message that is not a batch, logging the first of
// the connection.
func (s *Subscriber) badMessage(kc *kvConn, ke *kvEndpoint, err error) {
	s.st.decodeErrors.Add(1)
	url := ""
	if ke != nil {
		ke.decodeErrors.Add(1)
		url = ke.e.URL
	}
	if !kc.warned {
		kc.warned = true
		s.log.Warn("KV events: dropping a message that is not an event batch (logged once per connection)",
			zap.String("endpoint", url), zap.Error(err))
	}
}

// byTopic returns the endpoint a bind-mode topic kv@<ip>:<port>@<model>
// names, or nil (counted, and logged once per topic).
func (s *Subscriber) byTopic(topic []byte) *kvEndpoint {
	addr := topic
	if i := bytes.IndexByte(addr, '@'); i >= 0 {
		addr = addr[i+1:]
		if j := bytes.IndexByte(addr, '@'); j >= 0 {
			addr = addr[:j]
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.byAddr[string(addr)]
	if e == nil {
		// "::1:8000" (an IPv6 address as the simulator writes it).
		if i := bytes.LastIndexByte(addr, ':'); i > 0 {
			e = s.byAddr[net.JoinHostPort(string(addr[:i]), string(addr[i+1:]))]
		}
	}
	if e == nil {
		s.st.unmatched.Add(1)
		if _, seen := s.loggedTopics[string(topic)]; !seen && len(s.loggedTopics) < kvMaxLoggedTopics {
			s.loggedTopics[string(topic)] = struct{}{}
			s.log.Info("KV events: topic names no endpoint of the pool; dropping its batches (logged once per topic)",
				zap.ByteString("topic", topic))
		}
		return nil
	}
	ke := s.eps[e]
	if ke == nil {
		ke = newKVEndpoint(e)
		s.eps[e] = ke
	}
	return ke
}

// handle applies the sequence rule (see Subscriber) to kc.batch, number
// seq, of endpoint ke, and delivers it.
func (s *Subscriber) handle(ctx context.Context, kc *kvConn, ke *kvEndpoint, seq int64) {
	rank := kc.batch.DPRank
	ke.mu.Lock()
	defer ke.mu.Unlock()
	if ke.gone {
		return
	}
	if !slices.Contains(kc.fed, kvFed{ke, rank}) {
		if kc.fixed == nil && !slices.ContainsFunc(kc.fed, func(f kvFed) bool { return f.ke == ke }) {
			ke.live.Add(1)
		}
		kc.fed = append(kc.fed, kvFed{ke, rank})
	}
	st := ke.streams[rank]
	switch {
	case st == nil:
		st = &kvStream{}
		ke.streams[rank] = st
	case seq == st.next:
	case seq < st.next:
		s.log.Info("KV events: sequence numbers went back; the engine restarted", zap.String("endpoint", ke.e.URL),
			zap.Int("dp_rank", rank), zap.Int64("seq", seq), zap.Int64("expected", st.next))
		s.reset(ke, ResetRestart)
	default:
		s.st.gaps.Add(1)
		ke.gaps.Add(1)
		if !s.replay(ctx, kc, ke, rank, st, seq) {
			s.log.Debug("KV events: missed batches", zap.String("endpoint", ke.e.URL), zap.Int("dp_rank", rank),
				zap.Int64("from", st.next), zap.Int64("to", seq))
			s.reset(ke, ResetGap)
		}
	}
	st.next = seq + 1
	s.deliver(ke, seq, &kc.batch)
}

// deliver hands b, number seq, to the sink; ke.mu is held.
func (s *Subscriber) deliver(ke *kvEndpoint, seq int64, b *Batch) {
	var stored, removed, cleared uint64
	for i := range b.Events {
		switch b.Events[i].Kind {
		case BlockStored:
			stored++
		case BlockRemoved:
			removed++
		case AllCleared:
			cleared++
		}
	}
	s.st.batches.Add(1)
	s.st.stored.Add(stored)
	s.st.removed.Add(removed)
	s.st.cleared.Add(cleared)
	ke.batches.Add(1)
	ke.events.Add(uint64(len(b.Events)))
	ke.seq.Store(seq)
	ke.lastEvent.Store(time.Now().UnixNano())
	ke.dirty = true
	s.sink.KVBatch(ke.e, b)
}

// reset tells the sink to forget ke's events; ke.mu is held.
func (s *Subscriber) reset(ke *kvEndpoint, cause string) {
	switch cause {
	case ResetRestart:
		s.st.resetRestart.Add(1)
	case ResetGap:
		s.st.resetGap.Add(1)
	case ResetLost:
		s.st.resetLost.Add(1)
	}
	ke.resets.Add(1)
	ke.dirty = false
	s.sink.KVReset(ke.e, cause)
}

// connLost ends the streams kc fed: their events while disconnected are
// unknown (ResetLost), and the next connection starts them anew.
func (s *Subscriber) connLost(ctx context.Context, kc *kvConn) {
	for i, f := range kc.fed {
		ke := f.ke
		ke.mu.Lock()
		delete(ke.streams, f.rank)
		if !ke.gone && ke.dirty && ctx.Err() == nil {
			s.log.Info("KV events: publisher connection lost; forgetting the endpoint's events", zap.String("endpoint", ke.e.URL))
			s.reset(ke, ResetLost)
		}
		ke.mu.Unlock()
		if kc.fixed == nil && !slices.ContainsFunc(kc.fed[:i], func(g kvFed) bool { return g.ke == ke }) {
			ke.live.Add(-1)
		}
	}
	kc.fed, kc.warned = kc.fed[:0], false
}

// replay asks ke's replay socket for rank's batches from st.next up to
// (not including) to and delivers them in order, advancing st.next; it
// reports whether st.next reached to. ke.mu is held (the endpoint's events
// wait, at most kvReplayTimeout).
func (s *Subscriber) replay(ctx context.Context, kc *kvConn, ke *kvEndpoint, rank int, st *kvStream, to int64) bool {
	if s.c.ReplayPort <= 0 {
		return false
	}
	s.st.replays.Add(1)
	ctx, cancel := context.WithTimeout(ctx, kvReplayTimeout)
	defer cancel()
	addr := net.JoinHostPort(ke.host, strconv.Itoa(s.c.ReplayPort+rank))
	z, err := s.connect(ctx, addr, "DEALER", "ROUTER")
	if err != nil {
		s.log.Debug("KV events: replay unreachable", zap.String("addr", addr), zap.Error(err))
		return false
	}
	defer z.Close()
	stop := context.AfterFunc(ctx, func() { z.Close() })
	defer stop()
	var from [8]byte
	binary.BigEndian.PutUint64(from[:], uint64(st.next))
	// A DEALER sends the empty delimiter a REQ would: vLLM's ROUTER reads
	// [identity, "", start].
	if err := z.Send(nil, from[:]); err != nil {
		return false
	}
	for {
		frames, n, err := z.ReadMsg()
		if err != nil {
			s.log.Debug("KV events: replay failed", zap.String("addr", addr), zap.Error(err))
			return false
		}
		if n > 0 && len(frames[0]) == 0 { // the delimiter
			frames, n = frames[1:], n-1
		}
		var seqb, payload []byte
		switch n {
		case 2: // vLLM, SGLang: [seq, payload]
			seqb, payload = frames[0], frames[1]
		case 3: // the llm-d simulator: [topic, seq, payload]
			seqb, payload = frames[1], frames[2]
		default:
			return false
		}
		if len(seqb) != 8 {
			return false
		}
		seq := int64(binary.BigEndian.Uint64(seqb))
		switch {
		case seq == -1: // the end of the replay
			return st.next == to
		case seq < st.next || seq >= to:
			continue // delivered already, or the batch being handled and later ones
		case seq > st.next:
			return false // the replay buffer does not reach back
		}
		if err := kc.dec.decode(payload, &kc.replayed); err != nil {
			s.badMessage(kc, ke, err)
			return false
		}
		s.st.replayed.Add(1)
		ke.replayed.Add(1)
		st.next = seq + 1
		s.deliver(ke, seq, &kc.replayed)
		trimBatch(&kc.replayed)
	}
}

// trimBatch drops the slices of a batch too large to keep for reuse.
func trimBatch(b *Batch) {
	if cap(b.Events) > kvKeepEvents {
		b.Events = nil
		return
	}
	for i := range b.Events {
		ev := &b.Events[i]
		if cap(ev.BlockHashes) > kvKeepElems {
			ev.BlockHashes = nil
		}
		if cap(ev.TokenIDs) > kvKeepElems {
			ev.TokenIDs = nil
		}
	}
}

// Status returns a snapshot of e's event stream (zero with Seq -1 for an
// endpoint the subscriber has no stream of).
func (s *Subscriber) Status(e *discovery.Endpoint) StreamStatus {
	s.mu.Lock()
	ke := s.eps[e]
	s.mu.Unlock()
	if ke == nil {
		return StreamStatus{Seq: -1}
	}
	st := StreamStatus{
		Connected: ke.live.Load() > 0,
		Batches:   ke.batches.Load(), Events: ke.events.Load(), Gaps: ke.gaps.Load(),
		Replayed: ke.replayed.Load(), Resets: ke.resets.Load(), DecodeErrors: ke.decodeErrors.Load(),
		Seq: ke.seq.Load(),
	}
	if ns := ke.lastEvent.Load(); ns != 0 {
		st.LastEvent = time.Unix(0, ns)
	}
	return st
}

// Stats returns the subscriber's totals.
func (s *Subscriber) Stats() Stats {
	c := &s.st
	return Stats{
		Batches: c.batches.Load(), Stored: c.stored.Load(), Removed: c.removed.Load(), Cleared: c.cleared.Load(),
		DecodeErrors: c.decodeErrors.Load(), Gaps: c.gaps.Load(), Replays: c.replays.Load(), Replayed: c.replayed.Load(),
		Resets: map[string]uint64{
			ResetRestart: c.resetRestart.Load(), ResetGap: c.resetGap.Load(), ResetLost: c.resetLost.Load(),
		},
		Unmatched: c.unmatched.Load(), Connections: c.conns.Load(),
	}
}
