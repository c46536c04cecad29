package sim

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"
)

// Faults makes a pod misbehave for tests. The zero value injects nothing.
// Durations are wall time (not scaled). JSON uses the snake_case names below
// with durations as Go duration strings ("250ms") or numbers of milliseconds;
// it is the body of POST /sim/faults and the answer of GET /sim/faults.
type Faults struct {
	// ErrorRate is the fraction in [0,1] of inference requests answered with
	// ErrorStatus before any work, drawn from a generator seeded by Config.Seed.
	ErrorRate float64 `json:"error_rate"`
	// ErrorStatus is the status of injected failures; default 500.
	ErrorStatus int `json:"error_status"`
	// StallFirstByte delays every inference request before it is queued
	// (so before the first byte of the response).
	StallFirstByte Duration `json:"stall_first_byte"`
	// StallUntilRelease holds every inference request before it is queued
	// until POST /sim/release (or Pod.ReleaseStalls) or the pod closes. The
	// release latches: later requests pass until the fault is set again.
	StallUntilRelease bool `json:"stall_until_release"`
	// DropAfterTokens closes the connection of a streaming response after
	// this many tokens were sent, without the terminating chunk; 0 = off.
	DropAfterTokens int `json:"drop_after_tokens"`
	// StartupDelay makes /health answer 503 (and inference 503) for this long
	// after Serve starts, like an engine still loading weights. Only the value
	// in Config counts; changing it later has no effect.
	StartupDelay Duration `json:"startup_delay"`
	// HealthFail makes /health answer 503 while set.
	HealthFail bool `json:"health_fail"`
}

func (f *Faults) validate() error {
	switch {
	case f.ErrorRate < 0 || f.ErrorRate > 1:
		return fmt.Errorf("%w: error rate %v outside [0,1]", ErrConfig, f.ErrorRate)
	case f.ErrorStatus != 0 && (f.ErrorStatus < 400 || f.ErrorStatus > 599):
		return fmt.Errorf("%w: error status %d is not 4xx/5xx", ErrConfig, f.ErrorStatus)
	case f.StallFirstByte < 0 || f.StartupDelay < 0 || f.DropAfterTokens < 0:
		return fmt.Errorf("%w: fault durations and counts must not be negative", ErrConfig)
	}
	return nil
}

// Duration is a time.Duration that marshals to JSON as a Go duration string
// and unmarshals from a string or a number of milliseconds.
type Duration time.Duration

// MarshalJSON implements json.Marshaler.
func (d Duration) MarshalJSON() ([]byte, error) {
	return json.Marshal(time.Duration(d).String())
}

// UnmarshalJSON implements json.Unmarshaler.
func (d *Duration) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		v, err := time.ParseDuration(s)
		if err != nil {
			return err
		}
		*d = Duration(v)
		return nil
	}
	ms, err := strconv.ParseFloat(string(b), 64)
	if err != nil {
		return fmt.Errorf("duration must be a string or milliseconds: %w", err)
	}
	*d = Duration(ms * float64(time.Millisecond))
	return nil
}

// faultState is the live fault set of a pod. Safe for concurrent use.
type faultState struct {
	mu       sync.Mutex
	f        Faults
	rng      *rand.Rand
	gate     chan struct{} // closed by releaseStalls
	released bool          // gate is closed
}

func newFaultState(f Faults, seed uint64) *faultState {
	return &faultState{f: f, rng: rand.New(rand.NewPCG(seed, 0x6b7673696d)), gate: make(chan struct{})}
}

func (s *faultState) get() Faults {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.f
}

// set replaces the faults; setting StallUntilRelease arms a new gate.
func (s *faultState) set(f Faults) {
	if f.ErrorStatus == 0 {
		f.ErrorStatus = 500
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	f.StartupDelay = s.f.StartupDelay
	if f.StallUntilRelease && (!s.f.StallUntilRelease || s.released) {
		s.gate, s.released = make(chan struct{}), false
	}
	s.f = f
}

// draw decides the fate of one inference request: the injected error status
// (0 = none), the stall duration and the channel whose closing ends a stall
// (nil = no indefinite stall).
func (s *faultState) draw() (status int, stall time.Duration, until <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.f.ErrorRate > 0 && s.rng.Float64() < s.f.ErrorRate {
		status = s.f.ErrorStatus
	}
	if s.f.StallUntilRelease {
		until = s.gate
	}
	return status, time.Duration(s.f.StallFirstByte), until
}

// releaseStalls opens the gate: stalled requests proceed, and so do new ones
// until StallUntilRelease is set again.
func (s *faultState) releaseStalls() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.released {
		close(s.gate)
		s.released = true
	}
}
