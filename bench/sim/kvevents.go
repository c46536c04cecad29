package sim

import (
	"bytes"
	"encoding/binary"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvroute/kvroute/kvevents"
)

// KV-cache events, as vLLM publishes them (vllm/distributed/kv_events.py,
// ZmqEventPublisher, with --kv-events-config enable_kv_cache_events): the
// engine collects the events of one step (BlockStored when full blocks get
// their hashes registered in the prefix cache, BlockRemoved when a cached
// block's hash is evicted, AllBlocksCleared when the prefix cache is reset)
// and hands the step's batch to a publisher goroutine through a bounded
// queue, never blocking. The publisher encodes each batch with msgpack and
// sends [topic, sequence number (8 bytes big-endian, from 0), payload] on a
// PUB socket, and keeps the last kvReplayBatches payloads for the optional
// replay ROUTER socket. Config.KVEventsPort and the fields after it
// configure it; zmtp.go has the sockets.

const (
	// kvReplayBatches is how many batches the replay socket can return:
	// vLLM's buffer_steps default.
	kvReplayBatches = 10000
	// kvQueueSize bounds the batches handed from the engine to the
	// publisher goroutine (vLLM's max_queue_size is 100,000; a step's
	// batch here takes microseconds to send, and a full queue drops
	// batches rather than stall the engine).
	kvQueueSize = 10000
)

// kvEndSeq is the sequence number that ends a replay (vLLM's END_SEQ, -1).
var kvEndSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// KV event media (vLLM's medium field).
const (
	mediumGPU = "GPU"
	mediumCPU = "CPU"
)

type kvEventType uint8

const (
	kvBlockStored kvEventType = iota
	kvBlockRemoved
	kvAllBlocksCleared
)

// kvEvent is one BlockStored, BlockRemoved or AllBlocksCleared event.
type kvEvent struct {
	typ       kvEventType
	medium    string
	hashes    []uint64
	parent    uint64 // BlockStored: the hash of the block before hashes[0]
	hasParent bool   // false: nil (a chain root, or a CPU store)
	tokens    []uint32
	loraID    int    // BlockStored: 0 means nil
	lora      string // BlockStored: "" means nil
}

// kvEvents collects one step's events on the engine goroutine; the cache
// and the CPU tier append to it. A nil *kvEvents (events off) is never
// called.
type kvEvents struct {
	list []kvEvent
}

// stored opens a BlockStored event and returns its index in list, for
// appending the following blocks of the run.
func (l *kvEvents) stored(ev kvEvent) int {
	ev.typ = kvBlockStored
	l.list = append(l.list, ev)
	return len(l.list) - 1
}

// removed appends a BlockRemoved of one hash: vLLM announces every evicted
// block on its own.
func (l *kvEvents) removed(h uint64, medium string) {
	l.list = append(l.list, kvEvent{typ: kvBlockRemoved, medium: medium, hashes: []uint64{h}})
}

func (l *kvEvents) cleared() {
	l.list = append(l.list, kvEvent{typ: kvAllBlocksCleared})
}

// take returns the collected events and starts a new list.
func (l *kvEvents) take() []kvEvent {
	evs := l.list
	l.list = nil
	return evs
}

// kvBatch is one step's events with its sequence number and wall time.
type kvBatch struct {
	seq    uint64
	ts     time.Time
	events []kvEvent
}

// kvPublisher is a pod's event publisher: the PUB socket, the optional
// replay socket, and the goroutine between the engine's queue and them.
// publish belongs to the engine goroutine; the rest is safe for
// concurrent use. Its listeners are bound by newKVPublisher and its
// goroutines started by start and stopped by close.
type kvPublisher struct {
	array     bool
	blockSize int
	dropped   prometheus.Counter

	topic string // set by start
	queue chan *kvBatch
	seq   uint64 // the next batch's sequence number; engine goroutine only
	quit  chan struct{}
	wg    sync.WaitGroup

	pub    *zmtpPub
	replay *zmtpServer // nil when off
	ring   replayRing
}

