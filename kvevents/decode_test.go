package kvevents

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/zeebo/xxh3"
)

var updateKV = flag.Bool("update", false, "rewrite the testdata/kvevents fixtures from kvFixtures")

// kvFixtureDir holds one msgpack payload per fixture, as a publisher's
// third frame carries it.
const kvFixtureDir = "../testdata/kvevents"

// The wire values the fixtures are written from: msgpack arrays, maps
// with ordered keys, raw bytes; other values are msgpack scalars (nil,
// string, []byte as bin, int, int64, uint64, float64, float32).
type (
	wArr []any
	wMap []wKV
	wKV  struct {
		k string
		v any
	}
	wRaw []byte
)

// encodeWire encodes a wire value.
func encodeWire(tb testing.TB, v any) []byte {
	tb.Helper()
	var buf bytes.Buffer
	if err := writeWire(msgpack.NewEncoder(&buf), v); err != nil {
		tb.Fatal(err)
	}
	return buf.Bytes()
}

func writeWire(enc *msgpack.Encoder, v any) error {
	switch v := v.(type) {
	case nil:
		return enc.EncodeNil()
	case string:
		return enc.EncodeString(v)
	case []byte:
		return enc.EncodeBytes(v)
	case int:
		return enc.EncodeInt(int64(v))
	case int64:
		return enc.EncodeInt(v)
	case uint64:
		return enc.EncodeUint(v)
	case float64:
		return enc.EncodeFloat64(v)
	case float32:
		return enc.EncodeFloat32(v)
	case wRaw:
		_, err := enc.Writer().Write(v)
		return err
	case []uint32:
		if err := enc.EncodeArrayLen(len(v)); err != nil {
			return err
		}
		for _, x := range v {
			if err := enc.EncodeUint(uint64(x)); err != nil {
				return err
			}
		}
		return nil
	case wArr:
		if err := enc.EncodeArrayLen(len(v)); err != nil {
			return err
		}
		for _, x := range v {
			if err := writeWire(enc, x); err != nil {
				return err
			}
		}
		return nil
	case wMap:
		if err := enc.EncodeMapLen(len(v)); err != nil {
			return err
		}
		for _, kv := range v {
			if err := enc.EncodeString(kv.k); err != nil {
				return err
			}
			if err := writeWire(enc, kv.v); err != nil {
				return err
			}
		}
		return nil
	}
	panic("writeWire: unsupported value")
}

// toks returns n token ids from first.
func toks(first, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(first + i)
	}
	return out
}

// sha is a 32-byte block hash, as vLLM sends with sha256 prefix hashing.
func sha(b byte) []byte { return bytes.Repeat([]byte{b}, 32) }

