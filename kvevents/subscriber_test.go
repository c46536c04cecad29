package kvevents

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"

	"github.com/kvroute/kvroute/discovery"
)

// These tests run the subscriber against publishers and replay sockets
// made of go-zeromq/zmq4's ZMTP connections (the llm-d simulator's
// ZeroMQ) on 127.0.0.1.

// kvTestPayload is a batch of one stored block whose timestamp is seq, so
// the sink can tell batches apart.
func kvTestPayload(t testing.TB, seq int64, dpRank int) []byte {
	return encodeWire(t, wArr{float64(seq), wArr{
		wArr{"BlockStored", wArr{uint64(seq) + 1000}, nil, toks(int(seq), 16), 16, nil, "GPU", nil},
	}, dpRank})
}

func seqFrame(seq int64) []byte { return binary.BigEndian.AppendUint64(nil, uint64(seq)) }

// testSink records the sink calls as strings: "<addr> batch <ts>" and
// "<addr> reset <cause>".
type testSink struct{ calls chan string }

func newTestSink() *testSink { return &testSink{calls: make(chan string, 1024)} }

func (s *testSink) KVBatch(e *discovery.Endpoint, b *Batch) {
	s.calls <- fmt.Sprintf("%s batch %g", e.Addr, b.TS)
}

func (s *testSink) KVReset(e *discovery.Endpoint, cause string) {
	s.calls <- e.Addr + " reset " + cause
}

// expect receives len(want) calls and compares them with want.
func (s *testSink) expect(t *testing.T, want ...string) {
	t.Helper()
	var got []string
	for range want {
		got = append(got, recv(t, s.calls, fmt.Sprintf("sink calls %q (got %q)", want, got)))
	}
	if !slices.Equal(got, want) {
		t.Fatalf("sink calls %q, want %q", got, want)
	}
}

// testPub is a publisher over zmq4's ZMTP connection (go-zeromq/zmq4's
// handshake and framing, as in the llm-d simulator), without zmq4's socket
// layer, whose PUB never stops its writer goroutine. It serves one
// subscriber connection at a time (the latest).
type testPub struct {
	topic string
	port  int // listening publishers
	ln    net.Listener
	subs  chan *pubConn // connections whose subscription arrived
	cur   *pubConn
	wg    sync.WaitGroup
	mu    sync.Mutex
	raw   []net.Conn
}

// pubConn is one subscriber's connection; gone is closed when it hangs up.
type pubConn struct {
	zc   *zmq4.Conn
	gone chan struct{}
}

func newTestPub(t *testing.T, topic string) *testPub {
	p := &testPub{topic: topic, subs: make(chan *pubConn, 16)}
	t.Cleanup(func() {
		p.close()
		p.wg.Wait()
	})
	return p
}

// listenPub binds a publisher on 127.0.0.1 (port 0: any), as vLLM does.
func listenPub(t *testing.T, port int) *testPub {
	t.Helper()
	p := newTestPub(t, "")
	ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
	if err != nil {
		t.Fatal(err)
	}
	p.ln, p.port = ln, ln.Addr().(*net.TCPAddr).Port
	p.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.serve(c, true)
		}
	})
	return p
}

// dialPub connects a publisher with topic to addr, as the llm-d simulator
// does.
func dialPub(t *testing.T, addr, topic string) *testPub {
	t.Helper()
	p := newTestPub(t, topic)
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	p.serve(c, false)
	return p
}

// serve does c's handshake, waits for its subscription and reads it until
// it ends, in a goroutine.
func (p *testPub) serve(c net.Conn, server bool) {
	p.mu.Lock()
	p.raw = append(p.raw, c)
	p.mu.Unlock()
	p.wg.Go(func() {
		defer c.Close()
		zc, err := zmq4.Open(c, null.Security(), zmq4.Pub, nil, server, nil)
		if err != nil {
			return
		}
		msg, err := zc.RecvMsg()
		if err != nil || len(msg.Frames) != 1 || len(msg.Frames[0]) == 0 || msg.Frames[0][0] != 1 {
			return
		}
		pc := &pubConn{zc: zc, gone: make(chan struct{})}
		p.subs <- pc
		defer close(pc.gone)
		for {
			if _, err := zc.RecvMsg(); err != nil {
				return
			}
		}
	})
}