// newKVPublisher binds the PUB socket and, if configured, the replay
// socket. dropped counts batches lost to a full queue.
func newKVPublisher(cfg *Config, dropped prometheus.Counter) (*kvPublisher, error) {
	listen := func(port int) (net.Listener, error) {
		return net.Listen("tcp", net.JoinHostPort(cfg.KVEventsHost, strconv.Itoa(max(port, 0))))
	}
	ln, err := listen(cfg.KVEventsPort)
	if err != nil {
		return nil, err
	}
	k := &kvPublisher{
		array: cfg.KVEventsArrayEncoding, blockSize: cfg.BlockSize, dropped: dropped,
		queue: make(chan *kvBatch, kvQueueSize), quit: make(chan struct{}), pub: newZMTPPub(ln),
	}
	if cfg.KVEventsReplayPort != 0 {
		rln, err := listen(cfg.KVEventsReplayPort)
		if err != nil {
			ln.Close()
			return nil, err
		}
		k.ring.buf = make([]replayEntry, kvReplayBatches)
		k.replay = newZMTPServer(rln, "ROUTER", k.serveReplay)
	}
	return k, nil
}

// expandTopic replaces {addr} in topic by the pod's HTTP address and
// {model} by its model name.
func expandTopic(topic, addr, model string) string {
	return strings.NewReplacer("{addr}", addr, "{model}", model).Replace(topic)
}

// start starts the goroutines; topic is the first frame of every message.
// Called once, before the engine runs.
func (k *kvPublisher) start(topic string) {
	k.topic = topic
	k.pub.srv.start()
	if k.replay != nil {
		k.replay.start()
	}
	k.wg.Add(1)
	go k.run()
}

// close stops the goroutines and closes the sockets; batches still queued
// are not sent. Safe to call whether or not start was.
func (k *kvPublisher) close() {
	close(k.quit)
	k.wg.Wait()
	k.pub.srv.close()
	if k.replay != nil {
		k.replay.close()
	}
}

// addr returns the PUB socket's address (host:port).
func (k *kvPublisher) addr() string { return k.pub.srv.ln.Addr().String() }

// replayAddr returns the replay socket's address, or "" when it is off.
func (k *kvPublisher) replayAddr() string {
	if k.replay == nil {
		return ""
	}
	return k.replay.ln.Addr().String()
}

// publish hands one step's events to the publisher without blocking. A
// batch that finds the queue full is dropped and counted, and its sequence
// number is skipped, so that subscribers see the gap. Engine goroutine only.
func (k *kvPublisher) publish(ts time.Time, events []kvEvent) {
	b := &kvBatch{seq: k.seq, ts: ts, events: events}
	k.seq++
	select {
	case k.queue <- b:
	default:
		k.dropped.Inc()
	}
}

// run encodes and sends the queued batches until close.
func (k *kvPublisher) run() {
	defer k.wg.Done()
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	topic := []byte(k.topic)
	var seq [8]byte
	for {
		select {
		case b := <-k.queue:
			buf.Reset()
			if err := encodeKVBatch(enc, b, k.array, k.blockSize); err != nil {
				k.dropped.Inc() // cannot happen: the encoder writes to memory
				continue
			}
			payload := bytes.Clone(buf.Bytes())
			if k.replay != nil {
				k.ring.add(b.seq, payload)
			}
			binary.BigEndian.PutUint64(seq[:], b.seq)
			if n := k.pub.send(k.topic, kvevents.AppendZMTPMsg(nil, topic, seq[:], payload)); n > 0 {
				k.dropped.Add(float64(n))
			}
		case <-k.quit:
			return
		}
	}
}

// serveReplay answers replay requests on one connection of the ROUTER
// socket: [empty delimiter, start sequence (8 bytes big-endian)] (the
// frames a REQ or DEALER client sends) is answered with [empty, seq,
// payload] for every buffered batch from start on, then [empty, -1, empty],
// as vLLM's _service_replay does; other messages are ignored.
func (k *kvPublisher) serveReplay(z *kvevents.ZMTPConn) {
	var seq [8]byte
	for {
		frames, n, err := z.ReadMsg()
		if err != nil {
			return
		}
		if n != 2 || len(frames[1]) != 8 {
			continue
		}
		for _, e := range k.ring.since(binary.BigEndian.Uint64(frames[1])) {
			binary.BigEndian.PutUint64(seq[:], e.seq)
			if err := z.Send(nil, seq[:], e.payload); err != nil {
				return
			}
		}
		if err := z.Send(nil, kvEndSeq, nil); err != nil {
			return
		}
	}
}

// replayRing keeps the last len(buf) payloads. Safe for concurrent use.
type replayRing struct {
	mu    sync.Mutex
	buf   []replayEntry
	start int // index of the oldest entry
	n     int
}

