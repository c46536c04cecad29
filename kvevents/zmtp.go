package kvevents

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"time"
)

// ZMTP 3.0 (rfc.zeromq.org/spec/23) with the NULL mechanism: the wire
// protocol of ZeroMQ sockets (libzmq 4 under pyzmq in vLLM and SGLang,
// go-zeromq/zmq4 in the llm-d simulator), as much of it as a SUB and a
// DEALER need, and the PUB and ROUTER of bench/sim's simulated engine.
// kvroute speaks it itself rather than through zmq4's sockets so that
// nothing a peer sends can crash or grow it: zmq4 panics on an unknown
// peer socket type and on malformed handshake metadata, sizes a frame's
// buffer from its 64-bit length on the wire, and leaks a reader goroutine
// when a socket is closed with messages unread. Here every connection is
// one goroutine's net.Conn, every length is checked before anything is
// allocated, and closing the conn ends everything. This is the tree's one
// ZMTP implementation: bench/sim's publisher and replay server use it too.

// errZMTP is wrapped by the errors of a peer that breaks the protocol.
var errZMTP = errors.New("kvevents: ZMTP protocol error")

// Frame flags.
const (
	zmtpMore    = 0x01
	zmtpLong    = 0x02
	zmtpCommand = 0x04
)

const (
	zmtpGreetingLen = 64
	// zmtpMaxCommand bounds a command (the peer's READY carries its socket
	// type and identity, a few dozen bytes).
	zmtpMaxCommand = 4 << 10
	// kvMaxMessage bounds one message. A batch is one engine step's
	// events: a 128k-token prefill stores 8k blocks of 16 tokens, about
	// 0.7 MB of msgpack; 16 MiB leaves room for many at once.
	kvMaxMessage = 16 << 20
	// kvMaxFrames is the frames of a message kept: three for an event
	// batch [topic, seq, payload], four for a replayed one from the llm-d
	// simulator [delimiter, topic, seq, payload]; further frames are read
	// and dropped.
	kvMaxFrames = 4
	// kvKeepBuffer is the largest message buffer kept for the next
	// message; a larger one is dropped once used.
	kvKeepBuffer = 1 << 20
)

// ZMTPConn is one ZMTP connection after its handshake, owned by one
// goroutine (Close, and SendWire while that goroutine reads, may be called
// from another).
type ZMTPConn struct {
	c      net.Conn
	r      *bufio.Reader
	w      []byte // the message being written
	buf    []byte // the message read, its frames back to back
	ends   [kvMaxFrames]int
	frames [kvMaxFrames][]byte
}

// OpenZMTP performs the ZMTP 3.0 NULL handshake on c as a socket of type
// self ("SUB", "DEALER", "PUB", "ROUTER"), accepting a peer of one of the
// types peers, within timeout. On error the caller still owns c; on
// success the ZMTPConn does (it reads c through a buffer of its own, so c
// is read only through it).
func OpenZMTP(c net.Conn, timeout time.Duration, self string, peers ...string) (*ZMTPConn, error) {
	if err := c.SetDeadline(time.Now().Add(timeout)); err != nil {
		return nil, err
	}
	z := &ZMTPConn{c: c, r: bufio.NewReaderSize(c, 64<<10)}
	// Our greeting (signature, version 3.0, NULL, not as-server), then our
	// READY at once: the peer reads them in order.
	var g [zmtpGreetingLen]byte
	g[0], g[9], g[10], g[11] = 0xff, 0x7f, 3, 0
	copy(g[12:32], "NULL")
	z.w = append(z.w[:0], g[:]...)
	z.w = appendReady(z.w, self)
	if _, err := c.Write(z.w); err != nil {
		return nil, err
	}
	peer, err := z.readHandshake()
	if err != nil {
		return nil, err
	}
	if !slices.Contains(peers, peer) {
		return nil, fmt.Errorf("%w: peer is a %q socket, want %s", errZMTP, peer, strings.Join(peers, " or "))
	}
	if err := c.SetDeadline(time.Time{}); err != nil {
		return nil, err
	}
	return z, nil
}

// appendReady appends a READY command announcing socket type t.
func appendReady(w []byte, t string) []byte {
	body := len("\x05READY") + 1 + len("Socket-Type") + 4 + len(t)
	w = append(w, zmtpCommand, byte(body)) // short: well under 256 bytes
	w = append(w, "\x05READY"...)
	w = append(w, byte(len("Socket-Type")))
	w = append(w, "Socket-Type"...)
	w = binary.BigEndian.AppendUint32(w, uint32(len(t)))
	return append(w, t...)
}

