package workload

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"time"
)

// TraceBlockTokens is the block size of Mooncake trace hash ids, in tokens:
// the traces released with "Mooncake: A KVCache-centric Disaggregated
// Architecture for LLM Serving" (FAST'25, github.com/kvcache-ai/Mooncake)
// carry one id per 512-token block.
const TraceBlockTokens = 512

// TraceRecord is one line of a Mooncake trace (JSONL, the FAST'25 release).
type TraceRecord struct {
	// Timestamp is the arrival time in milliseconds from the trace start.
	Timestamp int64 `json:"timestamp"`
	// InputLength and OutputLength are in tokens.
	InputLength  int `json:"input_length"`
	OutputLength int `json:"output_length"`
	// HashIDs are prefix hashes of the prompt's 512-token blocks (the last
	// block may be partial): equal ids mean equal content up to that block.
	HashIDs []uint64 `json:"hash_ids"`
}

// ReadTrace reads up to limit records (0: all) of a Mooncake JSONL trace
// and checks each line's shape: positive lengths, one hash id per started
// 512-token block, timestamps not decreasing.
func ReadTrace(r io.Reader, limit int) ([]TraceRecord, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 1<<20), 64<<20)
	var out []TraceRecord
	var last int64
	for line := 1; sc.Scan() && (limit == 0 || len(out) < limit); line++ {
		b := sc.Bytes()
		if len(b) == 0 {
			continue
		}
		var rec TraceRecord
		if err := json.Unmarshal(b, &rec); err != nil {
			return nil, fmt.Errorf("%w: line %d: %v", ErrTrace, line, err)
		}
		switch {
		case rec.InputLength < 1 || rec.OutputLength < 1:
			return nil, fmt.Errorf("%w: line %d: lengths must be positive", ErrTrace, line)
		case len(rec.HashIDs) != (rec.InputLength+TraceBlockTokens-1)/TraceBlockTokens:
			return nil, fmt.Errorf("%w: line %d: %d hash ids for %d input tokens", ErrTrace, line, len(rec.HashIDs), rec.InputLength)
		case rec.Timestamp < last:
			return nil, fmt.Errorf("%w: line %d: timestamp %d before %d", ErrTrace, line, rec.Timestamp, last)
		}
		last = rec.Timestamp
		out = append(out, rec)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrTrace, err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: no records", ErrTrace)
	}
	return out, nil
}

// traceSessions reads c.TracePath and turns every record into a
// one-request session due at its timestamp ÷ speedup.
func traceSessions(c Config) ([]Session, error) {
	f, err := os.Open(c.TracePath)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrTrace, err)
	}
	defer f.Close()
	recs, err := ReadTrace(f, c.TraceLimit)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", c.TracePath, err)
	}
	return TraceSessions(recs, c), nil
}

// TraceSessions converts trace records to sessions as c (TraceSpeedup,
// TraceMaxInput, TraceMaxOutput, Seed) asks: block i of a prompt is the
// text of its hash id (the same id always gives the same words), a
// truncated prompt keeps its leading blocks.
func TraceSessions(recs []TraceRecord, c Config) []Session {
	speed := c.TraceSpeedup
	if speed <= 0 {
		speed = 1
	}
	ss := make([]Session, len(recs))
	for i, rec := range recs {
		in := rec.InputLength
		if c.TraceMaxInput > 0 {
			in = min(in, c.TraceMaxInput)
		}
		out := rec.OutputLength
		if c.TraceMaxOutput > 0 {
			out = min(out, c.TraceMaxOutput)
		}
		n := (in + TraceBlockTokens - 1) / TraceBlockTokens
		blocks := make([]TextBlock, n)
		for j := range blocks {
			blocks[j] = TextBlock{
				Seed:   mix(c.Seed, domTraceBlock, rec.HashIDs[j]),
				Tokens: min(TraceBlockTokens, in-j*TraceBlockTokens),
			}
		}
		ss[i] = Session{
			Group: -1,
			At:    time.Duration(float64(rec.Timestamp) * float64(time.Millisecond) / speed),
			Turns: []Turn{{UserTokens: in, Blocks: blocks, HashIDs: rec.HashIDs[:n], OutputTokens: out}},
		}
	}
	return ss
}