// subscribed waits for the next subscriber (a publisher drops what it sends
// before).
func (p *testPub) subscribed(t *testing.T) {
	t.Helper()
	p.cur = recv(t, p.subs, "a subscription")
}

// hungUp waits until the subscriber closed its connection.
func (p *testPub) hungUp(t *testing.T) {
	t.Helper()
	recv(t, p.cur.gone, "the subscriber to hang up")
}

func (p *testPub) send(t *testing.T, frames ...[]byte) {
	t.Helper()
	if err := p.cur.zc.SendMsg(zmq4.NewMsgFrom(frames...)); err != nil {
		t.Fatal(err)
	}
}

func (p *testPub) batch(t *testing.T, seq int64, dpRank int) {
	t.Helper()
	p.send(t, []byte(p.topic), seqFrame(seq), kvTestPayload(t, seq, dpRank))
}

// close stops listening and closes every connection.
func (p *testPub) close() {
	if p.ln != nil {
		p.ln.Close()
	}
	p.mu.Lock()
	for _, c := range p.raw {
		c.Close()
	}
	p.mu.Unlock()
}

// testReplay is a ROUTER (zmq4's ZMTP connection again) answering replay
// requests like vLLM's ZmqEventPublisher (replies [seq, payload]) or, with
// sim, the llm-d simulator's ([topic, seq, payload]), from the batches of
// seqs. A ROUTER's replies reach its peer without the identity frame.
type testReplay struct {
	port int
}

func startReplay(t *testing.T, sim bool, seqs ...int64) *testReplay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	serve := func(c net.Conn) {
		defer c.Close()
		zc, err := zmq4.Open(c, null.Security(), zmq4.Router, nil, true, nil)
		if err != nil {
			return
		}
		for {
			msg, err := zc.RecvMsg()
			if err != nil {
				return
			}
			if len(msg.Frames) != 2 || len(msg.Frames[0]) != 0 || len(msg.Frames[1]) != 8 {
				continue // vLLM wants [identity, "", start]
			}
			start := int64(binary.BigEndian.Uint64(msg.Frames[1]))
			reply := func(seq []byte, payload []byte) {
				frames := [][]byte{{}, seq, payload}
				if sim {
					frames = [][]byte{{}, []byte("kv@topic"), seq, payload}
				}
				_ = zc.SendMsg(zmq4.NewMsgFrom(frames...))
			}
			for _, seq := range seqs {
				if seq >= start {
					reply(seqFrame(seq), kvTestPayload(t, seq, 0))
				}
			}
			reply(seqFrame(-1), nil)
		}
	}
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() { serve(c) })
		}
	})
	return &testReplay{port: ln.Addr().(*net.TCPAddr).Port}
}

// kvPool returns a pool of endpoints at addrs, and the endpoints.
func kvPool(t *testing.T, addrs ...string) (*discovery.Pool, []*discovery.Endpoint) {
	t.Helper()
	pool := &discovery.Pool{}
	var eps []*discovery.Endpoint
	for _, a := range addrs {
		e, err := discovery.NewEndpoint("http://"+a, discovery.RoleMixed)
		if err != nil {
			t.Fatal(err)
		}
		eps = append(eps, e)
	}
	pool.Publish(eps)
	return pool, eps
}