// readHandshake reads the peer's greeting and READY and returns its socket
// type.
func (z *ZMTPConn) readHandshake() (string, error) {
	var g [zmtpGreetingLen]byte
	if _, err := io.ReadFull(z.r, g[:]); err != nil {
		return "", err
	}
	switch {
	case g[0] != 0xff || g[9]&1 != 1:
		return "", fmt.Errorf("%w: not a ZeroMQ peer (signature % x)", errZMTP, g[:10])
	case g[10] < 3:
		return "", fmt.Errorf("%w: peer speaks ZMTP %d.%d, want 3", errZMTP, g[10], g[11])
	case string(bytes.TrimRight(g[12:32], "\x00")) != "NULL":
		return "", fmt.Errorf("%w: peer wants security mechanism %q, want NULL", errZMTP, bytes.TrimRight(g[12:32], "\x00"))
	}
	flags, size, err := z.header()
	if err != nil {
		return "", err
	}
	if flags != zmtpCommand && flags != zmtpCommand|zmtpLong || size > zmtpMaxCommand {
		return "", fmt.Errorf("%w: handshake frame with flags %#x and %d bytes, want a READY command", errZMTP, flags, size)
	}
	body := make([]byte, size)
	if _, err := io.ReadFull(z.r, body); err != nil {
		return "", err
	}
	if len(body) == 0 || 1+int(body[0]) > len(body) {
		return "", fmt.Errorf("%w: malformed command", errZMTP)
	}
	name, props := string(body[1:1+body[0]]), body[1+body[0]:]
	switch name {
	case "READY":
	case "ERROR":
		return "", fmt.Errorf("%w: peer refused the handshake: %q", errZMTP, props)
	default:
		return "", fmt.Errorf("%w: %q command in the handshake, want READY", errZMTP, name)
	}
	var peer string
	for len(props) > 0 {
		kl := int(props[0])
		if 1+kl+4 > len(props) {
			return "", fmt.Errorf("%w: truncated READY property", errZMTP)
		}
		k := props[1 : 1+kl]
		vl := binary.BigEndian.Uint32(props[1+kl:])
		props = props[1+kl+4:]
		if uint64(vl) > uint64(len(props)) {
			return "", fmt.Errorf("%w: truncated READY property", errZMTP)
		}
		if strings.EqualFold(string(k), "Socket-Type") {
			peer = string(props[:vl])
		}
		props = props[vl:]
	}
	return peer, nil
}

// header reads a frame header.
func (z *ZMTPConn) header() (flags byte, size uint64, err error) {
	if flags, err = z.r.ReadByte(); err != nil {
		return 0, 0, err
	}
	if flags&^(zmtpMore|zmtpLong|zmtpCommand) != 0 {
		return 0, 0, fmt.Errorf("%w: frame flags %#x", errZMTP, flags)
	}
	if flags&zmtpLong == 0 {
		b, err := z.r.ReadByte()
		return flags, uint64(b), err
	}
	var b [8]byte
	if _, err := io.ReadFull(z.r, b[:]); err != nil {
		return 0, 0, err
	}
	return flags, binary.BigEndian.Uint64(b[:]), nil
}

// ReadMsg reads the next message, skipping commands between messages
// (ZMTP 3.1 heartbeats, a SUB's SUBSCRIBE command, and the like). It
// returns the first kvMaxFrames (4) frames, valid until the next call, and
// the message's number of frames. A message over kvMaxMessage (16 MiB)
// bytes is an error: the connection cannot go on.
func (z *ZMTPConn) ReadMsg() (frames [][]byte, n int, err error) {
	if cap(z.buf) > kvKeepBuffer {
		z.buf = nil
	}
	z.buf = z.buf[:0]
	for {
		flags, size, err := z.header()
		if err != nil {
			return nil, 0, err
		}
		if flags&zmtpCommand != 0 {
			if n > 0 || flags&zmtpMore != 0 || size > zmtpMaxCommand {
				return nil, 0, fmt.Errorf("%w: command frame with flags %#x and %d bytes inside a message", errZMTP, flags, size)
			}
			if _, err := z.r.Discard(int(size)); err != nil {
				return nil, 0, err
			}
			continue
		}
		if size > uint64(kvMaxMessage-len(z.buf)) {
			return nil, 0, fmt.Errorf("%w: message over %d bytes", errZMTP, kvMaxMessage)
		}
		if n < kvMaxFrames {
			at := len(z.buf)
			z.buf = slices.Grow(z.buf, int(size))[:at+int(size)]
			if _, err := io.ReadFull(z.r, z.buf[at:]); err != nil {
				return nil, 0, err
			}
			z.ends[n] = len(z.buf)
		} else if _, err := z.r.Discard(int(size)); err != nil {
			return nil, 0, err
		}
		n++
		if flags&zmtpMore == 0 {
			break
		}
	}
	kept := min(n, kvMaxFrames)
	at := 0
	for i := range kept {
		z.frames[i] = z.buf[at:z.ends[i]:z.ends[i]]
		at = z.ends[i]
	}
	return z.frames[:kept], n, nil
}

// AppendZMTPMsg appends one message of the given frames to b, in wire
// form, and returns the extended slice.
func AppendZMTPMsg(b []byte, frames ...[]byte) []byte {
	for i, f := range frames {
		var flags byte
		if i < len(frames)-1 {
			flags = zmtpMore
		}
		if len(f) > 255 {
			b = append(b, flags|zmtpLong)
			b = binary.BigEndian.AppendUint64(b, uint64(len(f)))
		} else {
			b = append(b, flags, byte(len(f)))
		}
		b = append(b, f...)
	}
	return b
}

// Send writes one message of the given frames.
func (z *ZMTPConn) Send(frames ...[]byte) error {
	z.w = AppendZMTPMsg(z.w[:0], frames...)
	_, err := z.c.Write(z.w)
	return err
}

// SendWire writes msg, whole messages in wire form (AppendZMTPMsg's), as
// they are: a publisher encodes a message once for all its subscribers.
// It may be called while another goroutine reads, not with Send.
func (z *ZMTPConn) SendWire(msg []byte) error {
	_, err := z.c.Write(msg)
	return err
}

// Subscribe sends a SUB's subscription to topic (a prefix; "" for all),
// as a message: ZMTP 3.0's form, which every later peer accepts.
func (z *ZMTPConn) Subscribe(topic string) error {
	return z.Send(append([]byte{1}, topic...))
}

// Close closes the connection; safe from any goroutine.
func (z *ZMTPConn) Close() error { return z.c.Close() }
