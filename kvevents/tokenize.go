package kvevents

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"
	"github.com/valyala/fastjson"

	"github.com/kvroute/kvroute/discovery"
)

// Linker is engine truth's side of the tokenizer (prefix.Truth): which
// forwarded prompts it wants tokenized, and their tokens.
type Linker interface {
	// NeedsLink reports whether the chain of byte blocks hashes should be
	// tokenized; true marks it under way until Link or Unlinked.
	NeedsLink(hashes []uint64) bool
	// Link hands over the engine's tokens of a prompt whose rendering,
	// promptBytes long, has the byte blocks hashes.
	Link(lora string, hashes []uint64, promptBytes int, tokens []uint32)
	// Unlinked ends a tokenization that did not happen: retry when it
	// was never sent (full queue, shutdown), not when the engine failed it.
	Unlinked(hashes []uint64, retry bool)
}

// Tokenizer asks engines to tokenize prompts that were forwarded to them,
// off the request path: the request path (proxy.Options.Tokenizer) offers
// a copy of what it forwarded (Offer never blocks; a full queue drops the
// offer, counted), and Run's workers post each to the engine's POST
// /tokenize (vLLM's, which takes a completion's prompt or a chat's
// messages, and ignores the other fields of the forwarded body), at most
// Rate a second, and hand the tokens to the Linker. Only a chain the
// Linker asks for is offered, so a prompt is tokenized once, not once per
// request. Safe for concurrent use.
type Tokenizer struct {
	linker  Linker
	jobs    chan *tokenizeJob
	rate    float64
	timeout time.Duration
	clients sync.Map // endpoint Addr → *fasthttp.HostClient

	ok, failed, dropped atomic.Uint64
}

type tokenizeJob struct {
	ep          *discovery.Endpoint
	lora        string
	hashes      []uint64
	promptBytes int
	body        []byte
}

// TokenizerConfig configures a Tokenizer; zero fields take the defaults.
type TokenizerConfig struct {
	// Rate is the most tokenize requests a second, over all engines.
	// Default 50: a new prompt a request at 50 requests/s, each a few
	// milliseconds of an engine's API-server CPU.
	Rate float64
	// Queue is the most offers waiting (default 256).
	Queue int
	// Timeout bounds one tokenize request (default 5 s).
	Timeout time.Duration
}

// tokenizeWorkers is how many tokenize requests are in flight at once.
const tokenizeWorkers = 2

// NewTokenizer returns a Tokenizer feeding linker; it starts nothing.
func NewTokenizer(linker Linker, c TokenizerConfig) *Tokenizer {
	if c.Rate <= 0 {
		c.Rate = 50
	}
	if c.Queue <= 0 {
		c.Queue = 256
	}
	if c.Timeout <= 0 {
		c.Timeout = 5 * time.Second
	}
	return &Tokenizer{linker: linker, jobs: make(chan *tokenizeJob, c.Queue), rate: c.Rate, timeout: c.Timeout}
}

// client returns the connection pool to ep.
func (t *Tokenizer) client(ep *discovery.Endpoint) *fasthttp.HostClient {
	if c, ok := t.clients.Load(ep.Addr); ok {
		return c.(*fasthttp.HostClient)
	}
	c, _ := t.clients.LoadOrStore(ep.Addr, &fasthttp.HostClient{Addr: ep.Addr, IsTLS: ep.TLS, Name: "kvroute-tokenize",
		ReadTimeout: t.timeout, WriteTimeout: t.timeout, MaxConns: tokenizeWorkers,
		MaxIdleConnDuration: discovery.EngineIdleTimeout, MaxResponseBodySize: 64 << 20})
	return c.(*fasthttp.HostClient)
}

// Offer offers the body forwarded to ep, whose prompt's rendering is
// promptBytes long with byte blocks hashes, for tokenizing. It copies
// what it keeps and never blocks.
func (t *Tokenizer) Offer(ep *discovery.Endpoint, lora string, hashes []uint64, promptBytes int, body []byte) {
	if len(hashes) == 0 || !t.linker.NeedsLink(hashes) {
		return
	}
	j := &tokenizeJob{ep: ep, lora: lora, hashes: append([]uint64(nil), hashes...), promptBytes: promptBytes,
		body: append([]byte(nil), body...)}
	select {
	case t.jobs <- j:
	default:
		t.dropped.Add(1)
		t.linker.Unlinked(j.hashes, true)
	}
}