// runKVSub runs a subscriber until the test ends (edit, when not nil,
// sees it before Run).
func runKVSub(t *testing.T, c Config, pool *discovery.Pool, sink Sink, edit func(*Subscriber)) *Subscriber {
	t.Helper()
	s := NewSubscriber(c, pool, sink, nil)
	if edit != nil {
		edit(s)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := recv(t, done, "Run to return"); err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return s
}

// freePort returns a port nothing listens on.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func TestKVSubDial(t *testing.T) {
	pub := listenPub(t, 0)
	pool, eps := kvPool(t, "127.0.0.1:8000")
	sink := newTestSink()
	s := runKVSub(t, Config{Port: pub.port}, pool, sink, nil)
	pub.subscribed(t)
	for seq := range int64(3) {
		pub.batch(t, seq, 0)
	}
	sink.expect(t, "127.0.0.1:8000 batch 0", "127.0.0.1:8000 batch 1", "127.0.0.1:8000 batch 2")

	st := s.Status(eps[0])
	if !st.Connected || st.Batches != 3 || st.Events != 3 || st.Seq != 2 || st.LastEvent.IsZero() || st.Resets != 0 {
		t.Errorf("status %+v", st)
	}
	stats := s.Stats()
	if stats.Batches != 3 || stats.Stored != 3 || stats.Connections != 1 || stats.Gaps != 0 {
		t.Errorf("stats %+v", stats)
	}
	if st := s.Status(&discovery.Endpoint{}); st.Seq != -1 || st.Connected {
		t.Errorf("status of an unknown endpoint %+v", st)
	}
}

// TestKVSubSequence: gaps, replays and restarts, in dial mode.
func TestKVSubSequence(t *testing.T) {
	tests := []struct {
		name string
		sent []int64 // the sequence numbers published, in order
		// replay: the replay socket holds these batches (nil: no replay
		// socket); sim: it answers like the llm-d simulator; dead: the
		// replay port is closed.
		replay    []int64
		sim, dead bool
		want      []string // "batch <seq>", "reset <cause>"
		// gaps seen and batches replayed
		gaps, replayed uint64
	}{
		{name: "in order from 0 (vLLM)", sent: []int64{0, 1, 2}, want: []string{"batch 0", "batch 1", "batch 2"}},
		{name: "in order from 1 (llm-d simulator)", sent: []int64{1, 2, 3}, want: []string{"batch 1", "batch 2", "batch 3"}},
		{name: "first batch sets the expectation", sent: []int64{41, 42}, want: []string{"batch 41", "batch 42"}},
		{
			name: "restart", sent: []int64{0, 1, 2, 0, 1},
			want: []string{"batch 0", "batch 1", "batch 2", "reset restart", "batch 0", "batch 1"},
		},
		{
			name: "restart far below", sent: []int64{500, 501, 7},
			want: []string{"batch 500", "batch 501", "reset restart", "batch 7"},
		},
		{
			name: "gap without replay", sent: []int64{0, 1, 4, 5}, gaps: 1,
			want: []string{"batch 0", "batch 1", "reset gap", "batch 4", "batch 5"},
		},
		{
			name: "gap replayed", sent: []int64{0, 1, 4, 5}, replay: []int64{0, 1, 2, 3, 4}, gaps: 1, replayed: 2,
			want: []string{"batch 0", "batch 1", "batch 2", "batch 3", "batch 4", "batch 5"},
		},
		{
			name: "gap replayed, simulator framing", sent: []int64{1, 2, 5}, replay: []int64{1, 2, 3, 4, 5}, sim: true,
			gaps: 1, replayed: 2,
			want: []string{"batch 1", "batch 2", "batch 3", "batch 4", "batch 5"},
		},
		{
			// The replay goes past the batch that showed the gap: those
			// come on the stream, once.
			name: "replay overlaps the stream", sent: []int64{0, 3, 4, 5}, replay: []int64{0, 1, 2, 3, 4, 5, 6},
			gaps: 1, replayed: 2,
			want: []string{"batch 0", "batch 1", "batch 2", "batch 3", "batch 4", "batch 5"},
		},
		{
			name: "replay buffer does not reach back", sent: []int64{0, 1, 4}, replay: []int64{3, 4}, gaps: 1,
			want: []string{"batch 0", "batch 1", "reset gap", "batch 4"},
		},
		{
			name: "replay unreachable", sent: []int64{0, 1, 4}, dead: true, gaps: 1,
			want: []string{"batch 0", "batch 1", "reset gap", "batch 4"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pub := listenPub(t, 0)
			c := Config{Port: pub.port}
			switch {
			case tt.replay != nil:
				c.ReplayPort = startReplay(t, tt.sim, tt.replay...).port
			case tt.dead:
				c.ReplayPort = freePort(t)
			}
			pool, _ := kvPool(t, "127.0.0.1:8000")
			sink := newTestSink()
			s := runKVSub(t, c, pool, sink, nil)
			pub.subscribed(t)
			for _, seq := range tt.sent {
				pub.batch(t, seq, 0)
			}
			want := make([]string, len(tt.want))
			for i, w := range tt.want {
				want[i] = "127.0.0.1:8000 " + w
			}
			sink.expect(t, want...)
			if st := s.Stats(); st.Gaps != tt.gaps || st.Replayed != tt.replayed {
				t.Errorf("stats %+v: want %d gaps, %d replayed", st, tt.gaps, tt.replayed)
			}
		})
	}
}

