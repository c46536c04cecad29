//go:build !linux

package soak

import "os/exec"

// setParentDeath has no portable equivalent: a kvsoak killed first leaves
// kvroute running.
func setParentDeath(*exec.Cmd) {}

// selfCPU is unknown here.
func selfCPU() float64 { return -1 }
