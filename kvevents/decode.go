package kvevents

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"sync"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
	"github.com/zeebo/xxh3"
)

// ErrBadBatch is wrapped by every error decoding an engine's KV-cache event
// batch.
var ErrBadBatch = errors.New("kvevents: bad KV event batch")

// Tier is the cache medium a KV block lives in, from an event's medium,
// matched ignoring case. vLLM sends "GPU" (or nil) for its own cache and
// "CPU" from its offloading connector; SGLang's HiCache sends "GPU",
// "CPU_TIER1" (host memory, its L2) and "CPU_TIER2" (its L3 storage
// backends); Dynamo's KV manager "CPU_PINNED" and "DISK". The other names
// are spellings of the same tiers seen elsewhere (LMCache, the llm-d
// simulator, Dynamo's StorageTier):
//
//	TierGPU:     nil, "", gpu, device, hbm, cuda, l1
//	TierCPU:     cpu, cpu_tier, cpu_tier1, cpu_pinned, pinned, host, dram, l2
//	TierStorage: cpu_tier2, disk, nvme, ssd, file, storage, lmcache, l3,
//	             external, remote, network, shared
//
// An unknown medium is taken for TierCPU: a block the engine still holds
// somewhere other than the GPU, cheaper than a recomputation yet not free.
type Tier uint8

// Tiers, fastest first. An event without a medium is on the GPU.
const (
	TierGPU Tier = iota
	TierCPU
	TierStorage
)

// String returns the tier's metric label.
func (t Tier) String() string {
	switch t {
	case TierCPU:
		return "cpu"
	case TierStorage:
		return "storage"
	default:
		return "gpu"
	}
}

// MarshalText makes Tier a JSON string.
func (t Tier) MarshalText() ([]byte, error) { return []byte(t.String()), nil }

// tierOf maps an event's medium to its tier (see Tier).
func tierOf(medium []byte) Tier {
	var low [16]byte
	if len(medium) > len(low) {
		return TierCPU
	}
	for i, c := range medium {
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		low[i] = c
	}
	switch string(low[:len(medium)]) {
	case "", "gpu", "device", "hbm", "cuda", "l1":
		return TierGPU
	case "cpu_tier2", "disk", "nvme", "ssd", "file", "storage", "lmcache", "l3",
		"external", "remote", "network", "shared":
		return TierStorage
	default: // cpu, cpu_tier, cpu_tier1, cpu_pinned, pinned, host, dram, l2, unknown
		return TierCPU
	}
}

// EventKind is what a KV-cache event reports.
type EventKind uint8

// Kinds of KV-cache events (vLLM's BlockStored, BlockRemoved and
// AllBlocksCleared).
const (
	BlockStored EventKind = iota + 1
	BlockRemoved
	AllCleared
)

// String returns the kind's metric label: stored, removed or cleared.
func (k EventKind) String() string {
	switch k {
	case BlockStored:
		return "stored"
	case BlockRemoved:
		return "removed"
	case AllCleared:
		return "cleared"
	default:
		return "unknown"
	}
}

// Event is one decoded KV-cache event. Block hashes are the engine's own,
// opaque: integers as sent (their 64-bit pattern, signed or not),
// byte-string hashes (e.g. vLLM's sha256 block hashes) folded to 64 bits
// with xxh3.
type Event struct {
	Kind EventKind
	// BlockHashes are the stored or removed blocks, in chain order for a
	// store.
	BlockHashes []uint64
	// Parent is the engine hash of the block the first stored block
	// follows; HasParent is false for a chain's root: nil on the wire, or
	// the integer 0, the llm-d simulator's root in its array encoding (a
	// real 64-bit hash is 0 once in 2^64).
	Parent    uint64
	HasParent bool
	// TokenIDs are the stored blocks' tokens, BlockSize per block.
	TokenIDs  []uint32
	BlockSize int
	// LoRA is the adapter the blocks were computed for (lora_name, or the
	// decimal lora_id of older engines); "" for the base model.
	LoRA string
	// Tier is the medium the blocks were stored in or removed from.
	Tier Tier
	// Group is vLLM's group_idx: the KV-cache group of a hybrid model (one
	// per attention type, e.g. full and sliding-window), whose blocks are
	// stored and evicted apart; 0 when absent.
	Group int
}