// TestKVSubMalformed: messages that are not batches are counted and
// dropped; the stream goes on.
func TestKVSubMalformed(t *testing.T) {
	pub := listenPub(t, 0)
	pool, eps := kvPool(t, "127.0.0.1:8000")
	sink := newTestSink()
	s := runKVSub(t, Config{Port: pub.port}, pool, sink, nil)
	pub.subscribed(t)
	pub.send(t, nil, seqFrame(0), []byte{0x92, 0xc1})                     // not msgpack
	pub.send(t, nil, seqFrame(0))                                         // two frames
	pub.send(t, nil, []byte{0, 0, 0, 0, 0, 0, 0}, kvTestPayload(t, 0, 0)) // a 7-byte sequence number
	pub.send(t, nil, seqFrame(-5), kvTestPayload(t, 0, 0))                // a negative one
	pub.batch(t, 0, 0)
	sink.expect(t, "127.0.0.1:8000 batch 0")
	if st := s.Stats(); st.DecodeErrors != 4 || st.Batches != 1 {
		t.Errorf("stats %+v", st)
	}
	if st := s.Status(eps[0]); st.DecodeErrors != 4 || !st.Connected {
		t.Errorf("status %+v", st)
	}
}

// TestKVSubRemove: an endpoint that leaves the pool is reset (lost) and
// its connection closed.
func TestKVSubRemove(t *testing.T) {
	pub := listenPub(t, 0)
	pool, eps := kvPool(t, "127.0.0.1:8000")
	sink := newTestSink()
	s := runKVSub(t, Config{Port: pub.port}, pool, sink, nil)
	pub.subscribed(t)
	pub.batch(t, 0, 0)
	sink.expect(t, "127.0.0.1:8000 batch 0")
	pool.Publish(nil)
	sink.expect(t, "127.0.0.1:8000 reset lost")
	pub.hungUp(t)
	if st := s.Status(eps[0]); st.Seq != -1 || st.Connected {
		t.Errorf("status after removal %+v", st)
	}
	if st := s.Stats(); st.Connections != 0 || st.Resets[ResetLost] != 1 {
		t.Errorf("stats %+v", st)
	}

	// Back in the pool: a new stream, no reset.
	pool.Publish(eps)
	pub.subscribed(t)
	pub.batch(t, 7, 0)
	sink.expect(t, "127.0.0.1:8000 batch 7")
}

