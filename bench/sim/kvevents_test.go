package sim

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/vmihailenco/msgpack/v5"
)

// kvWait bounds every wait for an event in these tests.
const kvWait = 10 * time.Second

// kvSub is a zmq4 SUB socket on a pod's event publisher; a goroutine
// collects every message it receives.
type kvSub struct {
	sock  zmq4.Socket
	array bool
	mu    sync.Mutex
	msgs  []zmq4.Msg
	more  chan struct{} // capacity 1: signalled on every message
	done  chan struct{} // closed when the reading goroutine ends
	seen  int           // messages handed to the test
}

// subscribeKV subscribes to p's events with topic and returns once the pod
// registered the subscription. Its cleanup closes the pod first, so the
// subscriber reads the end of the connection and no zmq4 goroutine is left
// waiting on a full queue, then the socket.
func subscribeKV(t *testing.T, p *Pod, topic string) *kvSub {
	t.Helper()
	s := &kvSub{sock: zmq4.NewSub(context.Background()), array: p.Config().KVEventsArrayEncoding,
		more: make(chan struct{}, 1), done: make(chan struct{})}
	if err := s.sock.Dial("tcp://" + p.KVEventsAddr()); err != nil {
		s.sock.Close()
		t.Fatal(err)
	}
	go func() {
		defer close(s.done)
		for {
			msg, err := s.sock.Recv()
			if err != nil {
				return
			}
			s.mu.Lock()
			s.msgs = append(s.msgs, msg)
			s.mu.Unlock()
			select {
			case s.more <- struct{}{}:
			default:
			}
		}
	}()
	t.Cleanup(func() {
		p.Close()
		select {
		case <-s.done:
		case <-time.After(kvWait):
			t.Error("subscriber did not see the publisher close")
		}
		s.sock.Close()
	})
	if err := s.sock.SetOption(zmq4.OptionSubscribe, topic); err != nil {
		t.Fatal(err)
	}
	timeout := make(chan struct{})
	timer := time.AfterFunc(kvWait, func() { close(timeout) })
	defer timer.Stop()
	if !p.kv.pub.waitSubscribers(1, timeout) {
		t.Fatal("the subscription did not reach the publisher")
	}
	return s
}

// next returns the next message.
func (s *kvSub) next(t *testing.T) zmq4.Msg {
	t.Helper()
	deadline := time.After(kvWait)
	for {
		s.mu.Lock()
		if s.seen < len(s.msgs) {
			m := s.msgs[s.seen]
			s.seen++
			s.mu.Unlock()
			return m
		}
		s.mu.Unlock()
		select {
		case <-s.more:
		case <-deadline:
			t.Fatalf("no KV event batch after %d", s.seen)
		}
	}
}

// until returns the batches received until one has an event for which ok
// is true (included).
func (s *kvSub) until(t *testing.T, ok func(e kvTestEvent) bool) []kvTestBatch {
	t.Helper()
	var out []kvTestBatch
	for {
		m := s.next(t)
		if len(m.Frames) != 3 || len(m.Frames[1]) != 8 {
			t.Fatalf("message of %d frames, want [topic, seq, payload]", len(m.Frames))
		}
		b := decodeKVBatch(t, m.Frames[2], s.array)
		b.Topic, b.Seq = string(m.Frames[0]), binary.BigEndian.Uint64(m.Frames[1])
		out = append(out, b)
		if slices.ContainsFunc(b.Events, ok) {
			return out
		}
	}
}

// kvTestBatch and kvTestEvent are a decoded batch, with the message's
// topic and sequence number, and event.
type kvTestBatch struct {
	Topic   string
	Seq     uint64
	TS      float64
	Events  []kvTestEvent
	Payload []byte
}

type kvTestEvent struct {
	Type      string
	Hashes    []uint64
	Parent    *uint64
	Tokens    []uint32
	BlockSize uint64
	LoraID    *uint64
	Medium    string
	LoraName  *string
}

