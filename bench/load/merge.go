package load

import "fmt"

// Merge pools runs of the same label made one after another (rounds of
// one policy, each with its own seed) into one result: their requests in
// order, each round's times shifted past the previous rounds' ends, the
// summary over all of them (throughputs over the sum of the rounds'
// durations), engine counters summed and CPU figures weighted by wall
// time. Runs with several load stages cannot be pooled.
func Merge(runs []*Result, slo SLO) (*Result, error) {
	if len(runs) == 0 {
		return nil, fmt.Errorf("%w: nothing to merge", ErrConfig)
	}
	if len(runs) == 1 {
		return runs[0], nil
	}
	first := runs[0]
	out := &Result{Label: first.Label, Target: first.Target, API: first.API, Started: first.Started, TimeScale: first.TimeScale,
		CPU: CPUStats{Cores: first.CPU.Cores, MachineIdle: -1, MachineIdleMin: -1, ProcessCores: -1, Outside: -1, OutsideMax: -1}}
	var offset, wallOffset, duration, ideal float64
	var idle, proc, outside cpuSum
	for _, r := range runs {
		if len(r.Stages) > 0 {
			return nil, fmt.Errorf("%w: %s: runs with load stages cannot be pooled", ErrConfig, r.Label)
		}
		end := 0.0
		for _, q := range r.Requests {
			end = max(end, q.Start+q.E2EL)
			q.Start += offset
			out.Requests = append(out.Requests, q)
		}
		for _, w := range r.CPU.Samples {
			w.At += wallOffset
			out.CPU.Samples = append(out.CPU.Samples, w)
		}
		ideal += r.IdealHitRate * float64(len(r.Requests))
		duration += r.Summary.Duration
		offset += end
		wallOffset += r.WallSeconds
		out.WallSeconds += r.WallSeconds
		idle.add(r.CPU.MachineIdle, r.WallSeconds)
		proc.add(r.CPU.ProcessCores, r.WallSeconds)
		outside.add(r.CPU.Outside, r.WallSeconds)
		out.CPU.OutsideMax = max(out.CPU.OutsideMax, r.CPU.OutsideMax)
		if r.CPU.MachineIdleMin >= 0 && (out.CPU.MachineIdleMin < 0 || r.CPU.MachineIdleMin < out.CPU.MachineIdleMin) {
			out.CPU.MachineIdleMin = r.CPU.MachineIdleMin
		}
	}
	out.CPU.MachineIdle, out.CPU.ProcessCores, out.CPU.Outside = idle.mean(), proc.mean(), outside.mean()
	if n := len(out.Requests); n > 0 {
		out.IdealHitRate = ideal / float64(n)
	}
	out.Engine, out.EngineErr = mergeEngine(runs)
	out.Summary = Summarize(out.Requests, slo, duration)
	return out, nil
}

// mergeEngine sums runs' engine counters: nil when any run lacks them,
// with a note when some had them.
func mergeEngine(runs []*Result) (*EngineStats, string) {
	var sum *EngineStats
	have := 0
	for _, r := range runs {
		if r.EngineErr != "" {
			return nil, r.EngineErr
		}
		if r.Engine == nil {
			continue
		}
		have++
		if sum == nil {
			e := *r.Engine
			sum = &e
			continue
		}
		sum.PrefixQueries += r.Engine.PrefixQueries
		sum.PrefixHits += r.Engine.PrefixHits
		sum.Preemptions += r.Engine.Preemptions
		sum.PromptTokens += r.Engine.PromptTokens
		sum.GenerationTokens += r.Engine.GenerationTokens
	}
	switch {
	case have == 0:
		return nil, ""
	case have < len(runs):
		return nil, fmt.Sprintf("engine figures from %d of %d rounds only", have, len(runs))
	}
	if sum.PrefixQueries > 0 {
		sum.HitRate = sum.PrefixHits / sum.PrefixQueries
	}
	return sum, ""
}

// cpuSum is a wall-weighted mean of figures that may be unknown (< 0).
type cpuSum struct{ sum, wall float64 }

func (s *cpuSum) add(v, wall float64) {
	if v >= 0 && wall > 0 {
		s.sum += v * wall
		s.wall += wall
	}
}

func (s cpuSum) mean() float64 {
	if s.wall == 0 {
		return -1
	}
	return s.sum / s.wall
}