// TestKVSubReconnect: a publisher that goes away is a lost stream; its
// successor on the same port is dialed again, and its first batch starts a
// new stream whatever its number.
func TestKVSubReconnect(t *testing.T) {
	pub := listenPub(t, 0)
	pool, eps := kvPool(t, "127.0.0.1:8000")
	sink := newTestSink()
	s := runKVSub(t, Config{Port: pub.port}, pool, sink, nil)
	pub.subscribed(t)
	pub.batch(t, 5, 0)
	sink.expect(t, "127.0.0.1:8000 batch 5")
	pub.close()
	sink.expect(t, "127.0.0.1:8000 reset lost")

	again := listenPub(t, pub.port)
	again.subscribed(t)
	again.batch(t, 0, 0)
	again.batch(t, 1, 0)
	sink.expect(t, "127.0.0.1:8000 batch 0", "127.0.0.1:8000 batch 1")
	if st := s.Status(eps[0]); !st.Connected || st.Resets != 1 || st.Seq != 1 {
		t.Errorf("status %+v", st)
	}
}

// TestKVSubEndpointPort: an endpoint whose URL names its publisher
// (#kv-events=PORT) is dialed there, without a Port of the subscriber's;
// the others are not dialed.
func TestKVSubEndpointPort(t *testing.T) {
	pub := listenPub(t, 0)
	pool, eps := kvPool(t, "127.0.0.1:8000#kv-events="+strconv.Itoa(pub.port), "127.0.0.1:8001")
	sink := newTestSink()
	s := runKVSub(t, Config{}, pool, sink, nil)
	pub.subscribed(t)
	pub.batch(t, 0, 0)
	sink.expect(t, "127.0.0.1:8000 batch 0")
	if st := s.Status(eps[1]); st.Connected || st.Seq != -1 {
		t.Errorf("status of the endpoint without a port %+v", st)
	}
	if st := s.Stats(); st.Connections != 1 {
		t.Errorf("stats %+v", st)
	}
}

// TestKVSubDialRanks: with several ranks, each endpoint's rank r is dialed
// at Port + r (here through the address hook, all on 127.0.0.1), and the
// ranks' streams are apart.
func TestKVSubDialRanks(t *testing.T) {
	pubs := map[string][]*testPub{}
	pool, _ := kvPool(t, "127.0.0.1:8001", "127.0.0.1:8002")
	for _, e := range pool.Load().Endpoints {
		pubs[e.Addr] = []*testPub{listenPub(t, 0), listenPub(t, 0)}
	}
	sink := newTestSink()
	runKVSub(t, Config{Port: 1, Ranks: 2}, pool, sink, func(s *Subscriber) {
		s.pubAddr = func(ke *kvEndpoint, rank int) string {
			return "127.0.0.1:" + strconv.Itoa(pubs[ke.e.Addr][rank].port)
		}
	})
	for addr, ps := range pubs {
		for r, p := range ps {
			p.subscribed(t)
			p.batch(t, int64(10*r), r) // the ranks' counters are apart
			sink.expect(t, fmt.Sprintf("%s batch %d", addr, 10*r))
			p.batch(t, int64(10*r+1), r)
			sink.expect(t, fmt.Sprintf("%s batch %d", addr, 10*r+1))
		}
	}
	if got := (&Subscriber{c: Config{Port: 5557}}).defaultPubAddr(newKVEndpoint(pool.Load().Endpoints[0]), 3); got != "127.0.0.1:5560" {
		t.Errorf("rank 3's publisher address %s, want 127.0.0.1:5560", got)
	}
}

