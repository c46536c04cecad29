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
	// Samples are the one-second readings, in order.
	Samples []CPUWindow `json:"samples,omitempty"`
}

// CPUWindow is one second of a run.
type CPUWindow struct {
	// At is the window's end, in wall seconds from the start of the run.
	At float64 `json:"t"`
	// Idle is the machine's idle fraction; Process this process's cores.
	Idle    float64 `json:"idle"`
	Process float64 `json:"process"`
}

// cpuSample is a reading of the machine's and the process's CPU counters.
type cpuSample struct {
	at          time.Time
	idle, total float64 // machine jiffies (idle includes iowait)
	proc        float64 // process CPU seconds
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
			w := CPUWindow{At: cur.at.Sub(s.first.at).Seconds(), Idle: idle, Process: -1}
			if wall := cur.at.Sub(prev.at).Seconds(); wall > 0 && cur.proc >= 0 && prev.proc >= 0 {
				w.Process = (cur.proc - prev.proc) / wall
			}
			s.mu.Lock()
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
	st := CPUStats{Cores: runtime.NumCPU(), MachineIdle: -1, MachineIdleMin: -1, ProcessCores: -1, Samples: s.samples}
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

func idleBetween(a, b cpuSample) (float64, bool) {
	if !a.ok || !b.ok || b.total <= a.total {
		return 0, false
	}
	return (b.idle - a.idle) / (b.total - a.total), true
}