// The fields of each encoding, in order.
var (
	kvBatchFields = []string{"ts", "events", "data_parallel_rank"}
	kvEventFields = map[string][]string{
		"BlockStored":      {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"},
		"BlockRemoved":     {"type", "block_hashes", "medium"},
		"AllBlocksCleared": {"type"},
	}
)

// decodeKVBatch decodes a payload with msgpack directly, checking that it
// has exactly the fields of vLLM's encoding, as a map or as an array.
func decodeKVBatch(t *testing.T, payload []byte, array bool) kvTestBatch {
	t.Helper()
	v, err := msgpack.NewDecoder(bytes.NewReader(payload)).DecodeInterfaceLoose()
	if err != nil {
		t.Fatalf("decode batch: %v", err)
	}
	fields := func(v any, names []string) map[string]any {
		t.Helper()
		out := make(map[string]any)
		if array {
			a, ok := v.([]any)
			if !ok || len(a) != len(names) {
				t.Fatalf("want an array of %d (%v), got %#v", len(names), names, v)
			}
			for i, n := range names {
				out[n] = a[i]
			}
			return out
		}
		m, ok := v.(map[string]any)
		if !ok || len(m) != len(names) {
			t.Fatalf("want a map of %v, got %#v", names, v)
		}
		for _, n := range names {
			if _, ok := m[n]; !ok {
				t.Fatalf("map %#v lacks %q", m, n)
			}
		}
		return m
	}
	bf := fields(v, kvBatchFields)
	b := kvTestBatch{Payload: payload}
	b.TS, _ = bf["ts"].(float64)
	if r := kvUint(t, bf["data_parallel_rank"]); r != 0 {
		t.Errorf("data_parallel_rank %d", r)
	}
	evs, _ := bf["events"].([]any)
	for _, ev := range evs {
		var typ string
		if array {
			a, _ := ev.([]any)
			if len(a) > 0 {
				typ, _ = a[0].(string)
			}
		} else {
			m, _ := ev.(map[string]any)
			typ, _ = m["type"].(string)
		}
		names, ok := kvEventFields[typ]
		if !ok {
			t.Fatalf("event of unknown type: %#v", ev)
		}
		f := fields(ev, names)
		e := kvTestEvent{Type: typ}
		if typ == "AllBlocksCleared" {
			b.Events = append(b.Events, e)
			continue
		}
		for _, h := range f["block_hashes"].([]any) {
			e.Hashes = append(e.Hashes, kvUint(t, h))
		}
		e.Medium, _ = f["medium"].(string)
		if typ == "BlockStored" {
			if f["parent_block_hash"] != nil {
				h := kvUint(t, f["parent_block_hash"])
				e.Parent = &h
			}
			for _, tok := range f["token_ids"].([]any) {
				e.Tokens = append(e.Tokens, uint32(kvUint(t, tok)))
			}
			e.BlockSize = kvUint(t, f["block_size"])
			if f["lora_id"] != nil {
				id := kvUint(t, f["lora_id"])
				e.LoraID = &id
			}
			if f["lora_name"] != nil {
				name := f["lora_name"].(string)
				e.LoraName = &name
			}
		}
		b.Events = append(b.Events, e)
	}
	return b
}

// kvUint returns a decoded msgpack integer (whatever width the encoder
// chose) that must not be negative.
func kvUint(t *testing.T, v any) uint64 {
	t.Helper()
	r := reflect.ValueOf(v)
	switch {
	case r.CanUint():
		return r.Uint()
	case r.CanInt() && r.Int() >= 0:
		return uint64(r.Int())
	}
	t.Fatalf("want an unsigned integer, got %#v (%T)", v, v)
	return 0
}

// chainHashes returns the simulator's chained hashes of the full blocks of
// toks under root.
func chainHashes(toks []uint32, bs int, root uint64) []uint64 {
	var h hasher
	var out []uint64
	parent := root
	for i := 0; i+bs <= len(toks); i += bs {
		parent = h.block(parent, toks[i:i+bs])
		out = append(out, parent)
	}
	return out
}

func kvEventsOf(batches []kvTestBatch, typ, medium string) []kvTestEvent {
	var out []kvTestEvent
	for _, b := range batches {
		for _, e := range b.Events {
			if e.Type == typ && e.Medium == medium {
				out = append(out, e)
			}
		}
	}
	return out
}

// TestKVEvents follows a pod's events through stores, a shared prefix,
// evictions under pressure and a reset, in both encodings, with llm-d's
// topic form.
func TestKVEvents(t *testing.T) {
	for _, array := range []bool{false, true} {
		t.Run(fmt.Sprintf("array=%v", array), func(t *testing.T) {
			cfg := fastConfig()
			cfg.Model = "m"
			cfg.NumGPUBlocks = 8
			cfg.KVEventsPort = -1
			cfg.KVEventsTopic = "kv@{addr}@{model}"
			cfg.KVEventsArrayEncoding = array
			p, url := servePod(t, cfg)
			sub := subscribeKV(t, p, "kv@")
			c := newClient(t)
			bs := p.Config().BlockSize
			root := rootHash("")
			complete := func(prompt any) {
				t.Helper()
				code, _, body := post(t, c, url+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 1})
				if code != 200 {
					t.Fatalf("%d %s", code, body)
				}
			}
			isStored := func(e kvTestEvent) bool { return e.Type == "BlockStored" }

			// A prompt of 3 full blocks and a partial one: one BlockStored
			// of the full blocks, a chain root.
			text := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 6)
			toks := Tokenize(text, p.Config().VocabSize)
			if len(toks) < 3*bs || len(toks) >= 4*bs {
				t.Fatalf("prompt of %d tokens, want 3 full blocks of %d and a partial one", len(toks), bs)
			}
			hashesA := chainHashes(toks, bs, root)
			complete(text)
			batches := sub.until(t, isStored)
			want := kvTestEvent{Type: "BlockStored", Hashes: hashesA, Tokens: toks[:3*bs], BlockSize: uint64(bs), Medium: "GPU"}
			if got := kvEventsOf(batches, "BlockStored", "GPU"); len(got) != 1 || !kvEventEqual(got[0], want) {
				t.Fatalf("stored %+v, want %+v", got, want)
			}

			// A prompt sharing the first block: its new block's parent is
			// the shared block.
			promptB := append(slices.Clone(toks[:bs]), tokenPromptU32(90000, bs+5)...)
			hashesB := chainHashes(promptB, bs, root)
			complete(promptB)
			more := sub.until(t, isStored)
			batches = append(batches, more...)
			want = kvTestEvent{Type: "BlockStored", Hashes: hashesB[1:], Parent: &hashesA[0], Tokens: promptB[bs : 2*bs],
				BlockSize: uint64(bs), Medium: "GPU"}
			if got := kvEventsOf(more, "BlockStored", "GPU"); len(got) != 1 || !kvEventEqual(got[0], want) {
				t.Fatalf("stored %+v, want %+v", got, want)
			}

			// A prompt that needs every block evicts all cached hashes,
			// each in a BlockRemoved of its own, before storing its own.
			promptC := tokenPromptU32(60000, 8*bs-1)
			complete(promptC)
			more = sub.until(t, isStored)
			batches = append(batches, more...)
			var removed []uint64
			for _, e := range kvEventsOf(more, "BlockRemoved", "GPU") {
				if len(e.Hashes) != 1 {
					t.Errorf("BlockRemoved of %d hashes, want 1 (vLLM announces each)", len(e.Hashes))
				}
				removed = append(removed, e.Hashes...)
			}
			cached := append(slices.Clone(hashesA), hashesB[1])
			slices.Sort(removed)
			slices.Sort(cached)
			if !slices.Equal(removed, cached) {
				t.Errorf("removed %x, want every cached hash %x", removed, cached)
			}
			last := more[len(more)-1].Events
			if i := slices.IndexFunc(last, isStored); slices.ContainsFunc(last[i:], func(e kvTestEvent) bool { return e.Type == "BlockRemoved" }) {
				t.Errorf("a removal after the store in one step: %+v", last)
			}

			// vLLM's POST /reset_prefix_cache: AllBlocksCleared.
			if code, _, body := post(t, c, url+"/reset_prefix_cache", ""); code != 200 {
				t.Fatalf("reset: %d %s", code, body)
			}
			batches = append(batches, sub.until(t, func(e kvTestEvent) bool { return e.Type == "AllBlocksCleared" })...)

			topic := "kv@" + strings.TrimPrefix(url, "http://") + "@m"
			for i, b := range batches {
				if b.Seq != uint64(i) || b.Topic != topic {
					t.Errorf("batch %d: seq %d topic %q, want seq %d topic %q", i, b.Seq, b.Topic, i, topic)
				}
				if d := time.Since(time.Unix(0, int64(b.TS*1e9))); d < 0 || d > time.Minute {
					t.Errorf("batch %d: ts %v is not now", i, b.TS)
				}
			}
		})
	}
}