// Batch is one published batch of events.
type Batch struct {
	// TS is the engine's timestamp, seconds since the epoch.
	TS     float64
	Events []Event
	// DPRank is the data-parallel rank that published the batch (0 when
	// absent).
	DPRank int
}

// Bounds of a decoded batch. The block size and group index are engine
// settings (16 to 256 tokens per block, a few groups); the bounds only
// reject garbage. maxDPRank keeps a rank usable as a port offset, as vLLM
// uses it (endpoint port + rank).
const (
	maxBlockSize = 1 << 20
	maxGroup     = 1 << 16
	maxDPRank    = 1 << 12
)

// DecodeBatch decodes one batch of KV-cache events, the msgpack payload
// (third frame) of a vLLM, SGLang or llm-d simulator publisher, into dst.
// Both of vLLM's encodings are read: positional arrays (vLLM before
// mid-2026, SGLang, the llm-d simulator) and maps with named fields (vLLM
// since mid-2026), whichever each value uses. dst's slices are reused, so
// decoding into the same batch does not allocate once it has grown to the
// batches' size (a LoRA name allocates when it differs from the name at
// the same position before).
//
// Events of an unknown kind, map keys and trailing array fields kvroute
// does not read are skipped, so newer engines decode. A payload that is not
// one well-formed batch (wrong types, truncated, lengths beyond the
// payload, trailing bytes) returns an error wrapping ErrBadBatch, and dst
// is then left empty. It never panics and allocates no more than a small
// multiple of len(payload). Safe for concurrent use with distinct dst.
func DecodeBatch(payload []byte, dst *Batch) error {
	d := kvDecoderPool.Get().(*kvDecoder)
	err := d.decode(payload, dst)
	kvDecoderPool.Put(d)
	return err
}

var kvDecoderPool = sync.Pool{New: func() any { return newKVDecoder() }}

// kvDecoder decodes batches; one per goroutine (the subscriber keeps one
// per connection, DecodeBatch takes one from a pool).
type kvDecoder struct {
	rd  bytes.Reader
	dec *msgpack.Decoder
	// payload is the batch being decoded (nil between calls): strings and
	// byte-string hashes are read in place, without a copy.
	payload []byte
	// lastLoRA is the latest LoRA name made, reused while names repeat;
	// num formats lora_id values.
	lastLoRA string
	num      [24]byte
}

func newKVDecoder() *kvDecoder {
	d := &kvDecoder{}
	// bytes.Reader is an io.ByteScanner: the Decoder reads it directly,
	// without a buffer of its own, so rd.Len() is the decoder's position.
	d.dec = msgpack.NewDecoder(&d.rd)
	return d
}

// decode is DecodeBatch.
func (d *kvDecoder) decode(payload []byte, dst *Batch) error {
	d.payload = payload
	d.rd.Reset(payload)
	d.dec.ResetReader(&d.rd)
	dst.TS, dst.DPRank, dst.Events = 0, 0, dst.Events[:0]
	err := d.batch(dst)
	if err == nil && d.rd.Len() != 0 {
		err = errors.New("trailing bytes after the batch")
	}
	d.payload = nil
	if err != nil {
		at := len(payload) - d.rd.Len()
		dst.TS, dst.DPRank, dst.Events = 0, 0, dst.Events[:0]
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return fmt.Errorf("%w: at byte %d of %d: %v", ErrBadBatch, at, len(payload), err)
	}
	return nil
}

