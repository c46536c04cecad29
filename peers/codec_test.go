package peers

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"testing"
)

func chain(seed uint64, n int) []uint64 {
	c := make([]uint64, n)
	for i := range c {
		seed = seed*6364136223846793005 + 1442695040888963407
		c[i] = seed
	}
	return c
}

// Placements survive the wire: several chains, one longer than a message
// holds (split into pieces over messages, first blocks first), every
// message within maxDatagram and decodable alone.
func TestCodecRoundTrip(t *testing.T) {
	h := header{sender: 42, fingerprint: 7}
	in := []placement{{1, chain(1, 3)}, {2, chain(2, 400)}, {3, chain(3, 1)}}
	for i := range 70 { // more entries than one message takes
		in = append(in, placement{uint64(10 + i), chain(uint64(100+i), 2)})
	}
	msgs := encodePlacements(nil, h, in)
	if len(msgs) < 3 {
		t.Fatalf("%d messages for a 400-block chain and 73 entries", len(msgs))
	}
	got := map[uint64][]uint64{}
	var ps []placement
	var flat []uint64
	for _, b := range msgs {
		if len(b) > maxDatagram {
			t.Fatalf("message of %d bytes", len(b))
		}
		hh, body, err := readHeader(b)
		if err != nil || hh != (header{kindPlacement, 42, 7}) {
			t.Fatalf("header %+v, %v", hh, err)
		}
		if ps, flat, err = decodePlacements(body, ps, flat); err != nil {
			t.Fatal(err)
		}
		for _, p := range ps {
			got[p.endpoint] = append(got[p.endpoint], p.hashes...)
		}
	}
	for _, p := range in {
		if !slices.Equal(got[p.endpoint], p.hashes) {
			t.Fatalf("endpoint %d: %d hashes back of %d", p.endpoint, len(got[p.endpoint]), len(p.hashes))
		}
	}
}

