package hop

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/valyala/fasthttp"
	"github.com/vmihailenco/msgpack/v5"
)

// The kvroute+events target is kvroute with engine truth on: it dials the
// instant backend's KV-event publisher (--kv-events-port) and tokenizes
// the prompts it forwards through the backend's POST /tokenize, in the
// background. The publisher sends what a busy vLLM pod sends (one batch
// per engine step, vLLM's map encoding): every kvStepInterval a batch
// that removes the previous step's chain of kvChainBlocks blocks, stores
// a new one, and alternately stores and removes the first kvChainBlocks
// blocks of the chat case's prompt (whose stores confirm kvroute's index
// entry for it, through the tokenizer's link; the 1 KiB completion's
// prompt is shorter than an index block, so nothing of it is linked) —
// about 3,500 events a second, more than an 8B model stores at full
// prefill speed (≈ 20,000 tokens/s, 1,250 blocks of 16). The row then
// shows what events cost the hop.
const (
	kvStepInterval = 10 * time.Millisecond
	kvChainBlocks  = 16
	kvBlockTokens  = 16
)

// EventsTarget is the target name of kvroute with engine truth on.
const EventsTarget = "kvroute+events"

// kvPub is the backend's publisher.
type kvPub struct {
	sock   zmq4.Socket
	port   int
	prompt []uint32 // the start of the chat case's prompt, tokenized as /tokenize does
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// startKVPub binds a PUB socket on a loopback port and publishes until
// close.
func startKVPub(prompt []uint32) (*kvPub, error) {
	ctx, cancel := context.WithCancel(context.Background())
	sock := zmq4.NewPub(ctx)
	if err := sock.Listen("tcp://127.0.0.1:0"); err != nil {
		cancel()
		return nil, fmt.Errorf("KV-event publisher: %w", err)
	}
	p := &kvPub{sock: sock, port: sock.Addr().(*net.TCPAddr).Port, prompt: prompt, cancel: cancel}
	p.wg.Go(func() { p.run(ctx) })
	return p, nil
}

func (p *kvPub) close() {
	p.cancel()
	p.wg.Wait()
	_ = p.sock.Close()
}

func (p *kvPub) run(ctx context.Context) {
	tick := time.NewTicker(kvStepInterval)
	defer tick.Stop()
	rng := rand.New(rand.NewPCG(1, 2))
	var seq uint64
	var prev []uint64
	promptHashes := make([]uint64, len(p.prompt)/kvBlockTokens)
	for i := range promptHashes {
		promptHashes[i] = 1<<62 + uint64(i)
	}
	promptTokens := p.prompt[:len(promptHashes)*kvBlockTokens]
	for step := 0; ; step++ {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		var events []map[string]any
		if prev != nil {
			events = append(events, map[string]any{"type": "BlockRemoved", "block_hashes": prev, "medium": "GPU"})
		}
		chain := make([]uint64, kvChainBlocks)
		tokens := make([]uint32, kvChainBlocks*kvBlockTokens)
		for i := range chain {
			chain[i] = rng.Uint64() >> 2
		}
		for i := range tokens {
			tokens[i] = rng.Uint32N(128000)
		}
		events = append(events, stored(chain, tokens))
		prev = chain
		if len(promptHashes) > 0 {
			if step%2 == 0 {
				events = append(events, stored(promptHashes, promptTokens))
			} else {
				events = append(events, map[string]any{"type": "BlockRemoved", "block_hashes": promptHashes, "medium": "GPU"})
			}
		}
		payload, err := msgpack.Marshal(map[string]any{"ts": float64(time.Now().UnixNano()) / 1e9, "events": events, "data_parallel_rank": nil})
		if err != nil {
			return
		}
		var sq [8]byte
		binary.BigEndian.PutUint64(sq[:], seq)
		seq++
		// A publisher with no subscriber drops the message, as vLLM's does.
		_ = p.sock.Send(zmq4.NewMsgFrom([]byte("kv-events"), sq[:], payload))
	}
}

func stored(hashes []uint64, tokens []uint32) map[string]any {
	return map[string]any{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": nil,
		"token_ids": tokens, "block_size": kvBlockTokens, "lora_id": nil, "medium": "GPU"}
}

// fakeTokens is the backend's tokenizer: a token id per 4 bytes of text.
func fakeTokens(text string) []uint32 {
	out := make([]uint32, 0, len(text)/4)
	for i := 0; i+4 <= len(text); i += 4 {
		out = append(out, binary.LittleEndian.Uint32([]byte(text[i:i+4]))%128000)
	}
	return out
}

// promptText is the text of a completion's prompt or of a chat's
// messages, as the backend tokenizes it.
func promptText(body []byte) (string, error) {
	var r struct {
		Prompt   string `json:"prompt"`
		Messages []struct {
			Content string `json:"content"`
		} `json:"messages"`
	}
	if err := json.Unmarshal(body, &r); err != nil {
		return "", err
	}
	text := r.Prompt
	for _, m := range r.Messages {
		text += m.Content
	}
	return text, nil
}

// tokenize answers POST /tokenize as vLLM does: {"count", "max_model_len",
// "tokens"}.
func tokenize(ctx *fasthttp.RequestCtx) {
	text, err := promptText(ctx.PostBody())
	if err != nil {
		ctx.Error(`{"object":"error","message":"bad body","type":"BadRequestError","code":400}`, fasthttp.StatusBadRequest)
		return
	}
	tokens := fakeTokens(text)
	b := make([]byte, 0, 16+len(tokens)*7)
	b = append(b, `{"count":`...)
	b = strconv.AppendInt(b, int64(len(tokens)), 10)
	b = append(b, `,"max_model_len":131072,"tokens":[`...)
	for i, t := range tokens {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, uint64(t), 10)
	}
	b = append(b, "]}"...)
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
}
