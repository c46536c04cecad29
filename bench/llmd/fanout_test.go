package llmd

import (
	"net"
	"slices"
	"testing"
	"time"

	"github.com/kvroute/kvroute/kvevents"
)

// A publisher dialing a Fanout reaches every subscriber added, each
// message whole and in order (after the first the subscribers connected
// on: the earlier ones are not kept).
func TestFanoutReachesEverySubscriber(t *testing.T) {
	lnA, lnB := listen(t), listen(t)
	f, err := StartFanout("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	f.Add(lnA.Addr().String())
	f.Add(lnB.Addr().String())
	got := make(chan [][]byte, 64)
	for _, ln := range []net.Listener{lnA, lnB} {
		go subscribe(ln, got)
	}
	c, err := net.Dial("tcp", f.ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	pub, err := kvevents.OpenZMTP(c, time.Second, "PUB", "SUB")
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	deadline := time.After(10 * time.Second)
	for seq := 0; seen["last"] < 2; seq++ {
		frames := [][]byte{[]byte("kv@127.0.0.1:8000@m"), {byte(seq)}, []byte("payload")}
		if seq == 50 {
			frames[2] = []byte("last")
		}
		if err := pub.Send(frames...); err != nil {
			t.Fatal(err)
		}
		for drained := false; !drained; {
			select {
			case m := <-got:
				if len(m) != 3 || string(m[0]) != "kv@127.0.0.1:8000@m" {
					t.Fatalf("message %q", m)
				}
				seen[string(m[2])]++
			case <-deadline:
				t.Fatalf("timed out: %v", seen)
			case <-time.After(5 * time.Millisecond):
				drained = true
			}
		}
		if seq > 50 && seen["last"] < 2 {
			t.Fatalf("after the last message: %v (each subscriber should have it)", seen)
		}
	}
}

func listen(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// subscribe accepts one publisher on ln, as kvroute's --kv-events-listen
// does, and sends each message's frames to got.
func subscribe(ln net.Listener, got chan<- [][]byte) {
	c, err := ln.Accept()
	if err != nil {
		return
	}
	defer c.Close()
	z, err := kvevents.OpenZMTP(c, time.Second, "SUB", "PUB")
	if err != nil || z.Subscribe("") != nil {
		return
	}
	for {
		frames, n, err := z.ReadMsg()
		if err != nil {
			return
		}
		m := make([][]byte, 0, n)
		for _, f := range frames[:min(n, len(frames))] {
			m = append(m, slices.Clone(f))
		}
		got <- m
	}
}