// A malformed message is refused whole, with ErrBadMessage.
func TestDecodeRejects(t *testing.T) {
	good := encodePlacements(nil, header{sender: 1}, []placement{{1, chain(1, 4)}, {2, chain(2, 4)}})[0]
	_, body, _ := readHeader(good)
	for name, b := range map[string][]byte{
		"empty":          {},
		"no count":       {0},
		"too many":       {maxEntries + 1},
		"truncated":      body[:len(body)-3],
		"trailing bytes": append(append([]byte{}, body...), 0),
		"zero hashes":    {1, 1, 0, 0, 0, 0, 0, 0, 0, 0},
	} {
		ps, _, err := decodePlacements(b, nil, nil)
		if !errors.Is(err, ErrBadMessage) || len(ps) != 0 {
			t.Errorf("%s: %v, %d entries", name, err, len(ps))
		}
	}
	for name, b := range map[string][]byte{
		"short":   good[:headerLen-1],
		"magic":   append([]byte("xv"), good[2:]...),
		"version": append([]byte{'k', 'v', 9}, good[3:]...),
	} {
		if _, _, err := readHeader(b); !errors.Is(err, ErrBadMessage) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// FuzzDecode: any bytes decode or are refused with ErrBadMessage, never a
// panic; what decodes stays within the bounds and encodes back to
// messages that decode to the same placements.
func FuzzDecode(f *testing.F) {
	for _, b := range encodePlacements(nil, header{sender: 3, fingerprint: 4}, []placement{{1, chain(1, 200)}, {9, chain(9, 1)}}) {
		f.Add(b)
	}
	f.Add([]byte("kv"))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, body, err := readHeader(b)
		if err != nil {
			if !errors.Is(err, ErrBadMessage) {
				t.Fatal(err)
			}
			return
		}
		ps, _, err := decodePlacements(body, nil, nil)
		if err != nil {
			if !errors.Is(err, ErrBadMessage) {
				t.Fatal(err)
			}
			return
		}
		if len(ps) == 0 || len(ps) > maxEntries {
			t.Fatalf("%d entries", len(ps))
		}
		byEndpoint := func(ps []placement) map[uint64][]uint64 {
			m := map[uint64][]uint64{}
			for _, p := range ps {
				m[p.endpoint] = append(m[p.endpoint], p.hashes...)
			}
			return m
		}
		want := byEndpoint(ps)
		var again []placement
		for _, m := range encodePlacements(nil, h, ps) {
			_, body, _ := readHeader(m)
			got, _, err := decodePlacements(body, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range got {
				again = append(again, placement{p.endpoint, slices.Clone(p.hashes)})
			}
		}
		back := byEndpoint(again)
		for e, hs := range want {
			if !slices.Equal(back[e], hs) {
				t.Fatalf("endpoint %x: %d hashes re-encoded to %d", e, len(hs), len(back[e]))
			}
		}
	})
}

// ages returns n claim ages.
func ages(n int, age uint32) []uint32 {
	a := make([]uint32, n)
	for i := range a {
		a[i] = age + uint32(i)
	}
	return a
}

// A state message carries every endpoint's claims with their ages, and
// at most maxStateClaims of them (the most recent of the last endpoints
// given are left out), then the homes.
func TestStateRoundTrip(t *testing.T) {
	in := []claims{{1, chain(1, 3), ages(3, 0)}, {2, nil, nil}, {3, chain(3, maxStateClaims), ages(maxStateClaims, 100)}}
	homes := []home{{key: 7, endpoint: 1, recurring: true, age: 3}, {key: 8, endpoint: 3, age: maxAge}}
	b := encodeState(header{sender: 5, fingerprint: 6}, in, homes)
	h, body, err := readHeader(b)
	if err != nil || h != (header{kindState, 5, 6}) {
		t.Fatalf("header %+v, %v", h, err)
	}
	got, gotHomes, err := decodeState(body)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(gotHomes, homes) {
		t.Fatalf("homes %+v, want %+v", gotHomes, homes)
	}
	if len(got) != 3 || !slices.Equal(got[0].hashes, in[0].hashes) || !slices.Equal(got[0].ages, in[0].ages) || len(got[1].hashes) != 0 {
		t.Fatalf("decoded %+v", got[:2])
	}
	if n := len(got[2].hashes); n != maxStateClaims-3 || !slices.Equal(got[2].hashes, in[2].hashes[:n]) || !slices.Equal(got[2].ages, in[2].ages[:n]) {
		t.Fatalf("last endpoint: %d claims back, want the first %d", n, maxStateClaims-3)
	}
	// An older sender's state ends after the claims: no homes.
	_, old, _ := readHeader(encodeState(header{}, in[:1], nil))
	old = old[:len(old)-1]
	if cs, hs, err := decodeState(old); err != nil || len(cs) != 1 || hs != nil {
		t.Fatalf("a state without homes: %v, %d endpoints, %d homes", err, len(cs), len(hs))
	}
	for name, b := range map[string][]byte{
		"empty":                   {},
		"too many":                binaryUvarint(maxStateEndpoints + 1),
		"truncated claims":        old[:len(old)-3],
		"truncated homes":         body[:len(body)-3],
		"trailing bytes":          append(append([]byte{}, body...), 0),
		"claims beyond the bytes": append(append(binaryUvarint(1), 1, 0, 0, 0, 0, 0, 0, 0), binaryUvarint(1000)...),
		"homes beyond the bytes":  append(append([]byte{}, old...), binaryUvarint(2)...),
		"too many homes":          append(append([]byte{}, old...), binaryUvarint(maxStateHomes+1)...),
	} {
		if cs, hs, err := decodeState(b); !errors.Is(err, ErrBadMessage) || cs != nil || hs != nil {
			t.Errorf("%s: %v, %d endpoints, %d homes", name, err, len(cs), len(hs))
		}
	}
}

func binaryUvarint(x uint64) []byte { return binary.AppendUvarint(nil, x) }

// FuzzDecodeState: any bytes decode as a state or are refused with
// ErrBadMessage, never a panic; what decodes is within the bounds and
// encodes back to itself.
func FuzzDecodeState(f *testing.F) {
	_, body, _ := readHeader(encodeState(header{}, []claims{{1, chain(1, 20), ages(20, 7)}, {2, chain(2, 1), ages(1, 1<<20)}},
		[]home{{key: 1, endpoint: 2, recurring: true, age: 9}}))
	f.Add(body)
	f.Add([]byte{0})
	f.Fuzz(func(t *testing.T, b []byte) {
		cs, hs, err := decodeState(b)
		if err != nil {
			if !errors.Is(err, ErrBadMessage) {
				t.Fatal(err)
			}
			return
		}
		total := 0
		for _, c := range cs {
			total += len(c.hashes)
			if len(c.ages) != len(c.hashes) {
				t.Fatalf("%d ages for %d hashes", len(c.ages), len(c.hashes))
			}
		}
		if len(cs) > maxStateEndpoints || total > maxStateClaims || len(hs) > maxStateHomes {
			t.Fatalf("%d endpoints, %d claims, %d homes", len(cs), total, len(hs))
		}
		_, again, _ := readHeader(encodeState(header{}, cs, hs))
		back, backHomes, err := decodeState(again)
		if err != nil || len(back) != len(cs) || !slices.Equal(backHomes, hs) {
			t.Fatalf("re-encoded: %v, %d endpoints of %d, homes %d of %d", err, len(back), len(cs), len(backHomes), len(hs))
		}
		for i := range cs {
			if back[i].endpoint != cs[i].endpoint || !slices.Equal(back[i].hashes, cs[i].hashes) || !slices.Equal(back[i].ages, cs[i].ages) {
				t.Fatalf("endpoint %d changed in a round trip", i)
			}
		}
	})
}

// Load messages carry every endpoint's requests in flight, maxLoadEntries
// a message, counts clamped to [0, maxInFlight]; bad ones are refused.
func TestLoadRoundTrip(t *testing.T) {
	var in []loadEntry
	for i := range 250 {
		in = append(in, loadEntry{uint64(i + 1), int64(i)})
	}
	in[7].inFlight, in[8].inFlight = -3, maxInFlight+10
	msgs := encodeLoad(nil, header{sender: 1, fingerprint: 2}, in)
	if len(msgs) != 3 {
		t.Fatalf("%d messages for 250 endpoints", len(msgs))
	}
	var got []loadEntry
	for _, b := range msgs {
		if len(b) > maxDatagram {
			t.Fatalf("message of %d bytes", len(b))
		}
		h, body, err := readHeader(b)
		if err != nil || h.kind != kindLoad {
			t.Fatalf("header %+v, %v", h, err)
		}
		es, err := decodeLoad(body, nil)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, es...)
	}
	want := slices.Clone(in)
	want[7].inFlight, want[8].inFlight = 0, maxInFlight
	if !slices.Equal(got, want) {
		t.Fatalf("load back differs")
	}
	_, body, _ := readHeader(msgs[2])
	for name, b := range map[string][]byte{
		"empty":          {},
		"no entries":     {0},
		"too many":       {maxLoadEntries + 1},
		"truncated":      body[:len(body)-1],
		"trailing bytes": append(append([]byte{}, body...), 0),
	} {
		if es, err := decodeLoad(b, nil); !errors.Is(err, ErrBadMessage) || len(es) != 0 {
			t.Errorf("%s: %v, %d entries", name, err, len(es))
		}
	}
}

