package discovery

import "sync"

// An engine that caches prompts per sequence slot (Dialect.Slotted:
// llama.cpp's server, Ollama) does not share a running request's prompt
// with a new one: a request of the same prompt that comes while the slot
// keeping it is busy takes a free slot and computes the prompt afresh
// (measured on llama-server: a ~3,000-token prompt 0.49 s cold while the
// first request decoded, 38 ms cached once it had ended). So for such an
// endpoint the router counts its requests in flight per prompt key
// (Lease.ForPrompt) and the most of them that ran at once — the copies of
// the prompt the endpoint's slots hold, since each one beyond the first
// computed its own — and a request that finds every copy busy may wait for
// one to end (routing's hold) rather than compute another.

// promptRun is one prompt key's requests in flight at an endpoint.
type promptRun struct {
	running int
	// copies is the most that ran at once: each request of the key that
	// started while the others held every copy made one more.
	copies int
	// ended is closed when one of them ends (nil until someone waits).
	ended chan struct{}
}

// prompts are an endpoint's prompt runs, guarded by mu.
type prompts struct {
	mu sync.Mutex
	m  map[uint64]*promptRun
}

// maxPromptRuns bounds an endpoint's prompt runs: past it the keys with
// nothing in flight are forgotten (their copies with them).
const maxPromptRuns = 4096

// PromptRuns returns this router's requests of prompt key in flight at e,
// the copies e holds as far as the router knows (the most that ran at
// once), and a channel closed when one of them ends (nil when none runs).
func (e *Endpoint) PromptRuns(key uint64) (running, copies int, ended <-chan struct{}) {
	p := &e.prompts
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.m[key]
	if r == nil {
		return 0, 0, nil
	}
	if r.running > 0 {
		if r.ended == nil {
			r.ended = make(chan struct{})
		}
		ended = r.ended
	}
	return r.running, r.copies, ended
}

// ForPrompt counts the lease's request as one of prompt key's in flight at
// its endpoint (PromptRuns) until it is released. Once per lease; key 0
// counts nothing.
func (l *Lease) ForPrompt(key uint64) {
	if l.e == nil || l.key != 0 || key == 0 {
		return
	}
	p := &l.e.prompts
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.m == nil {
		p.m = make(map[uint64]*promptRun)
	}
	r := p.m[key]
	if r == nil {
		if len(p.m) >= maxPromptRuns {
			for k, o := range p.m {
				if o.running == 0 {
					delete(p.m, k)
				}
			}
		}
		r = &promptRun{}
		p.m[key] = r
	}
	r.running++
	r.copies = max(r.copies, r.running)
	l.key = key
}

// promptEnded ends one request of key at e (Lease.Release).
func (e *Endpoint) promptEnded(key uint64) {
	p := &e.prompts
	p.mu.Lock()
	defer p.mu.Unlock()
	if r := p.m[key]; r != nil && r.running > 0 {
		r.running--
		if r.ended != nil {
			close(r.ended)
			r.ended = nil
		}
	}
}