// batch reads [ts, events, dp_rank?, ...] or {"ts", "events",
// "data_parallel_rank", ...}.
func (d *kvDecoder) batch(dst *Batch) error {
	c, err := d.dec.PeekCode()
	if err != nil {
		return err
	}
	switch {
	case isArray(c):
		n, err := d.arrayLen()
		if err != nil {
			return err
		}
		if n < 2 {
			return fmt.Errorf("batch array of %d elements, want [ts, events, dp_rank]", n)
		}
		if dst.TS, err = d.float(); err != nil {
			return err
		}
		if err := d.events(dst); err != nil {
			return err
		}
		if n > 2 {
			if dst.DPRank, err = d.optInt(0, maxDPRank, "data_parallel_rank"); err != nil {
				return err
			}
		}
		return d.skipN(n - 3)
	case isMap(c):
		n, err := d.mapLen()
		if err != nil {
			return err
		}
		for range n {
			key, err := d.key()
			if err != nil {
				return err
			}
			switch string(key) {
			case "ts":
				dst.TS, err = d.float()
			case "events":
				err = d.events(dst)
			case "data_parallel_rank":
				dst.DPRank, err = d.optInt(0, maxDPRank, "data_parallel_rank")
			default:
				err = d.skip()
			}
			if err != nil {
				return err
			}
		}
		return nil
	default:
		return fmt.Errorf("batch is msgpack code %#x, want an array or a map", c)
	}
}

// events reads the events array, appending the events of known kinds to
// dst.Events.
func (d *kvDecoder) events(dst *Batch) error {
	n, err := d.arrayLen()
	if err != nil {
		return err
	}
	for range n {
		// Take the next slot, keeping the slices of the event it held.
		i := len(dst.Events)
		if i < cap(dst.Events) {
			dst.Events = dst.Events[:i+1]
		} else {
			dst.Events = append(dst.Events, Event{})
		}
		ev := &dst.Events[i]
		old := ev.LoRA
		*ev = Event{BlockHashes: ev.BlockHashes[:0], TokenIDs: ev.TokenIDs[:0]}
		known, err := d.event(ev, old)
		if err != nil {
			return err
		}
		if !known {
			dst.Events = dst.Events[:i]
		}
	}
	return nil
}

// kvField is an event field kvroute reads; fieldSkip the others.
type kvField uint8

const (
	fieldSkip kvField = iota
	fieldHashes
	fieldParent
	fieldTokens
	fieldBlockSize
	fieldLoRAID
	fieldMedium
	fieldLoRAName
	fieldGroup
)

// The positional fields of each kind after its tag (vLLM's BlockStored and
// BlockRemoved in declaration order; extra_keys, kv_cache_spec_kind and the
// like are skipped).
var (
	storedFields  = [...]kvField{fieldHashes, fieldParent, fieldTokens, fieldBlockSize, fieldLoRAID, fieldMedium, fieldLoRAName, fieldSkip /* extra_keys */, fieldGroup}
	removedFields = [...]kvField{fieldHashes, fieldMedium, fieldGroup}
)

// fieldByName maps a map-encoded event's key to its field.
func fieldByName(key []byte) kvField {
	switch string(key) {
	case "block_hashes":
		return fieldHashes
	case "parent_block_hash":
		return fieldParent
	case "token_ids":
		return fieldTokens
	case "block_size":
		return fieldBlockSize
	case "lora_id":
		return fieldLoRAID
	case "medium":
		return fieldMedium
	case "lora_name":
		return fieldLoRAName
	case "group_idx":
		return fieldGroup
	}
	return fieldSkip
}

// kindByTag maps an event's tag to its kind; 0 for a kind kvroute does
// not know.
func kindByTag(tag []byte) EventKind {
	switch string(tag) {
	case "BlockStored":
		return BlockStored
	case "BlockRemoved":
		return BlockRemoved
	case "AllBlocksCleared":
		return AllCleared
	}
	return 0
}