// FuzzDecodeLoad: any bytes decode as a load message or are refused with
// ErrBadMessage, never a panic; what decodes is within the bounds and
// encodes back to itself.
func FuzzDecodeLoad(f *testing.F) {
	_, body, _ := readHeader(encodeLoad(nil, header{}, []loadEntry{{1, 3}, {2, 0}, {3, 70000}})[0])
	f.Add(body)
	f.Fuzz(func(t *testing.T, b []byte) {
		es, err := decodeLoad(b, nil)
		if err != nil {
			if !errors.Is(err, ErrBadMessage) {
				t.Fatal(err)
			}
			return
		}
		if len(es) == 0 || len(es) > maxLoadEntries {
			t.Fatalf("%d entries", len(es))
		}
		msgs := encodeLoad(nil, header{}, es)
		_, again, _ := readHeader(msgs[0])
		back, err := decodeLoad(again, nil)
		if err != nil || len(msgs) != 1 || !slices.Equal(back, es) {
			t.Fatalf("re-encoded: %v, %d messages", err, len(msgs))
		}
	})
}

// tupleCodec is a message kind of fixed-width tuples of words (links,
// sequences), decoded back to its words in order.
type tupleCodec struct {
	kind       byte
	width, max int
	encode     func(out [][]byte, h header, words []uint64) [][]byte
	decode     func(b []byte) ([]uint64, error)
}