// TestKVSubBind: publishers dial in; their topics name the endpoints.
func TestKVSubBind(t *testing.T) {
	pool, eps := kvPool(t, "127.0.0.1:18001", "127.0.0.1:18002")
	sink := newTestSink()
	s := runKVSub(t, Config{Listen: "tcp://127.0.0.1:0"}, pool, sink, nil)
	addr := recv(t, s.bound, "the listener").String()
	a := dialPub(t, addr, "kv@127.0.0.1:18001@sim-model")
	b := dialPub(t, addr, "kv@127.0.0.1:18002@sim-model")
	stranger := dialPub(t, addr, "kv@10.1.2.3:8000@sim-model")
	for _, p := range []*testPub{a, b, stranger} {
		p.subscribed(t)
	}
	a.batch(t, 1, 0)
	sink.expect(t, "127.0.0.1:18001 batch 1")
	b.batch(t, 1, 0)
	sink.expect(t, "127.0.0.1:18002 batch 1")
	a.batch(t, 2, 0)
	sink.expect(t, "127.0.0.1:18001 batch 2")

	// Batches of a topic that names no endpoint are dropped before
	// decoding; the same connection's batch for b then arrives after them.
	stranger.batch(t, 1, 0)
	stranger.send(t, []byte(stranger.topic), seqFrame(2), []byte{0xc1})
	stranger.send(t, []byte("kv@127.0.0.1:18002@sim-model"), seqFrame(2), kvTestPayload(t, 2, 0))
	sink.expect(t, "127.0.0.1:18002 batch 2")
	if st := s.Stats(); st.Batches != 4 || st.Unmatched != 2 || st.DecodeErrors != 0 || st.Connections != 3 {
		t.Errorf("stats %+v", st)
	}

	// A second rank of endpoint a, with a counter of its own.
	a1 := dialPub(t, addr, "kv@127.0.0.1:18001@sim-model")
	a1.subscribed(t)
	a1.batch(t, 1, 1)
	sink.expect(t, "127.0.0.1:18001 batch 1")

	// Rank 0's publisher leaves: a's events are lost; rank 1 goes on.
	a.close()
	sink.expect(t, "127.0.0.1:18001 reset lost")
	a1.batch(t, 2, 1)
	sink.expect(t, "127.0.0.1:18001 batch 2")
	if st := s.Status(eps[0]); !st.Connected || st.Batches != 4 || st.Resets != 1 || st.Seq != 2 {
		t.Errorf("status of a %+v", st)
	}
	if st := s.Status(eps[1]); !st.Connected || st.Batches != 2 {
		t.Errorf("status of b %+v", st)
	}
}

// TestKVSubBindReplay: in bind mode the replay socket is the topic's host
// at ReplayPort.
func TestKVSubBindReplay(t *testing.T) {
	replay := startReplay(t, true, 1, 2, 3, 4)
	pool, _ := kvPool(t, "127.0.0.1:18001")
	sink := newTestSink()
	s := runKVSub(t, Config{Listen: "127.0.0.1:0", ReplayPort: replay.port}, pool, sink, nil)
	pub := dialPub(t, recv(t, s.bound, "the listener").String(), "kv@127.0.0.1:18001@m")
	pub.subscribed(t)
	pub.batch(t, 1, 0)
	pub.batch(t, 4, 0)
	sink.expect(t, "127.0.0.1:18001 batch 1", "127.0.0.1:18001 batch 2", "127.0.0.1:18001 batch 3", "127.0.0.1:18001 batch 4")
}

func TestKVSubRun(t *testing.T) {
	t.Run("twice", func(t *testing.T) {
		pool, _ := kvPool(t)
		s := runKVSub(t, Config{Listen: "127.0.0.1:0"}, pool, newTestSink(), nil)
		recv(t, s.bound, "the first Run to start")
		if err := s.Run(context.Background()); !errors.Is(err, ErrRunning) {
			t.Fatalf("second Run: %v, want ErrRunning", err)
		}
	})
	for _, c := range []Config{{Port: -1}, {Port: 70000}, {ReplayPort: 65536}, {Port: 65535, Ranks: 2}, {Listen: "nowhere"}, {Ranks: -1}} {
		t.Run(fmt.Sprintf("invalid %+v", c), func(t *testing.T) {
			pool, _ := kvPool(t)
			if err := NewSubscriber(c, pool, newTestSink(), nil).Run(context.Background()); !errors.Is(err, ErrBadConfig) {
				t.Fatalf("Run: %v, want ErrBadConfig", err)
			}
		})
	}
	t.Run("listen address in use", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		pool, _ := kvPool(t)
		if err := NewSubscriber(Config{Listen: ln.Addr().String()}, pool, newTestSink(), nil).Run(context.Background()); err == nil {
			t.Fatal("Run bound an address in use")
		}
	})
	// Cancelled with a publisher connected, one unreachable (in backoff)
	// and a publisher dialed in: Run returns, and TestMain finds no
	// goroutine left.
	t.Run("cancel", func(t *testing.T) {
		pub := listenPub(t, 0)
		pool, _ := kvPool(t, "127.0.0.1:8000", "127.0.0.1:8001")
		dead := freePort(t)
		s := NewSubscriber(Config{Port: 1, Listen: "127.0.0.1:0"}, pool, newTestSink(), nil)
		s.pubAddr = func(ke *kvEndpoint, _ int) string {
			if ke.e.Addr == "127.0.0.1:8000" {
				return "127.0.0.1:" + strconv.Itoa(pub.port)
			}
			return "127.0.0.1:" + strconv.Itoa(dead)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- s.Run(ctx) }()
		in := dialPub(t, recv(t, s.bound, "the listener").String(), "kv@127.0.0.1:8001@m")
		pub.subscribed(t)
		in.subscribed(t)
		cancel()
		if err := recv(t, done, "Run to return"); err != nil {
			t.Fatal(err)
		}
		pub.hungUp(t)
		in.hungUp(t)
	})
}

