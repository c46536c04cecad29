package kvevents

import (
	"bufio"
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// FuzzDecodeBatch: decoding never panics, and a decoded batch, encoded
// again in the array form, decodes to itself.
func FuzzDecodeBatch(f *testing.F) {
	files, _ := filepath.Glob(filepath.Join(kvFixtureDir, "*.msgpack"))
	for _, name := range files {
		if payload, err := os.ReadFile(name); err == nil {
			f.Add(payload)
		}
	}
	f.Add([]byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, payload []byte) {
		var b Batch
		if err := DecodeBatch(payload, &b); err != nil {
			if !errors.Is(err, ErrBadBatch) {
				t.Fatalf("error %v does not wrap ErrBadBatch", err)
			}
			return
		}
		again := encodeBatch(t, &b)
		var b2 Batch
		if err := DecodeBatch(again, &b2); err != nil {
			t.Fatalf("re-encoded batch: %v", err)
		}
		if msg := diffBatch(&b2, &b); msg != "" {
			t.Fatalf("re-encoded batch: %s", msg)
		}
	})
}

// encodeBatch encodes b in vLLM's array form.
func encodeBatch(tb testing.TB, b *Batch) []byte {
	tb.Helper()
	medium := [...]string{TierGPU: "GPU", TierCPU: "CPU", TierStorage: "DISK"}
	events := make(wArr, 0, len(b.Events))
	for _, ev := range b.Events {
		hashes := make(wArr, len(ev.BlockHashes))
		for i, h := range ev.BlockHashes {
			hashes[i] = h
		}
		switch ev.Kind {
		case BlockStored:
			var parent, lora any
			if ev.HasParent {
				parent = ev.Parent
			}
			if ev.LoRA != "" {
				lora = ev.LoRA
			}
			events = append(events, wArr{"BlockStored", hashes, parent, ev.TokenIDs, ev.BlockSize, nil,
				medium[ev.Tier], lora, nil, ev.Group})
		case BlockRemoved:
			events = append(events, wArr{"BlockRemoved", hashes, medium[ev.Tier], ev.Group})
		case AllCleared:
			events = append(events, wArr{"AllBlocksCleared"})
		default:
			tb.Fatalf("event of kind %d", ev.Kind)
		}
	}
	return encodeWire(tb, wArr{b.TS, events, b.DPRank})
}

// FuzzZMTP: a peer's handshake and messages, whatever the bytes, are
// read without panicking and within bounds.
func FuzzZMTP(f *testing.F) {
	g := zmtpGreeting(3, "NULL")
	f.Add(append(append(append([]byte(nil), g...), zmtpCommandFrame(zmtpReadyBody("Socket-Type", "PUB"))...), 1, 1, 't', 1, 8, 0, 0, 0, 0, 0, 0, 0, 1, 0, 2, 0x91, 0xc0))
	f.Add(append(append([]byte(nil), g...), zmtpCommandFrame(zmtpReadyBody("Socket-Type"))...))
	f.Fuzz(func(t *testing.T, wire []byte) {
		z := &ZMTPConn{r: bufio.NewReader(bytes.NewReader(wire))}
		if _, err := z.readHandshake(); err != nil {
			return
		}
		for range 100 {
			frames, n, err := z.ReadMsg()
			if err != nil {
				return
			}
			if len(frames) > kvMaxFrames || len(frames) > n {
				t.Fatalf("%d frames of %d", len(frames), n)
			}
		}
	})
}
