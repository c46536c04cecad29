package load

import (
	"bytes"
	"os"
	"strconv"
	"syscall"
	"time"
)

// readCPU reads the machine's aggregate CPU line of /proc/stat and this
// process's rusage.
func readCPU() cpuSample {
	s := cpuSample{at: time.Now(), proc: -1}
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) == nil {
		s.proc = time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
	}
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return s
	}
	line, _, _ := bytes.Cut(b, []byte("\n"))
	f := bytes.Fields(line)
	if len(f) < 5 || string(f[0]) != "cpu" {
		return s
	}
	// user nice system idle iowait irq softirq steal (guest time is already
	// counted in user).
	for i, v := range f[1:min(len(f), 9)] {
		n, err := strconv.ParseFloat(string(v), 64)
		if err != nil {
			return s
		}
		s.total += n
		if i == 3 || i == 4 {
			s.idle += n
		}
	}
	s.ok = true
	return s
}
