package peers

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// ErrBadMessage wraps every reason a peer's message is refused.
var ErrBadMessage = errors.New("bad peer message")

// The wire format, version 1, little endian. Every message starts with a
// header:
//
//	magic 'k' 'v' | version u8 | kind u8 | sender u64 | fingerprint u32
//
// sender names the replica (memberlist does not say who sent a packet);
// fingerprint is the hashing configuration: replicas whose block hashes
// could never match ignore each other. A placements message (kind 1) then
// carries
//
//	count uvarint (1..maxEntries)
//	count × { endpoint u64 | n uvarint (1..maxHashes) | n × hash u64 }
//
// each entry a chain of block hashes (or a piece of one, first block
// first) that the sender sent to the endpoint. Block hashes are random,
// so they are written whole: neither varints nor compression would shrink
// them.
const (
	version       = 1
	kindPlacement = 1
	headerLen     = 16
	// maxDatagram bounds a message: one UDP packet under memberlist's
	// 1,400-byte buffer with room for its encryption and framing.
	maxDatagram = 1200
	// maxEntries and maxHashes bound what a decoder accepts (a message
	// of maxDatagram holds fewer).
	maxEntries = 64
	maxHashes  = (maxDatagram - headerLen) / 8
	// entryOverhead is an entry's bytes besides its hashes, at most.
	entryOverhead = 8 + 2
)

// header is a message's header.
type header struct {
	kind        byte
	sender      uint64
	fingerprint uint32
}

func appendHeader(b []byte, h header) []byte {
	b = append(b, 'k', 'v', version, h.kind)
	b = binary.LittleEndian.AppendUint64(b, h.sender)
	return binary.LittleEndian.AppendUint32(b, h.fingerprint)
}

func readHeader(b []byte) (header, []byte, error) {
	if len(b) < headerLen {
		return header{}, nil, fmt.Errorf("%w: %d bytes, shorter than a header", ErrBadMessage, len(b))
	}
	if b[0] != 'k' || b[1] != 'v' {
		return header{}, nil, fmt.Errorf("%w: no kvroute magic", ErrBadMessage)
	}
	if b[2] != version {
		return header{}, nil, fmt.Errorf("%w: version %d, want %d", ErrBadMessage, b[2], version)
	}
	h := header{kind: b[3], sender: binary.LittleEndian.Uint64(b[4:]), fingerprint: binary.LittleEndian.Uint32(b[12:])}
	return h, b[headerLen:], nil
}

// placement is one entry: hashes sent to endpoint.
type placement struct {
	endpoint uint64
	hashes   []uint64
}

// encodePlacements appends to out the messages (each at most maxDatagram
// bytes) carrying ps, splitting a chain longer than a message holds into
// pieces, and returns them.
func encodePlacements(out [][]byte, h header, ps []placement) [][]byte {
	h.kind = kindPlacement
	var msg []byte
	var count, countAt int
	flush := func() {
		if count > 0 {
			// The count was reserved as one byte: maxEntries < 128.
			msg[countAt] = byte(count)
			out = append(out, msg)
		}
		msg, count = nil, 0
	}
	for _, p := range ps {
		for rest := p.hashes; len(rest) > 0; {
			if msg != nil && (count == maxEntries || len(msg)+entryOverhead+8 > maxDatagram) {
				flush()
			}
			if msg == nil {
				msg = appendHeader(make([]byte, 0, maxDatagram), h)
				countAt = len(msg)
				msg = append(msg, 0)
			}
			n := min(len(rest), (maxDatagram-len(msg)-entryOverhead)/8)
			msg = binary.LittleEndian.AppendUint64(msg, p.endpoint)
			msg = binary.AppendUvarint(msg, uint64(n))
			for _, x := range rest[:n] {
				msg = binary.LittleEndian.AppendUint64(msg, x)
			}
			rest = rest[n:]
			count++
		}
	}
	flush()
	return out
}

// decodePlacements reads a placements message's body (after the header)
// whole, into ps and flat (reused; returned), and refuses it whole if any
// part is bad: a message is applied entirely or not at all. Each entry's
// hashes are a slice of flat.
func decodePlacements(b []byte, ps []placement, flat []uint64) ([]placement, []uint64, error) {
	ps, flat = ps[:0], flat[:0]
	count, n := binary.Uvarint(b)
	if n <= 0 || count == 0 || count > maxEntries {
		return ps, flat, fmt.Errorf("%w: placement count", ErrBadMessage)
	}
	b = b[n:]
	type span struct {
		endpoint   uint64
		start, end int
	}
	var spans [maxEntries]span
	for i := range count {
		if len(b) < 8 {
			return ps, flat, fmt.Errorf("%w: truncated entry", ErrBadMessage)
		}
		ep := binary.LittleEndian.Uint64(b)
		hn, n := binary.Uvarint(b[8:])
		if n <= 0 || hn == 0 || hn > maxHashes {
			return ps, flat, fmt.Errorf("%w: hash count", ErrBadMessage)
		}
		b = b[8+n:]
		if uint64(len(b)) < 8*hn {
			return ps, flat, fmt.Errorf("%w: truncated hashes", ErrBadMessage)
		}
		start := len(flat)
		for j := range int(hn) {
			flat = append(flat, binary.LittleEndian.Uint64(b[8*j:]))
		}
		b = b[8*hn:]
		spans[i] = span{ep, start, len(flat)}
	}
	if len(b) != 0 {
		return ps, flat, fmt.Errorf("%w: %d bytes after the entries", ErrBadMessage, len(b))
	}
	for _, s := range spans[:count] {
		ps = append(ps, placement{endpoint: s.endpoint, hashes: flat[s.start:s.end:s.end]})
	}
	return ps, flat, nil
}
