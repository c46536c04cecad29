package soak

import (
	"os/exec"
	"syscall"
)

// setParentDeath makes the kernel kill kvroute if kvsoak dies first, and
// puts kvroute in its own process group, so that a Ctrl-C at the terminal
// reaches kvsoak only and kvsoak ends kvroute (SIGTERM) as a run does.
func setParentDeath(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
}

// selfCPU returns this process's CPU seconds so far.
func selfCPU() float64 {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return -1
	}
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}
