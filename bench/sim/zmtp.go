package sim

import (
	"errors"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvroute/kvroute/kvevents"
)

// The KV event sockets (kvevents.go) speak ZMTP 3.0 (rfc.zeromq.org/spec/23)
// through kvroute's own implementation, package kvevents's: OpenZMTP
// performs the greeting and the NULL handshake (READY with the socket type,
// so libzmq, pyzmq and zmq4 peers accept the socket, and a peer of a type
// that cannot talk to it is refused), and zmtpPub and the replay server
// then read and write messages on the connection. zmq4's own sockets are
// not used for serving: its PUB socket keeps its writer goroutine after
// Close (v0.17.0), makes every subscriber wait for the slowest, and
// answers a PING from its reader goroutine, racing writes; its handshake
// panics on an unknown peer socket type. Peers greeted as ZMTP 3.0
// subscribe with messages (a 1 or 0 byte before the topic prefix) and send
// no heartbeats; a command sent anyway is skipped.

const (
	// zmtpHandshakeTimeout bounds the greeting and handshake of one
	// connection, so that a peer that connects and says nothing does not
	// hold a goroutine forever.
	zmtpHandshakeTimeout = 10 * time.Second
	// zmtpSendQueue is each subscriber's queue of messages not yet written,
	// like the high-water mark of a libzmq PUB socket (vLLM sets 100,000;
	// the simulator's batches are small and its subscribers on loopback).
	zmtpSendQueue = 10000
)

// zmtpPeers are the peer socket types a socket of each type serving here
// accepts (ZMTP's socket compatibility).
var zmtpPeers = map[string][]string{
	"PUB":    {"SUB", "XSUB"},
	"ROUTER": {"REQ", "DEALER", "ROUTER"},
}

// zmtpServer accepts connections of one socket type on a listener and runs
// serve for each on its own goroutine after the handshake; the connection
// is closed when serve returns. close stops accepting, closes every
// connection and waits for the goroutines. Safe for concurrent use.
type zmtpServer struct {
	ln    net.Listener
	typ   string // "PUB", "ROUTER": a key of zmtpPeers
	serve func(z *kvevents.ZMTPConn)
	wg    sync.WaitGroup

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
}

func newZMTPServer(ln net.Listener, typ string, serve func(*kvevents.ZMTPConn)) *zmtpServer {
	return &zmtpServer{ln: ln, typ: typ, serve: serve, conns: make(map[net.Conn]struct{})}
}

// start starts the accept loop.
func (s *zmtpServer) start() {
	s.wg.Add(1)
	go s.accept()
}

func (s *zmtpServer) accept() {
	defer s.wg.Done()
	for {
		conn, err := s.ln.Accept()
		if err != nil {
			if s.isClosed() || errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond) // e.g. out of descriptors: back off
			continue
		}
		if !s.track(conn) {
			conn.Close()
			return
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer s.untrack(conn)
			z, err := kvevents.OpenZMTP(conn, zmtpHandshakeTimeout, s.typ, zmtpPeers[s.typ]...)
			if err != nil {
				return
			}
			s.serve(z)
		}()
	}
}

func (s *zmtpServer) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

func (s *zmtpServer) track(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.conns[c] = struct{}{}
	return true
}

func (s *zmtpServer) untrack(c net.Conn) {
	c.Close()
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
}

// close stops the server and waits for its goroutines. Idempotent.
func (s *zmtpServer) close() {
	s.mu.Lock()
	s.closed = true
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.ln.Close()
	s.wg.Wait()
}

// zmtpPub is a ZeroMQ PUB socket bound to a listener. Each subscriber gets
// every message whose topic starts with one of its subscriptions, through
// its own queue of zmtpSendQueue messages written by its own goroutine; a
// message that finds the queue full is dropped for that subscriber, as a
// libzmq PUB socket drops at the high-water mark. Safe for concurrent use.
type zmtpPub struct {
	srv *zmtpServer

	mu      sync.Mutex
	subs    map[*zmtpSub]struct{}
	changed chan struct{} // closed and replaced whenever a subscription changes
}

// zmtpSub is one subscriber connection. prefixes is guarded by zmtpPub.mu.
type zmtpSub struct {
	out      chan []byte
	prefixes []string // a prefix appears once per SUBSCRIBE, as libzmq counts them
}

func newZMTPPub(ln net.Listener) *zmtpPub {
	p := &zmtpPub{subs: make(map[*zmtpSub]struct{}), changed: make(chan struct{})}
	p.srv = newZMTPServer(ln, "PUB", p.serve)
	return p
}

// serve reads the subscriber's subscriptions while a second goroutine
// writes its queue.
func (p *zmtpPub) serve(z *kvevents.ZMTPConn) {
	s := &zmtpSub{out: make(chan []byte, zmtpSendQueue)}
	p.mu.Lock()
	p.subs[s] = struct{}{}
	p.mu.Unlock()
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case msg := <-s.out:
				if err := z.SendWire(msg); err != nil {
					z.Close() // ends the reader below
					return
				}
			case <-done:
				return
			}
		}
	})
	defer func() {
		p.mu.Lock()
		delete(p.subs, s)
		p.notifyLocked()
		p.mu.Unlock()
		close(done)
		z.Close()
		wg.Wait()
	}()
	for {
		frames, n, err := z.ReadMsg()
		if err != nil {
			return
		}
		if n != 1 || len(frames[0]) == 0 {
			continue // PUB sockets take no other messages
		}
		f := frames[0]
		topic := string(f[1:])
		p.mu.Lock()
		switch f[0] {
		case 1:
			s.prefixes = append(s.prefixes, topic)
		case 0:
			if i := slices.Index(s.prefixes, topic); i >= 0 {
				s.prefixes = slices.Delete(s.prefixes, i, i+1)
			}
		}
		p.notifyLocked()
		p.mu.Unlock()
	}
}

func (p *zmtpPub) notifyLocked() {
	close(p.changed)
	p.changed = make(chan struct{})
}

// send queues msg (a whole message in wire form, shared and never
// modified) for every subscriber of topic and returns how many subscribers
// dropped it because their queue was full.
func (p *zmtpPub) send(topic string, msg []byte) (dropped int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for s := range p.subs {
		if !s.matches(topic) {
			continue
		}
		select {
		case s.out <- msg:
		default:
			dropped++
		}
	}
	return dropped
}

func (s *zmtpSub) matches(topic string) bool {
	for _, pre := range s.prefixes {
		if strings.HasPrefix(topic, pre) {
			return true
		}
	}
	return false
}

// waitSubscribers returns true once n connections have subscribed to
// something, or false when done is closed first. Tests use it: a PUB
// socket drops what it sends before a subscription arrives.
func (p *zmtpPub) waitSubscribers(n int, done <-chan struct{}) bool {
	for {
		p.mu.Lock()
		k := 0
		for s := range p.subs {
			if len(s.prefixes) > 0 {
				k++
			}
		}
		ch := p.changed
		p.mu.Unlock()
		if k >= n {
			return true
		}
		select {
		case <-ch:
		case <-done:
			return false
		}
	}
}
