package routing

import (
	"sync"
	"sync/atomic"
	"time"
)

// peerColds are the cold placements of prompt keys that gossiping replicas
// made in the last unheardFor, each with the prefill the other replicas
// most likely sent after it (Prefix.PeerPlaced): a request of the same key
// counts that prefill where the placement went, as a replica's own pick
// counts its echo. Every replica hears a placement at once and decides
// alike on it: each sent its next request of the prompt to the endpoint
// computing it, within the spill margin, before hearing of the others'
// (bench/sim multi-turn, eight replicas with KV events: seven new
// conversations of one system prompt within 5 ms on one of eight pods,
// which then recomputed a third of every prompt; 0.94 of one router's
// output over twelve rounds, 0.98 with the echo). Only the key's requests
// count it: counted for every request there, the endpoint looked busy to
// other prompts homed on it, and eight replicas on llm-d shared-prefix
// spilled them (hit rate 0.977 of one router's, against 0.989 without).
type peerColds struct {
	n  atomic.Int64 // entries, so that a decision reads nothing while none is
	mu sync.Mutex
	m  map[uint64][]peerCold // by key
}

type peerCold struct {
	id     uint64 // the endpoint
	tokens int64
	until  int64 // unix ns
}

// maxColdKeys bounds the keys counted at once; beyond, a placement is not
// counted.
const maxColdKeys = 1024

// add counts tokens for key's requests on endpoint id until until.
func (c *peerColds) add(key, id uint64, tokens int64, until time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now().UnixNano()
	if c.m == nil {
		c.m = make(map[uint64][]peerCold)
	}
	if len(c.m) >= maxColdKeys {
		for k, es := range c.m {
			if es = c.live(es, now); len(es) > 0 {
				c.m[k] = es
			} else {
				delete(c.m, k)
			}
		}
		if len(c.m) >= maxColdKeys {
			return
		}
	}
	c.m[key] = append(c.live(c.m[key], now), peerCold{id: id, tokens: tokens, until: until.UnixNano()})
	c.n.Add(1)
}

// live returns es without its entries expired at now; c.mu is held.
func (c *peerColds) live(es []peerCold, now int64) []peerCold {
	out := es[:0]
	for _, e := range es {
		if e.until > now {
			out = append(out, e)
		}
	}
	c.n.Add(int64(len(out) - len(es)))
	return out
}

// at returns the tokens counted for key's requests on endpoint id now.
func (c *peerColds) at(key, id uint64, now time.Time) (tokens int64) {
	if c.n.Load() == 0 {
		return 0
	}
	t := now.UnixNano()
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, e := range c.m[key] {
		if e.id == id && e.until > t {
			tokens += e.tokens
		}
	}
	return tokens
}
