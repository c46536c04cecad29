package proxy

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/textproto"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/discovery"
)

// scriptedSSE is an endpoint on loopback that answers one request with a
// chunked event stream, one chunk per event, written in the steps it is
// sent: each step in one write to the socket.
type scriptedSSE struct {
	addr  string
	steps chan []string // the events of one write; close to end the stream
}

func startScriptedSSE(t *testing.T) *scriptedSSE {
	t.Helper()
	e := &scriptedSSE{steps: make(chan []string, 4)}
	raw := startRawEndpoint(t, func(c net.Conn, _ []byte) {
		sseHead(c)
		for step := range e.steps {
			var b bytes.Buffer
			for _, ev := range step {
				fmt.Fprintf(&b, "%x\r\n%s\r\n", len(ev), ev)
			}
			if _, err := c.Write(b.Bytes()); err != nil {
				return
			}
		}
		_, _ = io.WriteString(c, "0\r\n\r\n")
	})
	e.addr = strings.TrimPrefix(raw.url, "http://")
	return e
}

// readChunk reads one chunk of a chunked body.
func readChunk(t *testing.T, r *bufio.Reader) string {
	t.Helper()
	line, err := r.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.ParseUint(strings.TrimSpace(line), 16, 32)
	if err != nil {
		t.Fatalf("chunk size %q: %v", line, err)
	}
	b := make([]byte, n+2)
	if _, err := io.ReadFull(r, b); err != nil {
		t.Fatal(err)
	}
	return string(b[:n])
}

// Events that arrived together leave in one write (one chunk to the
// client); an event that arrived alone leaves at once, before the
// endpoint sends anything more.
func TestStreamWritesWhatArrivedAtOnce(t *testing.T) {
	e := startScriptedSSE(t)
	h := startProxy(t, nil, Options{}, "http://"+e.addr)
	c, err := net.Dial("tcp", strings.TrimPrefix(h.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(30 * time.Second)) // a held-back event fails here rather than hanging
	body := `{"model":"m","prompt":"hi","stream":true}`
	fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: kvroute\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	r := bufio.NewReader(c)
	tp := textproto.NewReader(r)
	if status, err := tp.ReadLine(); err != nil || !strings.Contains(status, " 200 ") {
		t.Fatalf("status line %q: %v", status, err)
	}
	if _, err := tp.ReadMIMEHeader(); err != nil {
		t.Fatal(err)
	}
	event := func(i int) string { return fmt.Sprintf("data: {\"choices\":[{\"text\":\"t%d\"}]}\n\n", i) }

	e.steps <- []string{event(0)}
	if got := readChunk(t, r); got != event(0) {
		t.Fatalf("first chunk %q, want the first event alone", got)
	}
	var batch []string
	want := ""
	for i := 1; i <= 20; i++ {
		batch = append(batch, event(i))
		want += event(i)
	}
	e.steps <- batch
	got, chunks := "", 0
	for got != want && len(got) < len(want) {
		got += readChunk(t, r)
		chunks++
	}
	if got != want {
		t.Fatalf("the batch arrived as %q", got)
	}
	if chunks != 1 {
		t.Errorf("20 events that arrived in one write left in %d writes, want 1", chunks)
	}
	e.steps <- []string{event(21)}
	if got := readChunk(t, r); got != event(21) {
		t.Fatalf("chunk %q, want the last event alone", got)
	}
	close(e.steps)
	if last := readChunk(t, r); last != "" {
		t.Fatalf("after the end: %q", last)
	}
}

// An endpoint is taken not to report cached tokens only once an answer of
// its carried a usage report without them; answers without any usage (a
// client that did not ask for it) say nothing of the engine.
func TestSilentCache(t *testing.T) {
	s := &Server{}
	ep, err := discovery.NewEndpoint("http://127.0.0.1:1", discovery.RoleMixed)
	if err != nil {
		t.Fatal(err)
	}
	if s.silentCache(ep, false) {
		t.Fatal("silent before any usage report")
	}
	if !s.silentCache(ep, true) || !s.silentCache(ep, false) {
		t.Fatal("a usage report without cached tokens was not remembered")
	}
}
