package routing

import "github.com/kvroute/kvroute/discovery"

// Sequences: a conversation's turn resends its previous turn's prompt whole
// and adds the answer and a new message, and an engine that still holds
// that prompt (its slot, its paged blocks) computes only what was added. The
// index sees a prompt in blocks of 1 KiB and records none of its last
// partial block, so a chat whose turns add a few hundred tokens each looks
// held only as deep as its shared system prompt, wherever its history is:
// one router sent every conversation of a chat workload to the one llama.cpp
// server that held the system prompt first, which then served each turn's
// system prompt from cache and recomputed its history.
//
// A prompt's marks (prefix.Mark) name its rendering up to each message end.
// Every pick records the request's last mark at its endpoint (Prefix.seqs,
// a warmth keyed by marks: the turn's mark takes its previous turn's place),
// and a later request whose marks include one an endpoint holds is credited
// there with that whole prompt, once that engine's answers showed it keeps
// sequences that far (warmth.latest). Each answer whose cache use is known tells
// whether the engine still had it (Learn), and seqs learns, as warmth does
// for prefix keys, how many sequences each engine keeps: beyond that count a
// mark is not credited. On an engine that caches per slot (Dialect.Slotted),
// a request none of whose earlier prompts is held there starts a sequence:
// it is not sent where that would push out a live one (dispatched within a
// few of the mean gaps between a conversation's turns, warmth.crowded)
// while another endpoint would not (gather), so a fleet of slot engines
// fills each one's slots before one evicts its own live conversations for
// new ones.

// seqMinTokens is the least a held sequence must add to the blocks matched
// for its outcome to say anything: below it, the engine's report cannot
// tell a kept sequence from a kept block match.
const seqMinTokens = 32

// seqHeld is what one endpoint holds of a request's earlier prompts: the
// latest one's mark (0: none) and rendering's length (bytes), and the
// tokens credited (its tokens when the engine is taken to keep it, else 0).
type seqHeld struct {
	mark          uint64
	bytes, tokens int
}

// sequence returns what e holds of the request's earlier prompts (holds:
// the request's prefix key is taken to be kept there): the latest one
// held anywhere, found once per decision (costing.seq), is held at the
// endpoint it was last sent to.
func (k *costing) sequence(e *discovery.Endpoint, holds bool) seqHeld {
	if k.seqAt != e.ID || k.seqMark.Bytes == 0 {
		return seqHeld{}
	}
	h := seqHeld{mark: k.seqMark.Hash, bytes: k.seqMark.Bytes}
	if k.seqKept && holds {
		h.tokens = min(int(float64(k.seqMark.Bytes)/k.bytesPerToken), k.promptTokens)
	}
	return h
}

// seqCrowded reports whether c's engine caches per slot and the request
// would start a sequence there that pushes out a live one (sequences).
func (k *costing) seqCrowded(c candidate) bool {
	return k.seqs != nil && c.seq.tokens == 0 && c.e.Dialect().Slotted() &&
		k.seqs.crowded(c.e.ID, k.now)
}

// learnSequence takes the engine's report for a request decided as d,
// whose rendering was promptBytes long: of its prompt tokens (0: unknown,
// the policy's estimate then) it served engineCached from cache, so the
// sequence the request continued was kept there or not (Prefix.seqs). The
// sequence and the blocks matched are read in the engine's tokens, as their
// shares of the rendering: the learned bytes per token may still be off.
// Kept means closer to the sequence than to the blocks; a sequence that
// adds less than seqMinTokens to them tells nothing.
func (p *Prefix) learnSequence(d Decision, promptBytes, enginePrompt, engineCached int) {
	if d.Endpoint == nil || d.seqDistance < 0 || promptBytes <= 0 {
		return
	}
	if enginePrompt <= 0 {
		enginePrompt = d.PromptTokens
	}
	perByte := float64(enginePrompt) / float64(promptBytes)
	blocks := float64(min(d.MatchedBlocks*p.blockBytes, promptBytes)) * perByte
	seq := float64(min(d.seqBytes, promptBytes)) * perByte
	if seq < blocks+seqMinTokens {
		return
	}
	warm := float64(2*engineCached) > blocks+seq
	if warm || !d.busy {
		p.seqs.outcome(d.Endpoint.ID, d.seqDistance, warm)
		if p.onOutcome != nil {
			p.onOutcome(d.Endpoint.ID, d.seqDistance, warm)
		}
	}
}
