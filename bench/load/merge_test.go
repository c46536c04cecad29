package load

import (
	"errors"
	"testing"
)

// Merge pools rounds: requests in order with later rounds' times shifted
// past earlier rounds' ends, throughput over the summed durations, engine
// counters summed (dropped, with a note, when a round has none), CPU
// figures weighted by wall time.
func TestMerge(t *testing.T) {
	round := func(ttfts []float64, wall, idle float64, eng *EngineStats) *Result {
		r := &Result{Label: "p", WallSeconds: wall, IdealHitRate: 0.5, Engine: eng,
			CPU: CPUStats{Cores: 2, MachineIdle: idle, MachineIdleMin: idle / 2, ProcessCores: -1}}
		for i, v := range ttfts {
			r.Requests = append(r.Requests, RequestResult{Start: float64(i), TTFT: v, E2EL: 0.5, OutputTokens: 4, PromptTokens: 10})
		}
		r.Summary = Summarize(r.Requests, SLO{}, wall)
		return r
	}
	a := round([]float64{0.1, 0.2}, 10, 0.8, &EngineStats{PrefixQueries: 10, PrefixHits: 5})
	b := round([]float64{0.3, 0.4}, 30, 0.4, &EngineStats{PrefixQueries: 30, PrefixHits: 25})
	m, err := Merge([]*Result{a, b}, SLO{})
	if err != nil {
		t.Fatal(err)
	}
	s := m.Summary
	if s.Completed != 4 || s.Duration != 40 || s.RequestThroughput != 0.1 || m.WallSeconds != 40 {
		t.Fatalf("summary %+v, wall %v", s, m.WallSeconds)
	}
	if got := s.TTFT.Mean; got < 249.9 || got > 250.1 {
		t.Errorf("TTFT mean %v ms, want 250", got)
	}
	if m.Requests[2].Start != 1.5 || m.Requests[3].Start != 2.5 || a.Requests[0].Start != 0 {
		t.Errorf("starts %v %v (round a's first now %v)", m.Requests[2].Start, m.Requests[3].Start, a.Requests[0].Start)
	}
	if m.Engine == nil || m.Engine.HitRate != 0.75 || m.EngineErr != "" {
		t.Errorf("engine %+v (%s)", m.Engine, m.EngineErr)
	}
	if m.CPU.MachineIdle != 0.5 || m.CPU.MachineIdleMin != 0.2 || m.CPU.ProcessCores != -1 || m.IdealHitRate != 0.5 {
		t.Errorf("cpu %+v, ideal %v", m.CPU, m.IdealHitRate)
	}
	b.Engine = nil
	if m, _ = Merge([]*Result{a, b}, SLO{}); m.Engine != nil || m.EngineErr == "" {
		t.Errorf("a round without engine figures: %+v (%q)", m.Engine, m.EngineErr)
	}
	a.Engine = nil
	if m, _ = Merge([]*Result{a, b}, SLO{}); m.Engine != nil || m.EngineErr != "" {
		t.Errorf("no round with engine figures: %+v (%q)", m.Engine, m.EngineErr)
	}
	if only, _ := Merge([]*Result{a}, SLO{}); only != a {
		t.Error("one round is not returned as it is")
	}
	a.Stages = []StageResult{{}}
	if _, err := Merge([]*Result{a, b}, SLO{}); !errors.Is(err, ErrConfig) {
		t.Errorf("staged runs pooled: %v", err)
	}
}