// kvFixtures are the wire encodings the decoder reads, each with the
// batch it must decode to. The fixture files are these values encoded;
// go test ./kvevents -run KVFixtures -update rewrites them.
var kvFixtures = []struct {
	name string
	wire any
	want Batch
}{
	{
		name: "array-stored-int-hashes",
		wire: wArr{1700000000.25, wArr{
			wArr{"BlockStored", wArr{1, 2, 3}, nil, toks(100, 48), 16, nil, "GPU", nil},
		}, 0},
		want: Batch{TS: 1700000000.25, Events: []Event{
			{Kind: BlockStored, BlockHashes: []uint64{1, 2, 3}, TokenIDs: toks(100, 48), BlockSize: 16},
		}},
	},
	{
		// SGLang before HiCache and vLLM before the medium: the event
		// stops after lora_id, and the batch has no dp rank.
		name: "array-stored-old-engine",
		wire: wArr{12.5, wArr{
			wArr{"BlockStored", wArr{10, 11}, 9, toks(0, 32), 16, 7},
		}},
		want: Batch{TS: 12.5, Events: []Event{
			{Kind: BlockStored, BlockHashes: []uint64{10, 11}, Parent: 9, HasParent: true, TokenIDs: toks(0, 32), BlockSize: 16, LoRA: "7"},
		}},
	},
	{
		// The llm-d simulator's array encoding marks a root with the
		// integer 0, not nil.
		name: "array-stored-zero-parent",
		wire: wArr{1.5, wArr{
			wArr{"BlockStored", wArr{uint64(1) << 60}, uint64(0), toks(0, 16), 16, nil, "GPU", nil, nil},
		}, 0},
		want: Batch{TS: 1.5, Events: []Event{
			{Kind: BlockStored, BlockHashes: []uint64{1 << 60}, TokenIDs: toks(0, 16), BlockSize: 16},
		}},
	},
	{
		// Stops after medium (vLLM before lora_name).
		name: "array-stored-until-medium",
		wire: wArr{1.0, wArr{
			wArr{"BlockStored", wArr{5}, 4, toks(7, 16), 16, nil, "GPU"},
		}, 3},
		want: Batch{TS: 1, DPRank: 3, Events: []Event{
			{Kind: BlockStored, BlockHashes: []uint64{5}, Parent: 4, HasParent: true, TokenIDs: toks(7, 16), BlockSize: 16},
		}},
	},
	{
		// vLLM with sha256 block hashes: bin and str hashes, folded.
		name: "array-stored-bytes-hashes",
		wire: wArr{2.0, wArr{
			wArr{"BlockStored", wArr{sha(1), string(sha(2))}, sha(0), toks(1, 32), 16, nil, "GPU", "adapter-a"},
		}, 2},
		want: Batch{TS: 2, DPRank: 2, Events: []Event{
			{Kind: BlockStored, BlockHashes: []uint64{xxh3.Hash(sha(1)), xxh3.Hash(sha(2))}, Parent: xxh3.Hash(sha(0)),
				HasParent: true, TokenIDs: toks(1, 32), BlockSize: 16, LoRA: "adapter-a"},
		}},
	},
	{
		// Python's hash() is signed: negative int64 hashes keep their bit
		// pattern, and a uint64 beyond int64 is read whole.
		name: "array-signed-hashes",
		wire: wArr{3.0, wArr{
			wArr{"BlockRemoved", wArr{int64(-5), uint64(math.MaxUint64), int64(math.MinInt64)}, nil},
		}, 0},
		want: Batch{TS: 3, Events: []Event{
			{Kind: BlockRemoved, BlockHashes: []uint64{math.MaxUint64 - 4, math.MaxUint64, 1 << 63}},
		}},
	},
	{
		name: "array-removed-tiers",
		wire: wArr{4.0, wArr{
			wArr{"BlockRemoved", wArr{1, 2}, "CPU"},
			wArr{"BlockRemoved", wArr{3}, "CPU_TIER2"},
			wArr{"BlockRemoved", wArr{4}},
			wArr{"BlockRemoved", wArr{5}, "cpu_tier1", 1},
		}, 0},
		want: Batch{TS: 4, Events: []Event{
			{Kind: BlockRemoved, BlockHashes: []uint64{1, 2}, Tier: TierCPU},
			{Kind: BlockRemoved, BlockHashes: []uint64{3}, Tier: TierStorage},
			{Kind: BlockRemoved, BlockHashes: []uint64{4}},
			{Kind: BlockRemoved, BlockHashes: []uint64{5}, Tier: TierCPU, Group: 1},
		}},
	},
	{
		// An event kind from a newer engine is skipped; the others stay.
		name: "array-cleared-and-unknown-tag",
		wire: wArr{5.0, wArr{
			wArr{"AllBlocksCleared"},
			wArr{"BlockPinned", wArr{1, 2}, wMap{{"x", wArr{1}}}},
			wArr{"BlockStored", wArr{6}, nil, toks(3, 16), 16, nil, nil, nil},
		}, 1},
		want: Batch{TS: 5, DPRank: 1, Events: []Event{
			{Kind: AllCleared},
			{Kind: BlockStored, BlockHashes: []uint64{6}, TokenIDs: toks(3, 16), BlockSize: 16},
		}},
	},
	{
		// Every field of today's BlockStored, and one more.
		name: "array-stored-all-fields",
		wire: wArr{6.0, wArr{
			wArr{"BlockStored", wArr{8, 9}, 7, toks(50, 32), 16, 3, "GPU", "sql",
				wArr{wArr{"mm-hash", 12}, nil}, 1, "sliding_window", 128, "from-the-future"},
		}, 0, "a field after dp_rank"},
		want: Batch{TS: 6, Events: []Event{
			{Kind: BlockStored, BlockHashes: []uint64{8, 9}, Parent: 7, HasParent: true, TokenIDs: toks(50, 32),
				BlockSize: 16, LoRA: "sql", Group: 1},
		}},
	},
	{
		// SGLang HiCache: a block written through to host memory.
		name: "array-sglang-hicache",
		wire: wArr{float32(7.5), wArr{
			wArr{"BlockStored", wArr{21}, nil, toks(9, 64), 64, nil, "CPU_TIER1"},
		}},
		want: Batch{TS: 7.5, Events: []Event{
			{Kind: BlockStored, BlockHashes: []uint64{21}, TokenIDs: toks(9, 64), BlockSize: 64, Tier: TierCPU},
		}},
	},
	{
		name: "map-stored",
		wire: wMap{{"ts", 8.0}, {"events", wArr{
			wMap{{"type", "BlockStored"}, {"block_hashes", wArr{31, 32}}, {"parent_block_hash", nil},
				{"token_ids", toks(60, 32)}, {"block_size", 16}, {"lora_id", nil}, {"medium", "GPU"},
				{"lora_name", "sql-adapter"}, {"extra_keys", wArr{wArr{"salt"}, nil}}, {"group_idx", 0},
				{"kv_cache_spec_kind", "full_attention"}, {"kv_cache_spec_sliding_window", nil},
				{"future_key", wMap{{"a", wArr{1, 2}}}}},
		}}, {"data_parallel_rank", 1}},
		want: Batch{TS: 8, DPRank: 1, Events: []Event{
			{Kind: BlockStored, BlockHashes: []uint64{31, 32}, TokenIDs: toks(60, 32), BlockSize: 16, LoRA: "sql-adapter"},
		}},
	},
	{
		// Defaults omitted (no dp rank, no group), keys in any order (type
		// last), lora_name winning over lora_id, and kinds not known.
		name: "map-defaults-and-order",
		wire: wMap{{"events", wArr{
			wMap{{"lora_id", 3}, {"block_hashes", wArr{41}}, {"token_ids", toks(0, 16)}, {"block_size", 16},
				{"parent_block_hash", 40}, {"lora_name", "alpha"}, {"medium", nil}, {"type", "BlockStored"}},
			wMap{{"type", "BlockRemoved"}, {"block_hashes", wArr{40}}, {"medium", "cpu"}, {"group_idx", 1}},
			wMap{{"type", "SomethingNew"}, {"block_hashes", wArr{1}}},
			wMap{{"block_hashes", wArr{2}}},
			wMap{{"type", "AllBlocksCleared"}},
		}}, {"ts", 9}, {"added_later", wArr{}}},
		want: Batch{TS: 9, Events: []Event{
			{Kind: BlockStored, BlockHashes: []uint64{41}, Parent: 40, HasParent: true, TokenIDs: toks(0, 16), BlockSize: 16, LoRA: "alpha"},
			{Kind: BlockRemoved, BlockHashes: []uint64{40}, Tier: TierCPU, Group: 1},
			{Kind: AllCleared},
		}},
	},
	{
		name: "map-lora-id-bytes-hashes",
		wire: wMap{{"ts", 10.0}, {"events", wArr{
			wMap{{"type", "BlockStored"}, {"block_hashes", wArr{sha(3)}}, {"parent_block_hash", sha(4)},
				{"token_ids", toks(5, 16)}, {"block_size", 16}, {"lora_id", 42}, {"medium", "DISK"}, {"lora_name", nil}},
		}}, {"data_parallel_rank", nil}},
		want: Batch{TS: 10, Events: []Event{
			{Kind: BlockStored, BlockHashes: []uint64{xxh3.Hash(sha(3))}, Parent: xxh3.Hash(sha(4)), HasParent: true,
				TokenIDs: toks(5, 16), BlockSize: 16, LoRA: "42", Tier: TierStorage},
		}},
	},
	{
		name: "empty-batch",
		wire: wArr{11.0, wArr{}, 0},
		want: Batch{TS: 11},
	},
}