// TokenizerStats are a Tokenizer's counters.
type TokenizerStats struct {
	OK, Failed, Dropped uint64
}

// Stats returns the counters: tokenizations linked, failed, and offers
// dropped on a full queue.
func (t *Tokenizer) Stats() TokenizerStats {
	return TokenizerStats{OK: t.ok.Load(), Failed: t.failed.Load(), Dropped: t.dropped.Load()}
}

// Run works through the offers until ctx is done.
func (t *Tokenizer) Run(ctx context.Context) {
	tick := time.NewTicker(time.Duration(float64(time.Second) / t.rate))
	defer tick.Stop()
	var wg sync.WaitGroup
	defer func() {
		wg.Wait()
		t.clients.Range(func(_, c any) bool { c.(*fasthttp.HostClient).CloseIdleConnections(); return true })
	}()
	for range tokenizeWorkers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-ctx.Done():
					return
				case j := <-t.jobs:
					select {
					case <-ctx.Done():
						t.linker.Unlinked(j.hashes, true)
						return
					case <-tick.C:
					}
					t.do(j)
				}
			}
		}()
	}
	<-ctx.Done()
}

// ErrTokenize is wrapped by a tokenize request's failures.
var ErrTokenize = errors.New("kvevents: tokenize failed")

func (t *Tokenizer) do(j *tokenizeJob) {
	tokens, err := t.tokenize(j)
	if err != nil {
		t.failed.Add(1)
		t.linker.Unlinked(j.hashes, false)
		return
	}
	t.ok.Add(1)
	t.linker.Link(j.lora, j.hashes, j.promptBytes, tokens)
}

// tokenize posts j's body to its endpoint's /tokenize and returns the
// tokens.
func (t *Tokenizer) tokenize(j *tokenizeJob) ([]uint32, error) {
	return Tokenize(t.client(j.ep), j.ep, j.body, t.timeout)
}

// Doer sends one HTTP request (fasthttp's Client and HostClient).
type Doer interface {
	DoTimeout(req *fasthttp.Request, resp *fasthttp.Response, timeout time.Duration) error
}

// tokenizeParsers parse the engines' /tokenize answers.
var tokenizeParsers fastjson.ParserPool

// Tokenize posts body (a completion's or a chat's request body, as
// vLLM's POST /tokenize takes it) to ep's /tokenize through c, within
// timeout, and returns the engine's token ids.
func Tokenize(c Doer, ep *discovery.Endpoint, body []byte, timeout time.Duration) ([]uint32, error) {
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI(ep.URL + "/tokenize")
	req.Header.SetMethod(fasthttp.MethodPost)
	req.Header.SetContentType("application/json")
	req.SetBodyRaw(body)
	if err := c.DoTimeout(req, resp, timeout); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrTokenize, err)
	}
	if resp.StatusCode() != fasthttp.StatusOK {
		return nil, fmt.Errorf("%w: status %d", ErrTokenize, resp.StatusCode())
	}
	p := tokenizeParsers.Get()
	defer tokenizeParsers.Put(p)
	v, err := p.ParseBytes(resp.Body())
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrTokenize, err)
	}
	tv := v.Get("tokens")
	if tv == nil {
		return nil, fmt.Errorf("%w: the answer has no tokens", ErrTokenize)
	}
	arr, err := tv.Array()
	if err != nil {
		return nil, fmt.Errorf("%w: tokens: %w", ErrTokenize, err)
	}
	tokens := make([]uint32, len(arr))
	for i, a := range arr {
		n, err := a.Uint64()
		if err != nil || n > 1<<32-1 {
			return nil, fmt.Errorf("%w: token %d is not a token id", ErrTokenize, i)
		}
		tokens[i] = uint32(n)
	}
	return tokens, nil
}