// tokenPromptU32 is tokenPrompt as token ids.
func tokenPromptU32(first, n int) []uint32 {
	out := make([]uint32, n)
	for i, v := range tokenPrompt(first, n) {
		out[i] = uint32(v)
	}
	return out
}

func kvEventEqual(a, b kvTestEvent) bool {
	eqPtr := func(x, y *uint64) bool { return x == nil && y == nil || x != nil && y != nil && *x == *y }
	return a.Type == b.Type && slices.Equal(a.Hashes, b.Hashes) && eqPtr(a.Parent, b.Parent) &&
		slices.Equal(a.Tokens, b.Tokens) && a.BlockSize == b.BlockSize && eqPtr(a.LoraID, b.LoraID) &&
		a.Medium == b.Medium && (a.LoraName == nil) == (b.LoraName == nil) && (a.LoraName == nil || *a.LoraName == *b.LoraName)
}

// TestKVEventsLoRA: an adapter's blocks carry vLLM's lora_id (from 1 in
// --lora-modules order) and lora_name.
func TestKVEventsLoRA(t *testing.T) {
	cfg := fastConfig()
	cfg.Model = "m"
	cfg.LoRAs = []string{"a", "b"}
	cfg.KVEventsPort = -1
	p, url := servePod(t, cfg)
	sub := subscribeKV(t, p, "")
	code, _, body := post(t, newClient(t), url+"/v1/completions", map[string]any{"model": "b", "prompt": tokenPrompt(7, 40), "max_tokens": 1})
	if code != 200 {
		t.Fatalf("%d %s", code, body)
	}
	got := kvEventsOf(sub.until(t, func(e kvTestEvent) bool { return e.Type == "BlockStored" }), "BlockStored", "GPU")
	if len(got) != 1 || got[0].LoraID == nil || *got[0].LoraID != 2 || got[0].LoraName == nil || *got[0].LoraName != "b" {
		t.Fatalf("stored %+v, want lora_id 2, lora_name b", got)
	}
	if want := chainHashes(tokenPromptU32(7, 40), 16, rootHash("\x00lora\x00b")); !slices.Equal(got[0].Hashes, want) {
		t.Errorf("hashes %x, want %x", got[0].Hashes, want)
	}
}

