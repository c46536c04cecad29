package discovery

import (
	"testing"
	"time"
)

// A peer's placement counts as prefill on the endpoint until its deadline,
// and no longer; the count is bounded.
func TestPeerPrefillExpires(t *testing.T) {
	e, err := NewEndpoint("http://10.0.0.1:8000", RoleMixed)
	if err != nil {
		t.Fatal(err)
	}
	if n := e.PeerPrefill(); n != 0 {
		t.Fatalf("nothing placed: %d", n)
	}
	now := time.Now()
	e.AddPeerPrefill(500, now.Add(time.Hour))
	e.AddPeerPrefill(300, now.Add(-time.Millisecond)) // computed already
	e.AddPeerPrefill(0, now.Add(time.Hour))           // nothing to compute
	if n := e.PeerPrefill(); n != 500 {
		t.Fatalf("counted %d, want the 500 still due", n)
	}
	for range maxPeerPending + 10 {
		e.AddPeerPrefill(1, now.Add(time.Hour))
	}
	if n, items := e.PeerPrefill(), len(e.peerPrefill.items); items != maxPeerPending || n != maxPeerPending {
		t.Fatalf("%d placements counting %d tokens, want the latest %d", items, n, maxPeerPending)
	}
}
