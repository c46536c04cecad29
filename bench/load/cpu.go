package load

import (
	"runtime"
	"sync"
	"time"
)

// CPUStats describe how busy the machine and this process were during a
// run. On a shared machine, results mean little when MachineIdle nears 0:
// then the run measured the CPU, not the policy.
type CPUStats struct {
	// Cores is the number of logical CPUs.
	Cores int `json:"cores"`
	// MachineIdle is the fraction of all cores' time spent idle over the
	// run (/proc/stat); −1 where unknown.
	MachineIdle float64 `json:"machine_idle"`
	// MachineIdleMin is the lowest idle fraction over one-second windows.
	MachineIdleMin float64 `json:"machine_idle_min"`
	// ProcessCores is this process's CPU time ÷ wall time (1.5 = one and
	// a half cores busy); −1 where unknown.
	ProcessCores float64 `json:"process_cores"`
	// Outside is the cores busy with processes other than this one and
	// those it started (engines and their children), over the run: another
	// job on the machine, which the run then measured too; −1 where
	// unknown. OutsideMax is its highest one-second window.
	Outside    float64 `json:"outside_cores"`
	OutsideMax float64 `json:"outside_cores_max"`
	// Samples are the one-second readings, in order.
	Samples []CPUWindow `json:"samples,omitempty"`
}

// CPUWindow is one second of a run.
type CPUWindow struct {
	// At is the window's end, in wall seconds from the start of the run.
	At float64 `json:"t"`
	// Idle is the machine's idle fraction; Process this process's cores;
	// Outside the cores of processes outside the benchmark (−1: unknown).
	Idle    float64 `json:"idle"`
	Process float64 `json:"process"`
	Outside float64 `json:"outside"`
}

// cpuSample is a reading of the machine's and the process's CPU counters.
type cpuSample struct {
	at          time.Time
	idle, total float64 // machine jiffies (idle includes iowait)
	proc        float64 // process CPU seconds
	tree        float64 // jiffies of this process and its descendants; −1: unknown
	ok          bool
}

// cpuSampler samples once a second while a run lasts.
type cpuSampler struct {
	first   cpuSample
	stop    chan struct{}
	done    chan struct{}
	mu      sync.Mutex
	minIdle float64
	samples []CPUWindow
	// outside sums the windows whose outside share is known: their
	// jiffies outside the benchmark and all jiffies.
	outside, outsideTotal, outsideMax float64
}

// startCPU takes a first sample and starts sampling every second.
func startCPU() *cpuSampler {
	s := &cpuSampler{first: readCPU(), stop: make(chan struct{}), done: make(chan struct{}), minIdle: -1}
	go s.loop()
	return s
}

func (s *cpuSampler) loop() {
	defer close(s.done)
	t := time.NewTicker(time.Second)
	defer t.Stop()
	prev := s.first
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
		cur := readCPU()
		if idle, ok := idleBetween(prev, cur); ok {
			w := CPUWindow{At: cur.at.Sub(s.first.at).Seconds(), Idle: idle, Process: -1, Outside: -1}
			if wall := cur.at.Sub(prev.at).Seconds(); wall > 0 && cur.proc >= 0 && prev.proc >= 0 {
				w.Process = (cur.proc - prev.proc) / wall
			}
			s.mu.Lock()
			if out, ok := outsideBetween(prev, cur); ok {
				w.Outside = out / (cur.total - prev.total) * float64(runtime.NumCPU())
				s.outside += out
				s.outsideTotal += cur.total - prev.total
				s.outsideMax = max(s.outsideMax, w.Outside)
			}
			if s.minIdle < 0 || idle < s.minIdle {
				s.minIdle = idle
			}
			s.samples = append(s.samples, w)
			s.mu.Unlock()
		}
		prev = cur
	}
}

// finish stops sampling and returns the run's figures.
func (s *cpuSampler) finish() CPUStats {
	close(s.stop)
	<-s.done
	last := readCPU()
	st := CPUStats{Cores: runtime.NumCPU(), MachineIdle: -1, MachineIdleMin: -1, ProcessCores: -1, Outside: -1, OutsideMax: -1, Samples: s.samples}
	if s.outsideTotal > 0 {
		st.Outside, st.OutsideMax = s.outside/s.outsideTotal*float64(st.Cores), s.outsideMax
	}
	if idle, ok := idleBetween(s.first, last); ok {
		st.MachineIdle = idle
		st.MachineIdleMin = idle
		if s.minIdle >= 0 {
			st.MachineIdleMin = min(idle, s.minIdle)
		}
	}
	if s.first.ok && last.ok {
		if wall := last.at.Sub(s.first.at).Seconds(); wall > 0 && last.proc >= 0 {
			st.ProcessCores = (last.proc - s.first.proc) / wall
		}
	}
	return st
}

// outsideBetween returns the jiffies between a and b that the machine
// spent busy outside this process and its descendants; not ok where
// unknown, or where a descendant ended between them (its time left the
// sum).
func outsideBetween(a, b cpuSample) (float64, bool) {
	if !a.ok || !b.ok || a.tree < 0 || b.tree < a.tree || b.total <= a.total {
		return 0, false
	}
	busy := (b.total - b.idle) - (a.total - a.idle)
	return max(0, busy-(b.tree-a.tree)), true
}

func idleBetween(a, b cpuSample) (float64, bool) {
	if !a.ok || !b.ok || b.total <= a.total {
		return 0, false
	}
	return (b.idle - a.idle) / (b.total - a.total), true
}
