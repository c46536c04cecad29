package peers

import (
	"math"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"
)

const (
	// loadEvery is how often a replica sends its requests in flight when
	// they changed, loadKeepalive when they did not. As often as
	// placements go out (flushEvery): a request that ended is a place a
	// peer's queue may be waiting for (its warm waiter, while this
	// replica's cold one defers: the proxy's coldDefer); at 100 ms the
	// endpoint looked busy to the peers that long after.
	loadEvery     = flushEvery
	loadKeepalive = time.Second
	// loadTTL is how long a peer's report stands without a new one (a
	// replica gone without leaving stops counting after it).
	loadTTL = 3 * time.Second
	// maxLoadPeers bounds the peers whose load is kept.
	maxLoadPeers = 64
)

// loads is the replicas' load exchange: what this replica last sent, and
// what each peer last told per endpoint.
type loads struct {
	mu       sync.Mutex
	sent     []loadEntry // the last digest sent (Run's loop only)
	own      []loadEntry // the digest being built (Run's loop only)
	sentAt   time.Time
	checked  time.Time
	byPeer   map[uint64]map[uint64]loadSeen
	touched  []uint64
	reported map[uint64]bool // endpoints given a peer sum that is not 0
	placed   bool            // placements went out since the last digest (Run's loop only)
	// ownSum and peerSum are this replica's and its peers' requests in
	// flight over the fleet, summed every loadEvery and decayed over
	// echoDecay (Run's loop only; Echo).
	ownSum, peerSum float64
}

type loadSeen struct {
	n  int64
	at time.Time
}

// sendLoad sends this replica's requests in flight to every other live
// member, every loadEvery when they changed or placements went out since
// (the peers counted each as a request in flight: placedLoad), and every
// loadKeepalive regardless, and drops the peers' reports older than
// loadTTL.
func (m *Mesh) sendLoad(ml *memberlist.Memberlist, now time.Time) {
	l := &m.loads
	if now.Sub(l.checked) < loadEvery {
		return
	}
	l.checked = now
	m.expireLoad(now)
	if m.cfg.Load == nil || m.others.Load() == 0 {
		return
	}
	l.own = l.own[:0]
	m.cfg.Load(func(id uint64, n int64) { l.own = append(l.own, loadEntry{id, n}) })
	m.learnEcho()
	if slices.Equal(l.own, l.sent) && !l.placed && now.Sub(l.sentAt) < loadKeepalive {
		return
	}
	l.sent, l.own, l.sentAt, l.placed = l.own, l.sent, now, false
	msgs := encodeLoad(nil, header{sender: m.sender, fingerprint: m.cfg.Fingerprint}, l.sent)
	m.sendAll(ml, msgs)
}

// mergeLoad takes a peer's report of its requests in flight and tells
// SetLoad the new sums of the endpoints it names.
func (m *Mesh) mergeLoad(sender uint64, es []loadEntry, now time.Time) {
	m.setLoad(sender, es, now, false)
}

// placedLoad counts a peer's placements (es: one message's endpoints, each
// once, with 1) as requests of that peer's in flight there, on top of its
// last report, until its next report says how many run: its load goes out
// every loadEvery, its placements within flushEvery, and a pick that read
// only the reports missed the requests the peers placed in between (eight
// replicas starting 24 conversations at once sent three or four to each of
// some pods and none to another, where one router sent three to each).
func (m *Mesh) placedLoad(sender uint64, es []loadEntry, now time.Time) {
	m.setLoad(sender, es, now, true)
}

// setLoad sets (add: adds to) sender's requests in flight at the
// endpoints of es this replica knows, and tells SetLoad the new sums.
func (m *Mesh) setLoad(sender uint64, es []loadEntry, now time.Time, add bool) {
	if m.cfg.SetLoad == nil || len(es) == 0 {
		return
	}
	l := &m.loads
	l.mu.Lock()
	defer l.mu.Unlock()
	peer := l.peer(m, sender)
	if peer == nil {
		return
	}
	l.touched = l.touched[:0]
	for _, e := range es {
		if !m.cfg.Known(e.endpoint) {
			continue
		}
		n := e.inFlight
		if add {
			n = min(peer[e.endpoint].n+n, maxInFlight)
		}
		peer[e.endpoint] = loadSeen{n, now}
		l.touched = append(l.touched, e.endpoint)
	}
	m.publishLoad()
}