var tupleCodecs = map[string]tupleCodec{
	"links": {kindLinks, 2, maxLinkPairs, encodeLinks, func(b []byte) ([]uint64, error) {
		blocks, tokens, err := decodeLinks(b, nil, nil)
		if len(blocks) != len(tokens) {
			return nil, fmt.Errorf("%d blocks, %d tokens", len(blocks), len(tokens))
		}
		var words []uint64
		for i := range blocks {
			words = append(words, blocks[i], tokens[i])
		}
		return words, err
	}},
	"sequences": {kindSequences, 3, maxSeqTriples, encodeSequences, func(b []byte) ([]uint64, error) {
		return decodeSequences(b, nil)
	}},
	"outcomes": {kindOutcomes, 3, maxSeqTriples, encodeOutcomes, func(b []byte) ([]uint64, error) {
		return decodeSequences(b, nil) // the same triples
	}},
}

// Links, sequences and outcomes: any number of tuples split over messages of their
// bound, each within maxDatagram, back in order; a malformed body is
// refused whole.
func TestTuplesRoundTrip(t *testing.T) {
	for name, c := range tupleCodecs {
		in := chain(5, c.width*(2*c.max+3)) // 2 full messages and 3 tuples
		msgs := c.encode(nil, header{sender: 1, fingerprint: 2}, in)
		if len(msgs) != 3 {
			t.Fatalf("%s: %d messages for %d tuples", name, len(msgs), len(in)/c.width)
		}
		var got []uint64
		for _, b := range msgs {
			if len(b) > maxDatagram {
				t.Fatalf("%s: message of %d bytes", name, len(b))
			}
			h, body, err := readHeader(b)
			if err != nil || h.kind != c.kind {
				t.Fatalf("%s: header %+v, %v", name, h, err)
			}
			words, err := c.decode(body)
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, words...)
		}
		if !slices.Equal(got, in) {
			t.Fatalf("%s: back differ", name)
		}
		if msgs := c.encode(nil, header{}, in[:c.width-1]); len(msgs) != 0 {
			t.Fatalf("%s: part of a tuple encoded as %d messages", name, len(msgs))
		}
		_, body, _ := readHeader(msgs[2])
		for bad, b := range map[string][]byte{
			"empty":          {},
			"no tuples":      {0},
			"too many":       binaryUvarint(uint64(c.max + 1)),
			"truncated":      body[:len(body)-1],
			"trailing bytes": append(append([]byte{}, body...), 0),
		} {
			if words, err := c.decode(b); !errors.Is(err, ErrBadMessage) || len(words) != 0 {
				t.Errorf("%s, %s: %v, %d words", name, bad, err, len(words))
			}
		}
	}
}

// fuzzTuples: any bytes decode as c's message or are refused with
// ErrBadMessage, never a panic; what decodes is within the bounds and
// encodes back to itself.
func fuzzTuples(f *testing.F, c tupleCodec) {
	_, body, _ := readHeader(c.encode(nil, header{}, chain(1, 3*c.width))[0])
	f.Add(body)
	f.Fuzz(func(t *testing.T, b []byte) {
		words, err := c.decode(b)
		if err != nil {
			if !errors.Is(err, ErrBadMessage) {
				t.Fatal(err)
			}
			return
		}
		if len(words) == 0 || len(words) > c.width*c.max || len(words)%c.width != 0 {
			t.Fatalf("%d words", len(words))
		}
		msgs := c.encode(nil, header{}, words)
		_, again, _ := readHeader(msgs[0])
		back, err := c.decode(again)
		if err != nil || len(msgs) != 1 || !slices.Equal(back, words) {
			t.Fatalf("re-encoded: %v, %d messages", err, len(msgs))
		}
	})
}

func FuzzDecodeLinks(f *testing.F)     { fuzzTuples(f, tupleCodecs["links"]) }
func FuzzDecodeSequences(f *testing.F) { fuzzTuples(f, tupleCodecs["sequences"]) }

// Key files: base64 keys of 16, 24 or 32 bytes, one a line, comments and
// blank lines skipped; anything else refused with the line.
func TestParseKeys(t *testing.T) {
	keys, err := ParseKeys([]byte("# primary\nAAAAAAAAAAAAAAAAAAAAAA==\n\nAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n"))
	if err != nil || len(keys) != 2 || len(keys[0]) != 16 || len(keys[1]) != 32 {
		t.Fatalf("%d keys, %v", len(keys), err)
	}
	for _, bad := range []string{"", "# none\n", "not base64!\n", "AAAA\n"} {
		if _, err := ParseKeys([]byte(bad)); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