// zmtpPeer serves one connection on 127.0.0.1 that writes peer, then
// hangs up or reads until the client leaves; it returns the address.
func zmtpPeer(t *testing.T, peer []byte, hangup bool) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = c.Write(peer)
		if !hangup {
			_, _ = io.Copy(io.Discard, c)
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
	})
	return ln.Addr().String()
}

// zmtpGreeting is a peer's ZMTP greeting (version 3.major.minor,
// mechanism).
func zmtpGreeting(major byte, mechanism string) []byte {
	g := make([]byte, zmtpGreetingLen)
	g[0], g[9], g[10], g[11] = 0xff, 0x7f, major, 1
	copy(g[12:32], mechanism)
	return g
}

// zmtpProps is a READY command's body with the given properties.
func zmtpCommandFrame(body []byte) []byte {
	if len(body) > 255 {
		return append(binary.BigEndian.AppendUint64([]byte{zmtpCommand | zmtpLong}, uint64(len(body))), body...)
	}
	return append([]byte{zmtpCommand, byte(len(body))}, body...)
}

func zmtpReadyBody(props ...string) []byte {
	b := []byte("\x05READY")
	for i := 0; i+1 < len(props); i += 2 {
		b = append(b, byte(len(props[i])))
		b = append(b, props[i]...)
		b = binary.BigEndian.AppendUint32(b, uint32(len(props[i+1])))
		b = append(b, props[i+1]...)
	}
	return b
}