// TestKVEventsReplay: the replay socket answers a DEALER's request with the
// buffered batches from the requested sequence number on, then the end
// marker.
func TestKVEventsReplay(t *testing.T) {
	cfg := fastConfig()
	cfg.KVEventsPort = -1
	cfg.KVEventsReplayPort = -1
	p, url := servePod(t, cfg)
	sub := subscribeKV(t, p, "")
	c := newClient(t)
	var live [][]byte
	for i := range 3 {
		code, _, body := post(t, c, url+"/v1/completions", map[string]any{"prompt": tokenPrompt(1000*i, 40), "max_tokens": 1})
		if code != 200 {
			t.Fatalf("%d %s", code, body)
		}
		for _, b := range sub.until(t, func(e kvTestEvent) bool { return e.Type == "BlockStored" }) {
			live = append(live, b.Payload)
		}
	}

	d := zmq4.NewDealer(context.Background())
	t.Cleanup(func() {
		p.Close() // first, so the dealer's reader ends on the closed connection
		d.Close()
	})
	if err := d.Dial("tcp://" + p.KVEventsReplayAddr()); err != nil {
		t.Fatal(err)
	}
	start := make([]byte, 8)
	binary.BigEndian.PutUint64(start, 1)
	if err := d.Send(zmq4.NewMsgFrom([]byte{}, start)); err != nil {
		t.Fatal(err)
	}
	recv := func() zmq4.Msg {
		t.Helper()
		got := make(chan zmq4.Msg, 1)
		go func() {
			m, _ := d.Recv()
			got <- m
		}()
		select {
		case m := <-got:
			if len(m.Frames) != 3 || len(m.Frames[0]) != 0 || len(m.Frames[1]) != 8 {
				t.Fatalf("replay answer %q, want [empty, seq, payload]", m.Frames)
			}
			return m
		case <-time.After(kvWait):
			t.Fatal("no replay answer")
			return zmq4.Msg{}
		}
	}
	for seq := uint64(1); seq < uint64(len(live)); seq++ {
		m := recv()
		if got := binary.BigEndian.Uint64(m.Frames[1]); got != seq || !bytes.Equal(m.Frames[2], live[seq]) {
			t.Fatalf("replayed seq %d (%d bytes), want seq %d as published", got, len(m.Frames[2]), seq)
		}
	}
	if m := recv(); !bytes.Equal(m.Frames[1], kvEndSeq) || len(m.Frames[2]) != 0 {
		t.Fatalf("replay ended with %q, want [-1, empty]", m.Frames)
	}
}

