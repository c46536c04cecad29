package proc

import (
	"context"
	"errors"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// A server's children go with it: Stop signals the whole process group.
func TestStopKillsGroup(t *testing.T) {
	// The shell ignores SIGTERM and its child does not: the group is
	// killed after the grace.
	p, err := Start("http://127.0.0.1:1", exec.Command("sh", "-c", "trap '' TERM; echo trapped; sleep 60 & wait"))
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(p.Output(), "trapped"); {
		if time.Now().After(deadline) {
			t.Fatal("the shell never set its trap")
		}
		time.Sleep(5 * time.Millisecond) // the output has no channel to wait on
	}
	if err := p.Stop(200 * time.Millisecond); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Errorf("Stop = %v, want a kill after the grace", err)
	}
	if p.Lingering(5 * time.Second) {
		t.Errorf("process group %d still there", p.Pid())
	}
	if err := p.Stop(time.Second); err != nil { // again: nothing left
		t.Errorf("second Stop = %v", err)
	}
}

// WaitReady reports a server that exits before it is ready, with its
// output.
func TestWaitReadyExited(t *testing.T) {
	port, err := FreePort()
	if err != nil {
		t.Fatal(err)
	}
	p, err := Start("http://127.0.0.1:"+strconv.Itoa(port), exec.Command("sh", "-c", "echo bad flag; exit 2"))
	if err != nil {
		t.Fatal(err)
	}
	err = p.WaitReady(context.Background(), "/health", 10*time.Second)
	if !errors.Is(err, ErrStart) || !strings.Contains(err.Error(), "bad flag") {
		t.Errorf("WaitReady = %v, want ErrStart with the output", err)
	}
}

// Ports taken one after another before any is bound are distinct: a port
// free again after FreePort's check does not come up twice.
func TestFreePortsDistinct(t *testing.T) {
	seen := make(map[int]bool)
	for range 500 {
		port, err := FreePort()
		if err != nil {
			t.Fatal(err)
		}
		if seen[port] {
			t.Fatalf("port %d handed out twice", port)
		}
		seen[port] = true
	}
}