// eventState is what decoding one event remembers besides the event.
type eventState struct {
	oldLoRA  string // the LoRA name the slot held before, for reuse
	haveName bool   // lora_name was given (it wins over lora_id)
}

// event reads one event into ev; known is false for a kind kvroute does
// not know (ev is then to be dropped). old is the LoRA name the slot held
// before.
func (d *kvDecoder) event(ev *Event, old string) (known bool, err error) {
	st := eventState{oldLoRA: old}
	c, err := d.dec.PeekCode()
	if err != nil {
		return false, err
	}
	switch {
	case isArray(c):
		n, err := d.arrayLen()
		if err != nil {
			return false, err
		}
		if n < 1 {
			return false, errors.New("event array without a tag")
		}
		tag, err := d.str("event tag")
		if err != nil {
			return false, err
		}
		ev.Kind = kindByTag(tag)
		var fields []kvField
		switch ev.Kind {
		case BlockStored:
			fields = storedFields[:]
		case BlockRemoved:
			fields = removedFields[:]
		}
		for i := 1; i < n; i++ {
			f := fieldSkip
			if i-1 < len(fields) {
				f = fields[i-1]
			}
			if err := d.field(ev, f, &st); err != nil {
				return false, err
			}
		}
	case isMap(c):
		n, err := d.mapLen()
		if err != nil {
			return false, err
		}
		for range n {
			key, err := d.key()
			if err != nil {
				return false, err
			}
			if string(key) == "type" {
				tag, err := d.str("event type")
				if err != nil {
					return false, err
				}
				ev.Kind = kindByTag(tag)
				continue
			}
			if err := d.field(ev, fieldByName(key), &st); err != nil {
				return false, err
			}
		}
	default:
		return false, fmt.Errorf("event is msgpack code %#x, want an array or a map", c)
	}
	return ev.Kind != 0, nil
}

// field reads one event field into ev.
func (d *kvDecoder) field(ev *Event, f kvField, st *eventState) error {
	var err error
	switch f {
	case fieldHashes:
		ev.BlockHashes, err = d.hashes(ev.BlockHashes)
	case fieldParent:
		var isNil bool
		if isNil, err = d.nextNil(); err == nil && !isNil {
			ev.Parent, err = d.hash()
			ev.HasParent = err == nil && ev.Parent != 0
		}
	case fieldTokens:
		ev.TokenIDs, err = d.tokens(ev.TokenIDs)
	case fieldBlockSize:
		ev.BlockSize, err = d.optInt(0, maxBlockSize, "block_size")
	case fieldLoRAID:
		var isNil bool
		if isNil, err = d.nextNil(); err == nil && !isNil {
			var id int64
			if id, err = d.int(); err == nil && !st.haveName {
				ev.LoRA = d.loraString(strconv.AppendInt(d.num[:0], id, 10), st.oldLoRA)
			}
		}
	case fieldLoRAName:
		var name []byte
		var isNil bool
		if name, isNil, err = d.optStr("lora_name"); err == nil && !isNil && len(name) > 0 {
			ev.LoRA = d.loraString(name, st.oldLoRA)
			st.haveName = true
		}
	case fieldMedium:
		var medium []byte
		if medium, _, err = d.optStr("medium"); err == nil {
			ev.Tier = tierOf(medium)
		}
	case fieldGroup:
		ev.Group, err = d.optInt(0, maxGroup, "group_idx")
	default:
		err = d.skip()
	}
	return err
}

// loraString returns b as a string, reusing old or the last name made when
// equal, so that steady traffic on a few adapters does not allocate.
func (d *kvDecoder) loraString(b []byte, old string) string {
	switch string(b) {
	case old:
		return old
	case d.lastLoRA:
		return d.lastLoRA
	}
	d.lastLoRA = string(b)
	return d.lastLoRA
}

