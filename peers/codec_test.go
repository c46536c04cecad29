package peers

import (
	"errors"
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