// TestKVZMTPHandshake: what a peer sends in the handshake never crashes
// or grows the subscriber.
func TestKVZMTPHandshake(t *testing.T) {
	greeting := zmtpGreeting(3, "NULL")
	ready := func(props ...string) []byte {
		return append(append([]byte(nil), greeting...), zmtpCommandFrame(zmtpReadyBody(props...))...)
	}
	tests := []struct {
		name   string
		peer   []byte
		hangup bool
		ok     bool
	}{
		{name: "PUB", peer: ready("Socket-Type", "PUB", "Identity", ""), ok: true},
		{name: "XPUB, lower-case property", peer: ready("socket-type", "XPUB"), ok: true},
		{name: "wrong socket type", peer: ready("Socket-Type", "ROUTER")},
		{name: "unknown socket type", peer: ready("Socket-Type", "FOO")},
		{name: "no socket type", peer: ready()},
		{name: "not ZeroMQ", peer: []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n" + strings.Repeat(" ", 64))},
		{name: "ZMTP 2", peer: zmtpGreeting(2, "NULL")},
		{name: "CURVE", peer: zmtpGreeting(3, "CURVE")},
		{name: "huge READY", peer: append(append([]byte(nil), greeting...), zmtpCommand|zmtpLong, 0, 0, 1, 0, 0, 0, 0, 0)},
		{name: "READY too long", peer: append(append([]byte(nil), greeting...), zmtpCommandFrame(zmtpReadyBody("Socket-Type", "PUB", "X-Pad", strings.Repeat("x", zmtpMaxCommand)))...)},
		{name: "truncated property", peer: append(append([]byte(nil), greeting...), zmtpCommandFrame([]byte("\x05READY\x0bSocket-Type\x00\x00\x00\x09PUB"))...)},
		{name: "property name past the end", peer: append(append([]byte(nil), greeting...), zmtpCommandFrame([]byte("\x05READY\x0bSocket"))...)},
		{name: "empty command", peer: append(append([]byte(nil), greeting...), zmtpCommand, 0)},
		{name: "command name past the end", peer: append(append([]byte(nil), greeting...), zmtpCommand, 2, 9, 'R')},
		{name: "ERROR", peer: append(append([]byte(nil), greeting...), zmtpCommandFrame([]byte("\x05ERROR\x06denied"))...)},
		{name: "a message instead of READY", peer: append(append([]byte(nil), greeting...), 0, 3, 'a', 'b', 'c')},
		{name: "reserved flags", peer: append(append([]byte(nil), greeting...), 0x40, 0)},
		{name: "truncated greeting", peer: greeting[:20], hangup: true},
		{name: "truncated READY", peer: ready("Socket-Type", "PUB")[:70], hangup: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := net.Dial("tcp", zmtpPeer(t, tt.peer, tt.hangup))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			_, err = OpenZMTP(c, waitTimeout, "SUB", "PUB", "XPUB")
			if tt.ok != (err == nil) {
				t.Fatalf("OpenZMTP: %v, want ok %v", err, tt.ok)
			}
		})
	}
}

// TestKVZMTPFrames: messages of any framing are read within their bounds.
func TestKVZMTPFrames(t *testing.T) {
	frame := func(flags byte, body string) []byte {
		if len(body) > 255 {
			return append(binary.BigEndian.AppendUint64([]byte{flags | zmtpLong}, uint64(len(body))), body...)
		}
		return append([]byte{flags, byte(len(body))}, body...)
	}
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	long := strings.Repeat("p", 300)
	tests := []struct {
		name   string
		wire   []byte
		frames []string // of the first message
		n      int
		err    bool
	}{
		{name: "three frames", wire: cat(frame(zmtpMore, "t"), frame(zmtpMore, "12345678"), frame(0, long)), frames: []string{"t", "12345678", long}, n: 3},
		{name: "ping skipped", wire: cat(frame(zmtpCommand, "\x04PING\x00\x00"), frame(0, "x")), frames: []string{"x"}, n: 1},
		{name: "extra frames dropped", wire: cat(frame(zmtpMore, "a"), frame(zmtpMore, "b"), frame(zmtpMore, "c"), frame(zmtpMore, "d"), frame(zmtpMore, "e"), frame(0, "f")), frames: []string{"a", "b", "c", "d"}, n: 6},
		{name: "empty frames", wire: cat(frame(zmtpMore, ""), frame(0, "")), frames: []string{"", ""}, n: 2},
		{name: "message too large", wire: []byte{zmtpLong, 0, 0, 0, 0, 1, 0, 0, 1}, err: true},
		{name: "command inside a message", wire: cat(frame(zmtpMore, "a"), frame(zmtpCommand, "\x04PING")), err: true},
		{name: "truncated", wire: cat(frame(zmtpMore, "a"), []byte{0, 5, 'x'}), err: true},
		{name: "reserved flags", wire: []byte{0x80, 0}, err: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			z := &ZMTPConn{r: bufio.NewReader(bytes.NewReader(tt.wire))}
			frames, n, err := z.ReadMsg()
			if tt.err {
				if err == nil {
					t.Fatalf("read %q, want an error", frames)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, f := range frames {
				got = append(got, string(f))
			}
			if n != tt.n || !slices.Equal(got, tt.frames) {
				t.Fatalf("read %d frames %q, want %d %q", n, got, tt.n, tt.frames)
			}
		})
	}
}