// hashes appends an array of block hashes to dst.
func (d *kvDecoder) hashes(dst []uint64) ([]uint64, error) {
	n, err := d.arrayLen()
	if err != nil {
		return dst, err
	}
	for range n {
		h, err := d.hash()
		if err != nil {
			return dst, err
		}
		dst = append(dst, h)
	}
	return dst, nil
}

// hash reads one ExternalBlockHash: an integer (its 64-bit pattern) or a
// byte string (bin or str), folded with xxh3.
func (d *kvDecoder) hash() (uint64, error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return 0, err
	}
	switch {
	case isInt(c):
		return d.dec.DecodeUint64()
	case msgpcode.IsString(c) || msgpcode.IsBin(c):
		b, err := d.bytes()
		return xxh3.Hash(b), err
	default:
		return 0, fmt.Errorf("block hash is msgpack code %#x, want an integer or bytes", c)
	}
}

// tokens appends an array of token ids to dst.
func (d *kvDecoder) tokens(dst []uint32) ([]uint32, error) {
	n, err := d.arrayLen()
	if err != nil {
		return dst, err
	}
	for range n {
		v, err := d.int()
		if err != nil {
			return dst, err
		}
		if v < 0 || v > math.MaxUint32 {
			return dst, fmt.Errorf("token id %d out of range", v)
		}
		dst = append(dst, uint32(v))
	}
	return dst, nil
}

// float reads a number or nil (0).
func (d *kvDecoder) float() (float64, error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return 0, err
	}
	if c != msgpcode.Nil && c != msgpcode.Float && c != msgpcode.Double && !isInt(c) {
		return 0, fmt.Errorf("timestamp is msgpack code %#x, want a number", c)
	}
	return d.dec.DecodeFloat64() // nil decodes as 0
}

// int reads an integer (not nil).
func (d *kvDecoder) int() (int64, error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return 0, err
	}
	if !isInt(c) {
		return 0, fmt.Errorf("msgpack code %#x, want an integer", c)
	}
	return d.dec.DecodeInt64()
}

// optInt reads an integer in [lo, hi), or nil (lo).
func (d *kvDecoder) optInt(lo, hi int64, what string) (int, error) {
	if isNil, err := d.nextNil(); err != nil || isNil {
		return int(lo), err
	}
	v, err := d.int()
	if err != nil {
		return 0, fmt.Errorf("%s: %w", what, err)
	}
	if v < lo || v >= hi {
		return 0, fmt.Errorf("%s %d out of range", what, v)
	}
	return int(v), nil
}

// nextNil consumes a nil and reports true if the next value is nil.
func (d *kvDecoder) nextNil() (bool, error) {
	c, err := d.dec.PeekCode()
	if err != nil || c != msgpcode.Nil {
		return false, err
	}
	return true, d.dec.DecodeNil()
}

// key reads a map key (a string).
func (d *kvDecoder) key() ([]byte, error) { return d.str("map key") }

// str reads a string (or bin), not nil, in place.
func (d *kvDecoder) str(what string) ([]byte, error) {
	b, isNil, err := d.optStr(what)
	if err == nil && isNil {
		err = fmt.Errorf("%s is nil, want a string", what)
	}
	return b, err
}

// optStr reads a string, bin or nil, in place.
func (d *kvDecoder) optStr(what string) (b []byte, isNil bool, err error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return nil, false, err
	}
	switch {
	case c == msgpcode.Nil:
		return nil, true, d.dec.DecodeNil()
	case msgpcode.IsString(c) || msgpcode.IsBin(c):
		b, err = d.bytes()
		return b, false, err
	default:
		return nil, false, fmt.Errorf("%s is msgpack code %#x, want a string", what, c)
	}
}

