package soak

import (
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvroute/kvroute/bench/sim"
)

// Fault names, in the order the schedule rotates through them.
const (
	Fault5xx        = "5xx-storm"
	Fault429        = "429-storm"
	FaultStallFirst = "stall-first-byte"
	FaultStallMid   = "stall-mid-stream"
	FaultDrop       = "drop-mid-stream"
	FaultKill       = "pod-kill"
)

// FaultNames returns the faults in schedule order.
func FaultNames() []string {
	return []string{Fault5xx, Fault429, FaultStallFirst, FaultStallMid, FaultDrop, FaultKill}
}

// Fault settings: each hits one pod, and only part of its requests, so
// that most requests of the run succeed.
const (
	stormRate       = 0.3                    // share of the pod's requests failed in a 5xx storm
	stormStatusA    = 500                    // passed on to the client as is
	stormStatusB    = 503                    // every other storm: retried elsewhere by kvroute
	rate429         = 0.5                    // share of the pod's requests answered 429 (retried)
	stallFirstByte  = 2 * time.Second        // before the first byte
	stallMidOn      = 2 * time.Second        // a mid-stream stall, repeated while the fault lasts
	stallMidOff     = 1 * time.Second        // between two mid-stream stalls
	dropAfterTokens = 16                     // streamed tokens before the pod drops the connection
	restartGrace    = 200 * time.Millisecond // before a killed pod's port is reused
	minFaultPeriod  = 3 * time.Second
	maxFaultPeriod  = 10 * time.Second
)

// FaultPeriod is how long each fault lasts, and the calm after it, for a
// run of length d: d/60 within [3 s, 10 s], so a 10-minute run goes through
// the six faults five times and a one-minute run once.
func FaultPeriod(d time.Duration) time.Duration {
	return min(max(d/60, minFaultPeriod), maxFaultPeriod)
}

// FaultEvent is one fault switched on or off.
type FaultEvent struct {
	At    float64 `json:"t_s"` // seconds since the load began
	Pod   int     `json:"pod"`
	Fault string  `json:"fault"`
	On    bool    `json:"on"`
}

// faulter rotates the faults over the pods: fault k of the schedule hits
// pod (k + k/6) mod pods for one period, then a calm period follows.
type faulter struct {
	pods   *podSet
	period time.Duration
	start  time.Time

	active atomic.Pointer[string] // the fault on now, for the samples

	mu     sync.Mutex
	events []FaultEvent
	errs   []error // restarts that failed
}

func newFaulter(pods *podSet, period time.Duration, start time.Time) *faulter {
	return &faulter{pods: pods, period: period, start: start}
}

// current names the fault on now ("" for none).
func (f *faulter) current() string {
	if p := f.active.Load(); p != nil {
		return *p
	}
	return ""
}

func (f *faulter) log(pod int, name string, on bool) {
	f.mu.Lock()
	f.events = append(f.events, FaultEvent{At: time.Since(f.start).Seconds(), Pod: pod, Fault: name, On: on})
	f.mu.Unlock()
	if on {
		label := name + "@pod" + strconv.Itoa(pod)
		f.active.Store(&label)
	} else {
		f.active.Store(nil)
	}
}

func (f *faulter) eventsCopy() []FaultEvent {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]FaultEvent(nil), f.events...)
}

// run applies the schedule until stop is closed, then clears the fault on
// and restarts a killed pod before returning.
func (f *faulter) run(stop <-chan struct{}) {
	names := FaultNames()
	n := len(f.pods.slots)
	wait := func(d time.Duration) bool {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
			return true
		case <-stop:
			return false
		}
	}
	for k := 0; ; k++ {
		// A calm period first: the warm-up starts clean, and every fault
		// is followed by one.
		if !wait(f.period) {
			return
		}
		name := names[k%len(names)]
		sl := f.pods.slots[(k+k/len(names))%n]
		f.log(sl.i, name, true)
		undo := f.apply(sl, name, k, stop)
		wait(f.period)
		undo()
		f.log(sl.i, name, false)
		select {
		case <-stop:
			return
		default:
		}
	}
}

// apply switches fault name on at sl and returns what switches it off.
func (f *faulter) apply(sl *slot, name string, k int, stop <-chan struct{}) (undo func()) {
	off := func() { sl.setFaults(sim.Faults{}) }
	switch name {
	case Fault5xx:
		status := stormStatusA
		if (k/len(FaultNames()))%2 == 1 {
			status = stormStatusB
		}
		sl.setFaults(sim.Faults{ErrorRate: stormRate, ErrorStatus: status})
	case Fault429:
		sl.setFaults(sim.Faults{ErrorRate: rate429, ErrorStatus: 429})
	case FaultStallFirst:
		sl.setFaults(sim.Faults{StallFirstByte: sim.Duration(stallFirstByte)})
	case FaultDrop:
		sl.setFaults(sim.Faults{DropAfterTokens: dropAfterTokens})
	case FaultStallMid:
		quit := make(chan struct{})
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				release := sl.stallMidStream()
				t := time.NewTimer(stallMidOn)
				select {
				case <-t.C:
				case <-quit:
				case <-stop:
				}
				t.Stop()
				release()
				t = time.NewTimer(stallMidOff)
				select {
				case <-t.C:
					continue
				case <-quit:
				case <-stop:
				}
				t.Stop()
				return
			}
		}()
		var once sync.Once
		return func() { once.Do(func() { close(quit) }); <-done }
	case FaultKill:
		sl.kill()
		return func() {
			time.Sleep(restartGrace)
			if err := sl.restart(); err != nil {
				f.mu.Lock()
				f.errs = append(f.errs, fmt.Errorf("restart pod %d: %w", sl.i, err))
				f.mu.Unlock()
			}
		}
	}
	return off
}
