package discovery

import "testing"

func TestLeaseAddPrefill(t *testing.T) {
	e, err := NewEndpoint("10.0.0.1:8000", RoleDecode)
	if err != nil {
		t.Fatal(err)
	}
	l := e.Acquire(0)
	l.AddPrefill(300)
	if got := e.PendingPrefill(); got != 300 {
		t.Fatalf("pending %d after AddPrefill(300)", got)
	}
	l.FirstByte(false)
	l.AddPrefill(50) // after the first byte: nothing left to compute
	if got := e.PendingPrefill(); got != 0 {
		t.Fatalf("pending %d after the first byte", got)
	}
	l.Release()
	if e.InFlight() != 0 || e.PendingPrefill() != 0 {
		t.Fatalf("in flight %d, pending %d after release", e.InFlight(), e.PendingPrefill())
	}
}