// bytes reads a string or bin and returns it in place (a view of the
// payload, valid during decode).
func (d *kvDecoder) bytes() ([]byte, error) {
	n, err := d.dec.DecodeBytesLen()
	if err != nil {
		return nil, err
	}
	if n < 0 || n > d.rd.Len() {
		return nil, fmt.Errorf("string of %d bytes with %d left", n, d.rd.Len())
	}
	at := len(d.payload) - d.rd.Len()
	if _, err := d.rd.Seek(int64(n), io.SeekCurrent); err != nil {
		return nil, err
	}
	return d.payload[at : at+n : at+n], nil
}

// arrayLen reads an array header (not nil) whose length the rest of the
// payload can hold (every element takes a byte at least).
func (d *kvDecoder) arrayLen() (int, error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return 0, err
	}
	if !isArray(c) {
		return 0, fmt.Errorf("msgpack code %#x, want an array", c)
	}
	n, err := d.dec.DecodeArrayLen()
	if err == nil && n > d.rd.Len() {
		err = fmt.Errorf("array of %d elements with %d bytes left", n, d.rd.Len())
	}
	return n, err
}

// mapLen reads a map header (not nil) whose length the rest of the
// payload can hold.
func (d *kvDecoder) mapLen() (int, error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return 0, err
	}
	if !isMap(c) {
		return 0, fmt.Errorf("msgpack code %#x, want a map", c)
	}
	n, err := d.dec.DecodeMapLen()
	if err == nil && n > d.rd.Len()/2 {
		err = fmt.Errorf("map of %d entries with %d bytes left", n, d.rd.Len())
	}
	return n, err
}

// skipN skips n values (none when n <= 0).
func (d *kvDecoder) skipN(n int) error {
	for ; n > 0; n-- {
		if err := d.skip(); err != nil {
			return err
		}
	}
	return nil
}

// skip skips one value, however nested, without recursion (a payload of
// nested arrays cannot grow the stack) and without copying strings.
func (d *kvDecoder) skip() error {
	for pending := 1; pending > 0; pending-- {
		c, err := d.dec.PeekCode()
		if err != nil {
			return err
		}
		switch {
		case isArray(c):
			n, err := d.arrayLen()
			if err != nil {
				return err
			}
			pending += n
		case isMap(c):
			n, err := d.mapLen()
			if err != nil {
				return err
			}
			pending += 2 * n
		case msgpcode.IsString(c) || msgpcode.IsBin(c):
			if _, err := d.bytes(); err != nil {
				return err
			}
		default: // scalars and extensions
			if msgpcode.IsExt(c) {
				if err := d.checkExtLen(); err != nil {
					return err
				}
			}
			if err := d.dec.Skip(); err != nil {
				return err
			}
		}
	}
	return nil
}

// checkExtLen rejects an extension longer than the rest of the payload
// before the Decoder sizes a buffer for it.
func (d *kvDecoder) checkExtLen() error {
	at := len(d.payload) - d.rd.Len()
	p := d.payload[at:]
	var n uint64
	switch c := p[0]; {
	case c >= msgpcode.FixExt1 && c <= msgpcode.FixExt16:
		return nil
	case c == msgpcode.Ext8 && len(p) >= 2:
		n = uint64(p[1])
	case c == msgpcode.Ext16 && len(p) >= 3:
		n = uint64(p[1])<<8 | uint64(p[2])
	case c == msgpcode.Ext32 && len(p) >= 5:
		n = uint64(p[1])<<24 | uint64(p[2])<<16 | uint64(p[3])<<8 | uint64(p[4])
	default:
		return io.ErrUnexpectedEOF
	}
	if n > uint64(len(p)) {
		return fmt.Errorf("extension of %d bytes with %d left", n, len(p))
	}
	return nil
}

func isArray(c byte) bool {
	return msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
}

func isMap(c byte) bool {
	return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
}

// isInt reports whether c starts an integer: a fixnum, or uint8 to int64
// (0xcc to 0xd3).
func isInt(c byte) bool {
	return msgpcode.IsFixedNum(c) || c >= msgpcode.Uint8 && c <= msgpcode.Int64
}