func fixturePath(name string) string { return filepath.Join(kvFixtureDir, name+".msgpack") }

// TestKVFixtures decodes every fixture file, after checking that it is
// its wire value's encoding (-update rewrites the files).
func TestKVFixtures(t *testing.T) {
	if *updateKV {
		if err := os.MkdirAll(kvFixtureDir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, fx := range kvFixtures {
		t.Run(fx.name, func(t *testing.T) {
			enc := encodeWire(t, fx.wire)
			if *updateKV {
				if err := os.WriteFile(fixturePath(fx.name), enc, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			payload, err := os.ReadFile(fixturePath(fx.name))
			if err != nil {
				t.Fatalf("%v (run with -update to write the fixtures)", err)
			}
			if !bytes.Equal(payload, enc) {
				t.Fatalf("%s is not the encoding of its wire value (run with -update)", fixturePath(fx.name))
			}
			var got Batch
			if err := DecodeBatch(payload, &got); err != nil {
				t.Fatal(err)
			}
			if msg := diffBatch(&got, &fx.want); msg != "" {
				t.Fatal(msg)
			}
		})
	}
}

// TestKVCaptured decodes batches the llm-d inference simulator published
// (captured from its replay socket; hashes are its FNV-64a, tokens its
// dummy tokenizer's FNV-1a-32): the array encoding, whose root parent is
// the integer 0, and --use-vllm-map-event-format, an array batch of map
// events.
func TestKVCaptured(t *testing.T) {
	type ev struct {
		kind      EventKind
		hashes    []uint64
		hasParent bool
		tokens    int
		first     uint32 // the first token
		lora      string
	}
	tests := []struct {
		file   string
		ts     float64
		events []ev
	}{
		{file: "llmd-sim-array", ts: 1.7961862422799559e+09, events: []ev{
			{kind: BlockStored, hashes: []uint64{0x10d78cefab190fa}, tokens: 16, first: 0xaf229474},
			{kind: BlockStored, hashes: []uint64{0x118bc90b2311f676}, tokens: 16, first: 0x206a677, lora: "sql-lora"},
		}},
		{file: "llmd-sim-map", ts: 1.7961862514518611e+09, events: []ev{
			{kind: BlockStored, hashes: []uint64{0xb69519802c01620, 0x4661bf506b509c2f, 0x6ea1f6ec3bf0c6}, tokens: 48, first: 0xaf229474, lora: "sql-lora"},
			{kind: BlockRemoved, hashes: []uint64{0xb69519802c01620}},
			{kind: BlockStored, hashes: []uint64{0x7b68ff77f8315946, 0x825d24a534226a05}, tokens: 32, first: 0xb249de4, lora: "sql-lora"},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			payload, err := os.ReadFile(fixturePath(tt.file))
			if err != nil {
				t.Fatal(err)
			}
			var b Batch
			if err := DecodeBatch(payload, &b); err != nil {
				t.Fatal(err)
			}
			if b.TS != tt.ts || b.DPRank != 0 || len(b.Events) != len(tt.events) {
				t.Fatalf("batch %+v", b)
			}
			for i, w := range tt.events {
				g := b.Events[i]
				bs := 0
				if w.kind == BlockStored {
					bs = 16
				}
				if g.Kind != w.kind || !equalSlices(g.BlockHashes, w.hashes) || g.HasParent != w.hasParent ||
					len(g.TokenIDs) != w.tokens || w.tokens > 0 && g.TokenIDs[0] != w.first || g.LoRA != w.lora ||
					g.BlockSize != bs || g.Tier != TierGPU {
					t.Errorf("event %d: %+v, want %+v", i, g, w)
				}
			}
		})
	}
}

// TestKVDecodeReuse decodes every fixture into one batch in turn: the
// slots' old contents never leak into the next batch.
func TestKVDecodeReuse(t *testing.T) {
	var b Batch
	for round := range 2 {
		for _, fx := range kvFixtures {
			if err := DecodeBatch(encodeWire(t, fx.wire), &b); err != nil {
				t.Fatal(err)
			}
			if msg := diffBatch(&b, &fx.want); msg != "" {
				t.Fatalf("round %d, %s: %s", round, fx.name, msg)
			}
		}
	}
}

// TestKVDecodeAllocs: a steady stream of batches decodes without
// allocating, LoRA names included.
func TestKVDecodeAllocs(t *testing.T) {
	for _, name := range []string{"array-stored-all-fields", "map-stored", "map-defaults-and-order"} {
		t.Run(name, func(t *testing.T) {
			payload, err := os.ReadFile(fixturePath(name))
			if err != nil {
				t.Fatal(err)
			}
			d := newKVDecoder()
			var b Batch
			if err := d.decode(payload, &b); err != nil {
				t.Fatal(err)
			}
			if n := testing.AllocsPerRun(100, func() { _ = d.decode(payload, &b) }); n != 0 {
				t.Errorf("%v allocations per batch, want 0", n)
			}
		})
	}
}

func TestKVDecodeErrors(t *testing.T) {
	valid := encodeWire(t, kvFixtures[0].wire)
	stored := func(fields ...any) any {
		return wArr{1.0, wArr{append(wArr{"BlockStored"}, fields...)}, 0}
	}
	tests := []struct {
		name    string
		payload []byte
	}{
		{name: "empty", payload: nil},
		{name: "truncated", payload: valid[:len(valid)-1]},
		{name: "truncated header", payload: valid[:1]},
		{name: "trailing bytes", payload: append(append([]byte(nil), valid...), 0xc0)},
		{name: "batch is a number", payload: encodeWire(t, 5)},
		{name: "batch array too short", payload: encodeWire(t, wArr{1.0})},
		{name: "batch is nil", payload: encodeWire(t, nil)},
		{name: "ts is a string", payload: encodeWire(t, wArr{"now", wArr{}})},
		{name: "events is a string", payload: encodeWire(t, wArr{1.0, "events"})},
		{name: "events is nil", payload: encodeWire(t, wArr{1.0, nil})},
		{name: "event is a number", payload: encodeWire(t, wArr{1.0, wArr{7}})},
		{name: "event without tag", payload: encodeWire(t, wArr{1.0, wArr{wArr{}}})},
		{name: "tag is a number", payload: encodeWire(t, wArr{1.0, wArr{wArr{3, wArr{1}}}})},
		{name: "tag is nil", payload: encodeWire(t, wArr{1.0, wArr{wArr{nil}}})},
		{name: "hash is a float", payload: encodeWire(t, stored(wArr{1.5}, nil, wArr{}, 16))},
		{name: "hash is nil", payload: encodeWire(t, stored(wArr{nil}, nil, wArr{}, 16))},
		{name: "hashes is a map", payload: encodeWire(t, stored(wMap{}, nil, wArr{}, 16))},
		{name: "parent is an array", payload: encodeWire(t, stored(wArr{1}, wArr{}, wArr{}, 16))},
		{name: "negative token", payload: encodeWire(t, stored(wArr{1}, nil, wArr{-1}, 16))},
		{name: "token beyond 32 bits", payload: encodeWire(t, stored(wArr{1}, nil, wArr{int64(1) << 32}, 16))},
		{name: "token is a string", payload: encodeWire(t, stored(wArr{1}, nil, wArr{"a"}, 16))},
		{name: "negative block size", payload: encodeWire(t, stored(wArr{1}, nil, wArr{}, -16))},
		{name: "block size is a string", payload: encodeWire(t, stored(wArr{1}, nil, wArr{}, "16"))},
		{name: "lora id is a string", payload: encodeWire(t, stored(wArr{1}, nil, wArr{}, 16, "7"))},
		{name: "medium is a number", payload: encodeWire(t, stored(wArr{1}, nil, wArr{}, 16, nil, 1))},
		{name: "lora name is a number", payload: encodeWire(t, stored(wArr{1}, nil, wArr{}, 16, nil, nil, 2))},
		{name: "negative group", payload: encodeWire(t, stored(wArr{1}, nil, wArr{}, 16, nil, nil, nil, nil, -1))},
		{name: "negative dp rank", payload: encodeWire(t, wArr{1.0, wArr{}, -1})},
		{name: "huge dp rank", payload: encodeWire(t, wArr{1.0, wArr{}, 1 << 20})},
		{name: "map key is a number", payload: encodeWire(t, wArr{1.0, wArr{wRaw{0x81, 0x01, 0x02}}})},
		{name: "map type is a number", payload: encodeWire(t, wArr{1.0, wArr{wMap{{"type", 1}}}})},
		{name: "map batch key is nil", payload: []byte{0x81, 0xc0, 0xc0}},
		{name: "array longer than the payload", payload: []byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff}},
		{name: "map longer than the payload", payload: []byte{0xdf, 0x7f, 0xff, 0xff, 0xff, 0xa2, 't', 's'}},
		{name: "string longer than the payload", payload: encodeWire(t, wArr{1.0, wArr{wArr{wRaw{0xdb, 0x7f, 0xff, 0xff, 0xff}}}})},
		{name: "bin hash longer than the payload", payload: encodeWire(t, stored(wArr{wRaw{0xc6, 0xff, 0xff, 0xff, 0xff}}))},
		{name: "skipped extension longer than the payload", payload: encodeWire(t, wArr{1.0, wArr{}, 0, wRaw{0xc9, 0x7f, 0xff, 0xff, 0xff, 1}})},
		{name: "skipped value has a reserved code", payload: encodeWire(t, wArr{1.0, wArr{}, 0, wRaw{0xc1}})},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := Batch{TS: 99, DPRank: 5, Events: []Event{{Kind: AllCleared}}}
			err := DecodeBatch(tt.payload, &b)
			if !errors.Is(err, ErrBadBatch) {
				t.Fatalf("err = %v, want ErrBadBatch", err)
			}
			if b.TS != 0 || b.DPRank != 0 || len(b.Events) != 0 {
				t.Errorf("batch after an error = %+v, want empty", b)
			}
		})
	}
}

// TestKVDecodeDeepSkip: a skipped field nested a million levels deep
// decodes without growing the stack.
func TestKVDecodeDeepSkip(t *testing.T) {
	const depth = 1 << 20
	deep := append(bytes.Repeat([]byte{0x91}, depth), 0xc0) // [[[...[nil]...]]]
	payload := encodeWire(t, wArr{1.0, wArr{wArr{"BlockStored", wArr{1}, nil, wArr{}, 16, nil, nil, nil, wRaw(deep)}}, 0})
	var b Batch
	if err := DecodeBatch(payload, &b); err != nil {
		t.Fatal(err)
	}
	if len(b.Events) != 1 || b.Events[0].BlockHashes[0] != 1 {
		t.Fatalf("got %+v", b)
	}
}

func TestKVTier(t *testing.T) {
	tests := []struct {
		medium string
		want   Tier
	}{
		{"", TierGPU}, {"GPU", TierGPU}, {"gpu", TierGPU}, {"Device", TierGPU}, {"L1", TierGPU},
		{"CPU", TierCPU}, {"cpu", TierCPU}, {"CPU_TIER1", TierCPU}, {"CPU_PINNED", TierCPU}, {"host", TierCPU},
		{"L2", TierCPU}, {"cpu_tier", TierCPU},
		{"CPU_TIER2", TierStorage}, {"DISK", TierStorage}, {"disk", TierStorage}, {"LMCACHE", TierStorage},
		{"L3", TierStorage}, {"file", TierStorage}, {"STORAGE", TierStorage}, {"nvme", TierStorage},
		{"quantum-foam", TierCPU}, {strings.Repeat("gpu", 10), TierCPU},
	}
	for _, tt := range tests {
		t.Run(tt.medium, func(t *testing.T) {
			if got := tierOf([]byte(tt.medium)); got != tt.want {
				t.Errorf("tierOf(%q) = %v, want %v", tt.medium, got, tt.want)
			}
		})
	}
}

// diffBatch describes how got differs from want ("" when equal); the
// timestamps compare by bits (NaN included), empty and nil slices alike.
func diffBatch(got, want *Batch) string {
	switch {
	case math.Float64bits(got.TS) != math.Float64bits(want.TS):
		return "ts " + fmtAny(got.TS) + ", want " + fmtAny(want.TS)
	case got.DPRank != want.DPRank:
		return "dp rank " + fmtAny(got.DPRank) + ", want " + fmtAny(want.DPRank)
	case len(got.Events) != len(want.Events):
		return "events " + fmtAny(got.Events) + ", want " + fmtAny(want.Events)
	}
	for i := range got.Events {
		g, w := got.Events[i], want.Events[i]
		if g.Kind != w.Kind || g.Parent != w.Parent || g.HasParent != w.HasParent || g.BlockSize != w.BlockSize ||
			g.LoRA != w.LoRA || g.Tier != w.Tier || g.Group != w.Group ||
			!equalSlices(g.BlockHashes, w.BlockHashes) || !equalSlices(g.TokenIDs, w.TokenIDs) {
			return "event " + fmtAny(i) + ": " + fmtAny(g) + ", want " + fmtAny(w)
		}
	}
	return ""
}

func equalSlices[T comparable](a, b []T) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func fmtAny(v any) string { return fmt.Sprintf("%+v", v) }
