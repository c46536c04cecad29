package workload

import (
	"encoding/binary"

	"github.com/zeebo/xxh3"

	"github.com/kvroute/kvroute/bench/sim"
)

// DefaultBlockSize is vLLM's default KV block size in tokens, the
// granularity at which prefix caches match.
const DefaultBlockSize = 16

// IdealHitRate returns the prefix-cache hit rate (hit tokens ÷ prompt
// tokens, as vLLM's prefix_cache_hits/queries counters count it) that one
// engine with an infinite cache would report for the first n requests of w
// sent in order: sessions in order, each session's turns in order, single
// turn workloads reused cyclically when n exceeds their size (n ≤ 0: every
// request once). A request hits the leading full blocks of blockSize tokens
// that an earlier request's prompt or answer filled, never its own last
// token. Prompts are rendered for api and tokenized with the simulator's
// tokenizer; multi-turn answers are placeholders of the turn's output
// length. Trace prompts are matched by their 512-token hash ids instead,
// then rounded down to blockSize. The result is an upper bound for any
// router: it ignores capacity and concurrency.
func IdealHitRate(w *Workload, api API, n, blockSize int) float64 {
	if blockSize <= 0 {
		blockSize = DefaultBlockSize
	}
	total := w.Requests()
	if n <= 0 || w.MultiTurn() {
		n = min(max(n, 0), total)
		if n == 0 {
			n = total
		}
	}
	id := newIdealCache(blockSize)
	var queries, hits float64
	sent := 0
	var buf []byte
	var answers []string
	for i := 0; sent < n && len(w.Sessions) > 0; i++ {
		s := &w.Sessions[i%len(w.Sessions)]
		answers = answers[:0]
		for k := range s.Turns {
			if sent == n {
				break
			}
			sent++
			t := &s.Turns[k]
			if t.HashIDs != nil && s.System == "" {
				q, h := id.traceRequest(t)
				queries, hits = queries+q, hits+h
				continue
			}
			buf = appendPrompt(buf[:0], api, s, k, answers)
			prompt := len(buf)
			multi := len(s.Turns) > 1
			if multi {
				a := sim.SyntheticText(t.OutputTokens, t.AnswerSeed)
				answers = append(answers, a)
				buf = append(buf, a...)
			}
			q, h := id.request(buf[:prompt], buf)
			queries, hits = queries+q, hits+h
		}
	}
	if queries == 0 {
		return 0
	}
	return hits / queries
}

// idealCache is the infinite cache of IdealHitRate.
type idealCache struct {
	bs      int
	blocks  map[uint64]struct{} // chained block hashes
	traceID map[uint64]int      // trace hash id → longest length seen
	scratch []byte
}

func newIdealCache(bs int) *idealCache {
	return &idealCache{bs: bs, blocks: make(map[uint64]struct{}), traceID: make(map[uint64]int),
		scratch: make([]byte, 8+4*bs)}
}

// request counts one prompt's queries and hits, then caches the full blocks
// of filled (the prompt followed by its answer, when known).
func (c *idealCache) request(prompt, filled []byte) (queries, hits float64) {
	toks := sim.Tokenize(string(filled), sim.DefaultConfig().VocabSize)
	np := sim.CountTokens(string(prompt))
	limit := (np - 1) / c.bs
	var parent uint64
	matching := true
	for i := 0; (i+1)*c.bs <= len(toks); i++ {
		h := c.hash(parent, toks[i*c.bs:(i+1)*c.bs])
		if matching && i < limit {
			if _, ok := c.blocks[h]; ok {
				hits += float64(c.bs)
			} else {
				matching = false
			}
		}
		c.blocks[h] = struct{}{}
		parent = h
	}
	return float64(np), hits
}

func (c *idealCache) hash(parent uint64, toks []uint32) uint64 {
	b := c.scratch[:0]
	b = binary.LittleEndian.AppendUint64(b, parent)
	for _, t := range toks {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	return xxh3.Hash(b)
}

// traceRequest matches a trace prompt by hash id: a block whose id was seen
// before with at least its length is a hit; a shorter earlier occurrence
// (a partial last block) hits as far as it went.
func (c *idealCache) traceRequest(t *Turn) (queries, hits float64) {
	hit := 0
	for j, id := range t.HashIDs {
		l := t.Blocks[j].Tokens
		seen := c.traceID[id]
		if seen >= l {
			hit += l
			continue
		}
		hit += seen
		break
	}
	for j, id := range t.HashIDs {
		c.traceID[id] = max(c.traceID[id], t.Blocks[j].Tokens)
	}
	limit := (t.UserTokens - 1) / c.bs * c.bs
	hit = min(hit/c.bs*c.bs, limit)
	return float64(t.UserTokens), float64(hit)
}
