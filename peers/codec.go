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
// them. A state message (kind 3, memberlist's push/pull over TCP, when a
// replica joins and every PushPullInterval) carries the sender's whole
// index, most recently used claims first:
//
//	count uvarint (0..maxStateEndpoints)
//	count × { endpoint u64 | n uvarint | n × { hash u64 | age uvarint (s) } }
//
// with at most maxStateClaims claims in all, then, since the homes were
// added, the sender's prompt homes (routing's, most recently used first):
//
//	count uvarint (0..maxStateHomes)
//	count × { key u64 | endpoint u64 | age << 1 | recurring uvarint }
//
// A state without that part (an older sender's) has no homes. A load message (kind 2) is
// the sender's own requests in flight per endpoint:
//
//	count uvarint (1..maxLoadEntries)
//	count × { endpoint u64 | in flight uvarint (..maxInFlight) }
//
// A links message (kind 4) carries links the sender learned by tokenizing
// prompts it forwarded (engine truth's): each a block hash and the key of
// the engine's token block it ends at,
//
//	count uvarint (1..maxLinkPairs)
//	count × { block hash u64 | token key u64 }
//
// (a replica older than links refuses the kind and counts it malformed).
// A sequences message (kind 5) carries the conversations' turns the sender
// placed (routing's sequences): each the endpoint, the mark of the earlier
// prompt the turn continued there (0: none) and the turn's own,
//
//	count uvarint (1..maxSeqTriples)
//	count × { endpoint u64 | from u64 | to u64 }
//
// (a replica older than sequences refuses the kind likewise). An outcomes
// message (kind 6) carries what the sender's answers said of those
// sequences: each the endpoint, the sequence's distance there and whether
// the engine still held it (1) or not (0),
//
//	count uvarint (1..maxSeqTriples)
//	count × { endpoint u64 | distance u64 | held u64 }
const (
	version       = 1
	kindPlacement = 1
	kindLoad      = 2
	kindState     = 3
	kindLinks     = 4
	kindSequences = 5
	kindOutcomes  = 6
	// maxLoadEntries bounds a load message's endpoints (it fits
	// maxDatagram); maxInFlight a count in it.
	maxLoadEntries = 100
	maxInFlight    = 1 << 16
	// maxStateEndpoints and maxStateClaims bound a state message (about
	// 1.2 MB at most; memberlist's push/pull takes up to 20 MB).
	maxStateEndpoints = 4096
	maxStateClaims    = 96 << 10
	// maxStateHomes bounds a state message's homes (about 1.3 MB more):
	// routing keeps at most as many.
	maxStateHomes = 1 << 16
	// maxAge bounds a claim's age in a state message (194 days; the
	// index's TTL drops far younger ones).
	maxAge    = 1 << 24
	headerLen = 16
	// maxDatagram bounds a message: one UDP packet under memberlist's
	// 1,400-byte buffer with room for its encryption and framing.
	maxDatagram = 1200
	// maxEntries and maxHashes bound what a decoder accepts (a message
	// of maxDatagram holds fewer).
	maxEntries = 64
	maxHashes  = (maxDatagram - headerLen) / 8
	// entryOverhead is an entry's bytes besides its hashes, at most.
	entryOverhead = 8 + 2
	// maxLinkPairs bounds a links message's pairs, maxSeqTriples a
	// sequences message's triples (each fits maxDatagram).
	maxLinkPairs  = (maxDatagram - headerLen - 1) / 16
	maxSeqTriples = (maxDatagram - headerLen - 1) / 24
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

// claims are one endpoint's claims in a state message: hashes, most
// recently used first, and their ages in seconds.
type claims struct {
	endpoint uint64
	hashes   []uint64
	ages     []uint32
}

// home is one prompt key's home in a state message: the endpoint the
// sender homes it on, whether it recurs, its age in seconds.
type home struct {
	key, endpoint uint64
	recurring     bool
	age           uint32
}

// encodeState returns a state message carrying cs (at most maxStateClaims
// claims in all, and maxStateEndpoints endpoints: the rest are left out)
// and hs (the first maxStateHomes).
func encodeState(h header, cs []claims, hs []home) []byte {
	h.kind = kindState
	b := appendHeader(nil, h)
	cs = cs[:min(len(cs), maxStateEndpoints)]
	b = binary.AppendUvarint(b, uint64(len(cs)))
	left := maxStateClaims
	for _, c := range cs {
		n := min(len(c.hashes), left)
		left -= n
		b = binary.LittleEndian.AppendUint64(b, c.endpoint)
		b = binary.AppendUvarint(b, uint64(n))
		for i, x := range c.hashes[:n] {
			b = binary.LittleEndian.AppendUint64(b, x)
			b = binary.AppendUvarint(b, uint64(min(c.ages[i], maxAge)))
		}
	}
	hs = hs[:min(len(hs), maxStateHomes)]
	b = binary.AppendUvarint(b, uint64(len(hs)))
	for _, x := range hs {
		b = binary.LittleEndian.AppendUint64(b, x.key)
		b = binary.LittleEndian.AppendUint64(b, x.endpoint)
		v := uint64(min(x.age, maxAge)) << 1
		if x.recurring {
			v |= 1
		}
		b = binary.AppendUvarint(b, v)
	}
	return b
}

// decodeState reads a state message's body (after the header) whole, and
// refuses it whole if any part is bad.
func decodeState(b []byte) ([]claims, []home, error) {
	cs, b, err := decodeClaims(b)
	if err != nil {
		return nil, nil, err
	}
	if len(b) == 0 { // an older sender's: no homes
		return cs, nil, nil
	}
	count, n := binary.Uvarint(b)
	if n <= 0 || count > maxStateHomes || count > uint64(len(b))/17 {
		return nil, nil, fmt.Errorf("%w: state home count", ErrBadMessage)
	}
	b = b[n:]
	hs := make([]home, 0, count)
	for range count {
		if len(b) < 17 {
			return nil, nil, fmt.Errorf("%w: truncated homes", ErrBadMessage)
		}
		x := home{key: binary.LittleEndian.Uint64(b), endpoint: binary.LittleEndian.Uint64(b[8:])}
		v, n := binary.Uvarint(b[16:])
		if n <= 0 || v>>1 > maxAge {
			return nil, nil, fmt.Errorf("%w: home age", ErrBadMessage)
		}
		x.recurring, x.age = v&1 == 1, uint32(v>>1)
		hs = append(hs, x)
		b = b[16+n:]
	}
	if len(b) != 0 {
		return nil, nil, fmt.Errorf("%w: %d bytes after the state", ErrBadMessage, len(b))
	}
	return cs, hs, nil
}

// decodeClaims reads a state's claims and returns what follows them.
func decodeClaims(b []byte) ([]claims, []byte, error) {
	count, n := binary.Uvarint(b)
	if n <= 0 || count > maxStateEndpoints {
		return nil, nil, fmt.Errorf("%w: state endpoint count", ErrBadMessage)
	}
	b = b[n:]
	cs := make([]claims, 0, count)
	total := uint64(0)
	for range count {
		if len(b) < 8 {
			return nil, nil, fmt.Errorf("%w: truncated state", ErrBadMessage)
		}
		c := claims{endpoint: binary.LittleEndian.Uint64(b)}
		hn, n := binary.Uvarint(b[8:])
		if n <= 0 || hn > maxStateClaims-total || hn > uint64(len(b))/9 {
			return nil, nil, fmt.Errorf("%w: state claim count", ErrBadMessage)
		}
		total += hn
		b = b[8+n:]
		c.hashes, c.ages = make([]uint64, 0, hn), make([]uint32, 0, hn)
		for range hn {
			if len(b) < 9 {
				return nil, nil, fmt.Errorf("%w: truncated claims", ErrBadMessage)
			}
			x := binary.LittleEndian.Uint64(b)
			age, n := binary.Uvarint(b[8:])
			if n <= 0 || age > maxAge {
				return nil, nil, fmt.Errorf("%w: claim age", ErrBadMessage)
			}
			c.hashes, c.ages = append(c.hashes, x), append(c.ages, uint32(age))
			b = b[8+n:]
		}
		cs = append(cs, c)
	}
	return cs, b, nil
}

// loadEntry is one endpoint's requests in flight in a load message.
type loadEntry struct {
	endpoint uint64
	inFlight int64
}

// encodeLoad appends to out the load messages carrying es (maxLoadEntries
// endpoints each) and returns them.
func encodeLoad(out [][]byte, h header, es []loadEntry) [][]byte {
	h.kind = kindLoad
	for len(es) > 0 {
		n := min(len(es), maxLoadEntries)
		b := appendHeader(make([]byte, 0, maxDatagram), h)
		b = binary.AppendUvarint(b, uint64(n))
		for _, e := range es[:n] {
			b = binary.LittleEndian.AppendUint64(b, e.endpoint)
			b = binary.AppendUvarint(b, uint64(min(max(e.inFlight, 0), maxInFlight)))
		}
		out, es = append(out, b), es[n:]
	}
	return out
}

// decodeLoad reads a load message's body (after the header) whole into
// es (reused; returned), and refuses it whole if any part is bad.
func decodeLoad(b []byte, es []loadEntry) ([]loadEntry, error) {
	es = es[:0]
	count, n := binary.Uvarint(b)
	if n <= 0 || count == 0 || count > maxLoadEntries {
		return es, fmt.Errorf("%w: load count", ErrBadMessage)
	}
	b = b[n:]
	for range count {
		if len(b) < 9 {
			return es[:0], fmt.Errorf("%w: truncated load", ErrBadMessage)
		}
		ep := binary.LittleEndian.Uint64(b)
		v, n := binary.Uvarint(b[8:])
		if n <= 0 || v > maxInFlight {
			return es[:0], fmt.Errorf("%w: in-flight count", ErrBadMessage)
		}
		es = append(es, loadEntry{ep, int64(v)})
		b = b[8+n:]
	}
	if len(b) != 0 {
		return es[:0], fmt.Errorf("%w: %d bytes after the load", ErrBadMessage, len(b))
	}
	return es, nil
}

// encodeLinks appends to out the messages carrying pairs (block, token,
// block, token, …) and returns them.
func encodeLinks(out [][]byte, h header, pairs []uint64) [][]byte {
	h.kind = kindLinks
	return encodeWords(out, h, 2, maxLinkPairs, pairs)
}

// decodeLinks reads a links message's body (after the header) whole into
// blocks and tokens (reused; returned), and refuses it whole if any part
// is bad.
func decodeLinks(b []byte, blocks, tokens []uint64) ([]uint64, []uint64, error) {
	words, err := decodeWords(b, 2, maxLinkPairs, blocks[:0])
	tokens = tokens[:0]
	if err != nil {
		return words[:0], tokens, fmt.Errorf("%w: links", err)
	}
	n := len(words) / 2
	for i := range n { // de-interleave in place: block i moves down to i
		tokens = append(tokens, words[2*i+1])
		words[i] = words[2*i]
	}
	return words[:n], tokens, nil
}

// encodeSequences appends to out the messages carrying triples (endpoint,
// from, to, …) and returns them.
func encodeSequences(out [][]byte, h header, triples []uint64) [][]byte {
	h.kind = kindSequences
	return encodeWords(out, h, 3, maxSeqTriples, triples)
}

// decodeSequences reads a sequences message's body whole into triples
// (reused; returned), and refuses it whole if any part is bad.
func decodeSequences(b []byte, triples []uint64) ([]uint64, error) {
	triples, err := decodeWords(b, 3, maxSeqTriples, triples[:0])
	if err != nil {
		return triples[:0], fmt.Errorf("%w: sequences", err)
	}
	return triples, nil
}

// encodeOutcomes appends to out the messages carrying triples (endpoint,
// distance, held, …) and returns them.
func encodeOutcomes(out [][]byte, h header, triples []uint64) [][]byte {
	h.kind = kindOutcomes
	return encodeWords(out, h, 3, maxSeqTriples, triples)
}

// encodeWords appends to out messages of header h carrying words in tuples
// of width, at most max tuples a message: count uvarint, then the words.
func encodeWords(out [][]byte, h header, width, max int, words []uint64) [][]byte {
	for len(words) >= width {
		k := min(len(words)/width, max)
		b := appendHeader(make([]byte, 0, maxDatagram), h)
		b = binary.AppendUvarint(b, uint64(k))
		for _, x := range words[:width*k] {
			b = binary.LittleEndian.AppendUint64(b, x)
		}
		out, words = append(out, b), words[width*k:]
	}
	return out
}

// decodeWords reads encodeWords' body whole, appending its words to words.
func decodeWords(b []byte, width, max int, words []uint64) ([]uint64, error) {
	count, n := binary.Uvarint(b)
	if n <= 0 || count == 0 || count > uint64(max) {
		return words, fmt.Errorf("%w: count", ErrBadMessage)
	}
	b = b[n:]
	if uint64(len(b)) != 8*uint64(width)*count {
		return words, fmt.Errorf("%w: %d bytes for %d tuples", ErrBadMessage, len(b), count)
	}
	for i := range width * int(count) {
		words = append(words, binary.LittleEndian.Uint64(b[8*i:]))
	}
	return words, nil
}