// TestKVEventsDrop: a full queue drops the batch, counts it and skips its
// sequence number; the engine never waits.
func TestKVEventsDrop(t *testing.T) {
	k := &kvPublisher{queue: make(chan *kvBatch, 1), dropped: prometheus.NewCounter(prometheus.CounterOpts{Name: "d"})}
	k.publish(time.Now(), []kvEvent{{typ: kvAllBlocksCleared}})
	k.publish(time.Now(), []kvEvent{{typ: kvAllBlocksCleared}})
	k.publish(time.Now(), []kvEvent{{typ: kvAllBlocksCleared}})
	var m dto.Metric
	if err := k.dropped.Write(&m); err != nil {
		t.Fatal(err)
	}
	if got := m.GetCounter().GetValue(); got != 2 || k.seq != 3 || (<-k.queue).seq != 0 {
		t.Errorf("dropped %v, next seq %d", got, k.seq)
	}
}

func TestReplayRing(t *testing.T) {
	r := replayRing{buf: make([]replayEntry, 3)}
	seqs := func(es []replayEntry) []uint64 {
		var out []uint64
		for _, e := range es {
			out = append(out, e.seq)
		}
		return out
	}
	r.add(0, nil)
	r.add(1, nil)
	if got := seqs(r.since(0)); !slices.Equal(got, []uint64{0, 1}) {
		t.Errorf("since 0: %v", got)
	}
	for s := uint64(2); s < 5; s++ {
		r.add(s, nil)
	}
	if got := seqs(r.since(0)); !slices.Equal(got, []uint64{2, 3, 4}) {
		t.Errorf("since 0 after wrapping: %v", got)
	}
	if got := seqs(r.since(4)); !slices.Equal(got, []uint64{4}) {
		t.Errorf("since 4: %v", got)
	}
	if got := r.since(9); len(got) != 0 {
		t.Errorf("since 9: %v", got)
	}
}

func TestKVEventsConfig(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{name: "replay without publisher", cfg: Config{KVEventsReplayPort: 5558}, want: "without"},
		{name: "same ports", cfg: Config{KVEventsPort: 5557, KVEventsReplayPort: 5557}, want: "both"},
		{name: "port out of range", cfg: Config{KVEventsPort: 70000}, want: "outside"},
		{name: "negative CPU blocks", cfg: Config{CPUBlocks: -1}, want: "CPU blocks"},
		{name: "negative CPU bandwidth", cfg: Config{CPUBandwidth: -1}, want: "rates"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.cfg.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Validate: %v, want %q", err, tc.want)
			}
		})
	}
	cfgs := Profiles()[0].Configs(3, Config{KVEventsPort: 5557, KVEventsReplayPort: -1})
	for i, c := range cfgs {
		if c.KVEventsPort != 5557+i || c.KVEventsReplayPort != -1 {
			t.Errorf("pod %d: ports %d %d", i, c.KVEventsPort, c.KVEventsReplayPort)
		}
	}
}
