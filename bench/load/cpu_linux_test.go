package load

import (
	"os"
	"os/exec"
	"testing"
	"time"
)

// The process tree's CPU time includes a child's: a busy child's time
// shows in its parent's tree, and an unknown process has none.
func TestTreeJiffiesCountsChildren(t *testing.T) {
	self := os.Getpid()
	if treeJiffies(self) < 0 {
		t.Skip("no /proc here")
	}
	if got := treeJiffies(1 << 30); got != -1 {
		t.Fatalf("a process that does not exist: %v, want -1", got)
	}
	cmd := exec.Command("sh", "-c", "while :; do :; done")
	if err := cmd.Start(); err != nil {
		t.Skipf("no sh: %v", err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	deadline := time.Now().Add(20 * time.Second)
	for {
		child := treeJiffies(cmd.Process.Pid) // read first: the tree, read after, holds at least as much
		if tree := treeJiffies(self); child >= 10 {
			if tree < child {
				t.Fatalf("tree %v jiffies, less than its child's %v", tree, child)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("a busy child ran %v jiffies in 20 s", child)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