// peer returns sender's reports, made if new (nil past maxLoadPeers).
// l.mu is held.
func (l *loads) peer(m *Mesh, sender uint64) map[uint64]loadSeen {
	if l.byPeer == nil {
		l.byPeer, l.reported = map[uint64]map[uint64]loadSeen{}, map[uint64]bool{}
	}
	peer, ok := l.byPeer[sender]
	if !ok {
		if len(l.byPeer) >= maxLoadPeers {
			m.stats.dropped.Add(1)
			return nil
		}
		peer = map[uint64]loadSeen{}
		l.byPeer[sender] = peer
	}
	return peer
}

// expireLoad drops the peers' reports older than loadTTL and publishes
// the sums they leave.
func (m *Mesh) expireLoad(now time.Time) {
	if m.cfg.SetLoad == nil {
		return
	}
	l := &m.loads
	l.mu.Lock()
	defer l.mu.Unlock()
	l.touched = l.touched[:0]
	for sender, peer := range l.byPeer {
		for id, v := range peer {
			if now.Sub(v.at) > loadTTL {
				delete(peer, id)
				l.touched = append(l.touched, id)
			}
		}
		if len(peer) == 0 {
			delete(l.byPeer, sender)
		}
	}
	m.publishLoad()
}

// publishLoad tells SetLoad the peers' sum at each endpoint of
// l.touched. l.mu is held.
func (m *Mesh) publishLoad() {
	l := &m.loads
	for _, id := range l.touched {
		var sum int64
		for _, peer := range l.byPeer {
			sum += peer[id].n
		}
		if sum == 0 && !l.reported[id] {
			continue
		}
		l.reported[id] = sum != 0
		m.cfg.SetLoad(id, sum)
	}
}

// echoDecay is the time over which Echo weighs the replicas' loads, and
// echoPrior how long (at one request in flight) its prior, every peer
// sending as many as this replica, weighs against them.
const (
	echoDecay = 10 * time.Second
	echoPrior = time.Second
)

// echoKeep is what one loadEvery leaves of Echo's sums.
var echoKeep = math.Exp(-float64(loadEvery) / float64(echoDecay))

// Echo is how many requests of the peers one request of this replica's
// stands for (Prefix.Pick counts the prefill of that many more at its
// endpoint until the peers' gossip tells where theirs went): the peers'
// requests in flight over this replica's, averaged over echoDecay, at most
// the number of live peers. A client that spreads its requests over the replicas
// gives each the same share, and Echo is the number of peers; one that
// sends them all to this replica makes it 0, where counting every peer
// would have spread this replica's own bursts as if the peers sent alike.
// Until the loads show which, the peers are taken to send alike. One
// or two atomic loads.
func (m *Mesh) Echo() float64 {
	if !m.echoLearned.Load() {
		return float64(m.others.Load())
	}
	return math.Float64frombits(m.echo.Load())
}

// learnEcho folds this replica's requests in flight (l.own, just read) and
// the peers' last reports into Echo. Run's loop only.
func (m *Mesh) learnEcho() {
	l := &m.loads
	var own, peers int64
	for _, e := range l.own {
		own += e.inFlight
	}
	l.mu.Lock()
	for _, peer := range l.byPeer {
		for _, v := range peer {
			peers += v.n
		}
	}
	l.mu.Unlock()
	l.ownSum = l.ownSum*echoKeep + float64(own)
	l.peerSum = l.peerSum*echoKeep + float64(peers)
	others := float64(m.others.Load())
	prior := float64(echoPrior / loadEvery)
	m.echo.Store(math.Float64bits(min(others, (l.peerSum+others*prior)/(l.ownSum+prior))))
	m.echoLearned.Store(true)
}