type replayEntry struct {
	seq     uint64
	payload []byte // never modified
}

func (r *replayRing) add(seq uint64, payload []byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.n < len(r.buf) {
		r.buf[(r.start+r.n)%len(r.buf)] = replayEntry{seq, payload}
		r.n++
		return
	}
	r.buf[r.start] = replayEntry{seq, payload}
	r.start = (r.start + 1) % len(r.buf)
}

// since returns the entries with seq ≥ start, oldest first.
func (r *replayRing) since(start uint64) []replayEntry {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []replayEntry
	for i := range r.n {
		if e := r.buf[(r.start+i)%len(r.buf)]; e.seq >= start {
			out = append(out, e)
		}
	}
	return out
}

// encodeKVBatch writes b as vLLM's KVEventBatch: a map {"ts", "events",
// "data_parallel_rank"} of maps with a "type" key, or with array true the
// positional encoding (msgspec array_like), tag first: [ts, events, rank],
// ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
// lora_id, medium, lora_name], ["BlockRemoved", block_hashes, medium],
// ["AllBlocksCleared"]. ts is Unix seconds; the rank is 0.
func encodeKVBatch(enc *msgpack.Encoder, b *kvBatch, array bool, blockSize int) error {
	w := msgpackWriter{enc: enc}
	ts := float64(b.ts.UnixNano()) / 1e9
	if array {
		w.arrayLen(3)
		w.float(ts)
	} else {
		w.mapLen(3)
		w.str("ts")
		w.float(ts)
		w.str("events")
	}
	w.arrayLen(len(b.events))
	for i := range b.events {
		w.event(&b.events[i], array, blockSize)
	}
	if !array {
		w.str("data_parallel_rank")
	}
	w.uint(0)
	return w.err
}

// msgpackWriter keeps the first error of a sequence of writes.
type msgpackWriter struct {
	enc *msgpack.Encoder
	err error
}

func (w *msgpackWriter) do(err error) {
	if w.err == nil {
		w.err = err
	}
}

func (w *msgpackWriter) arrayLen(n int)  { w.do(w.enc.EncodeArrayLen(n)) }
func (w *msgpackWriter) mapLen(n int)    { w.do(w.enc.EncodeMapLen(n)) }
func (w *msgpackWriter) str(s string)    { w.do(w.enc.EncodeString(s)) }
func (w *msgpackWriter) float(f float64) { w.do(w.enc.EncodeFloat64(f)) }
func (w *msgpackWriter) uint(n uint64)   { w.do(w.enc.EncodeUint(n)) }
func (w *msgpackWriter) null()           { w.do(w.enc.EncodeNil()) }
func (w *msgpackWriter) key(k string, on bool) {
	if on {
		w.str(k)
	}
}

// event writes one event; in the map encoding every value follows its key.
func (w *msgpackWriter) event(ev *kvEvent, array bool, blockSize int) {
	keyed := !array
	var name string
	var n int
	switch ev.typ {
	case kvBlockStored:
		name, n = "BlockStored", 8
	case kvBlockRemoved:
		name, n = "BlockRemoved", 3
	default:
		name, n = "AllBlocksCleared", 1
	}
	if array {
		w.arrayLen(n)
	} else {
		w.mapLen(n)
	}
	w.key("type", keyed)
	w.str(name)
	if ev.typ == kvAllBlocksCleared {
		return
	}
	w.key("block_hashes", keyed)
	w.arrayLen(len(ev.hashes))
	for _, h := range ev.hashes {
		w.uint(h)
	}
	if ev.typ == kvBlockStored {
		w.key("parent_block_hash", keyed)
		if ev.hasParent {
			w.uint(ev.parent)
		} else {
			w.null()
		}
		w.key("token_ids", keyed)
		w.arrayLen(len(ev.tokens))
		for _, t := range ev.tokens {
			w.uint(uint64(t))
		}
		w.key("block_size", keyed)
		w.uint(uint64(blockSize))
		w.key("lora_id", keyed)
		if ev.loraID > 0 {
			w.uint(uint64(ev.loraID))
		} else {
			w.null()
		}
	}
	w.key("medium", keyed)
	w.str(ev.medium)
	if ev.typ == kvBlockStored {
		w.key("lora_name", keyed)
		if ev.lora != "" {
			w.str(ev.lora)
		} else {
			w.null()
		}
	}
}
