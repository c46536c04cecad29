package llmd

import (
	"errors"
	"net"
	"sync"
	"time"

	"github.com/kvroute/kvroute/kvevents"
)

// Fanout passes the simulators' KV events on to several router replicas.
// The llm-d simulator's publisher dials one address (--zmq-endpoint), so
// only one subscriber listening there hears a pod; vLLM's binds, and every
// replica subscribes to it. A Fanout listens where the pods dial, as a
// SUB, and forwards each message to every subscriber address added
// (replicas' --kv-events-listen), dialing each as a PUB would: each
// replica hears every pod, as it would from vLLM. It runs on loopback for
// the benchmark; a message that comes before a subscriber is connected is
// not kept for it (the pods publish nothing before they serve requests).
type Fanout struct {
	ln   net.Listener
	mu   sync.Mutex
	subs []string
	conn map[net.Conn]struct{}
	wg   sync.WaitGroup
}

// fanoutTimeout bounds a handshake and a dial.
const fanoutTimeout = 5 * time.Second

// StartFanout listens at addr (host:port) for the pods' publishers.
func StartFanout(addr string) (*Fanout, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	f := &Fanout{ln: ln, conn: map[net.Conn]struct{}{}}
	f.wg.Go(f.accept)
	return f, nil
}

// Add makes addr (host:port, a replica listening for publishers) a
// subscriber of every pod, from the pods' next messages on.
func (f *Fanout) Add(addr string) {
	f.mu.Lock()
	f.subs = append(f.subs, addr)
	f.mu.Unlock()
}

// Close stops listening, closes every connection and waits for the
// goroutines.
func (f *Fanout) Close() error {
	err := f.ln.Close()
	f.mu.Lock()
	for c := range f.conn {
		c.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

// track adds c to the connections Close closes; false once closed.
func (f *Fanout) track(c net.Conn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.conn == nil {
		return false
	}
	f.conn[c] = struct{}{}
	return true
}

func (f *Fanout) accept() {
	defer func() {
		f.mu.Lock()
		f.conn = nil // nothing is tracked after Close
		f.mu.Unlock()
	}()
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		if !f.track(c) {
			c.Close()
			return
		}
		f.wg.Go(func() { f.relay(c) })
	}
}

// relay subscribes to the pod on c and forwards its messages to every
// subscriber, connecting to each on the first message after it was added
// (a failed dial is tried again a tenth of a second later).
func (f *Fanout) relay(c net.Conn) {
	defer c.Close()
	z, err := kvevents.OpenZMTP(c, fanoutTimeout, "SUB", "PUB", "XPUB")
	if err != nil || z.Subscribe("") != nil {
		return
	}
	outs := map[string]*kvevents.ZMTPConn{}
	tried := map[string]time.Time{}
	var wire []byte
	defer func() {
		for _, o := range outs {
			o.Close()
		}
	}()
	for {
		frames, n, err := z.ReadMsg()
		if err != nil {
			return
		}
		wire = kvevents.AppendZMTPMsg(wire[:0], frames[:min(n, len(frames))]...)
		f.mu.Lock()
		subs := f.subs
		f.mu.Unlock()
		for _, a := range subs {
			o := outs[a]
			if o == nil {
				if time.Since(tried[a]) < 100*time.Millisecond {
					continue
				}
				tried[a] = time.Now()
				if o = f.dial(a); o == nil {
					continue
				}
				outs[a] = o
			}
			if o.SendWire(wire) != nil {
				o.Close()
				delete(outs, a)
			}
		}
	}
}

// dial connects to a subscriber as a PUB; nil if it could not. What the
// subscriber sends (its subscription) is read and dropped.
func (f *Fanout) dial(addr string) *kvevents.ZMTPConn {
	c, err := net.DialTimeout("tcp", addr, fanoutTimeout)
	if err != nil {
		return nil
	}
	if !f.track(c) {
		c.Close()
		return nil
	}
	z, err := kvevents.OpenZMTP(c, fanoutTimeout, "PUB", "SUB", "XSUB")
	if err != nil {
		c.Close()
		return nil
	}
	f.wg.Go(func() {
		for {
			if _, _, err := z.ReadMsg(); err != nil {
				return
			}
		}
	})
	return z
}
