package load

import (
	"bytes"
	"os"
	"strconv"
	"syscall"
	"time"
)

// readCPU reads the machine's aggregate CPU line of /proc/stat, this
// process's rusage and the jiffies of its process tree.
func readCPU() cpuSample {
	s := cpuSample{at: time.Now(), proc: -1, tree: treeJiffies(os.Getpid())}
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

// treeJiffies returns the CPU time, in /proc/stat's units, of process root
// and every live descendant, from each process's /proc/PID/stat; −1 when
// /proc cannot be read.
func treeJiffies(root int) float64 {
	dir, err := os.ReadDir("/proc")
	if err != nil {
		return -1
	}
	type proc struct{ ppid, jiffies int }
	procs := make(map[int]proc, len(dir))
	for _, d := range dir {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + d.Name() + "/stat")
		if err != nil {
			continue // it ended meanwhile
		}
		// pid (comm) state ppid ... utime stime: comm may hold anything but
		// ends at the last ')'.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := bytes.Fields(b[i+1:])
		if len(f) < 13 {
			continue
		}
		ppid, _ := strconv.Atoi(string(f[1]))
		ut, _ := strconv.Atoi(string(f[11]))
		st, _ := strconv.Atoi(string(f[12]))
		procs[pid] = proc{ppid: ppid, jiffies: ut + st}
	}
	if _, ok := procs[root]; !ok {
		return -1
	}
	sum := 0
	for pid, p := range procs {
		for q, n := pid, 0; n < 64; n++ { // walk up to root or init
			if q == root {
				sum += p.jiffies
				break
			}
			up, ok := procs[q]
			if !ok || q <= 1 {
				break
			}
			q = up.ppid
		}
	}
	return float64(sum)
}
