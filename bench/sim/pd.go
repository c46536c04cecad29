package sim

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/valyala/fasthttp"
)

// The KV side channel stands in for NIXL and for SGLang's bootstrap server
// (one listener per pod, Config.SideChannelHost and SideChannelPort). It
// serves two prefill/decode protocols:
//
//   - vLLM's NixlConnector (sequential): the prefill pod answers a request
//     with kv_transfer_params do_remote_decode with a reference to the KV it
//     holds; a decode pod given the reference (kv_transfer_params with
//     do_remote_prefill) makes one real loopback request to the prefill
//     pod's side channel (remote_host:remote_port, sidePullPath), which
//     validates the reference and releases its hold.
//   - SGLang's bootstrap rooms (concurrent, bootstrap.go): both pods get
//     the same body with bootstrap_host, bootstrap_port and bootstrap_room;
//     the decode pod pulls the room from bootstrap_host:bootstrap_port
//     (bootstrapPullPath), which waits for the prefill and releases its hold.
//
// Either way the decode pod then waits the modelled transfer time before
// the sequence counts as prefilled, and computes the prefill itself when the
// pull fails (vllm:nixl_num_failed_transfers).

// sidePullPath is the side channel's NixlConnector route.
const sidePullPath = "/kv/pull"

// pullRequest is the NixlConnector side-channel request body.
type pullRequest struct {
	EngineID  string          `json:"remote_engine_id"`
	RequestID string          `json:"remote_request_id"`
	BlockIDs  json.RawMessage `json:"remote_block_ids"`
	NumTokens int             `json:"num_tokens"`
}

// pullResponse is the side channel's answer to either kind of pull.
type pullResponse struct {
	NumTokens int    `json:"num_tokens,omitempty"`
	Error     string `json:"error,omitempty"`
}

// nixlPullTimeout bounds a NixlConnector pull, whose prefill has ended.
const nixlPullTimeout = 10 * time.Second

// handleSide serves the side channel: NixlConnector pulls of a prefill
// pod's holds and the bootstrap server.
func (p *Pod) handleSide(ctx *fasthttp.RequestCtx) {
	switch {
	case !ctx.IsPost():
		ctx.SetStatusCode(fasthttp.StatusNotFound)
	case string(ctx.Path()) == sidePullPath:
		p.handleNixlPull(ctx)
	case string(ctx.Path()) == bootstrapPullPath:
		p.handleBootstrapPull(ctx)
	default:
		ctx.SetStatusCode(fasthttp.StatusNotFound)
	}
}

// answerPull writes a side-channel answer.
func answerPull(ctx *fasthttp.RequestCtx, status int, resp pullResponse) {
	b, _ := json.Marshal(resp)
	ctx.SetStatusCode(status)
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
}

// handleNixlPull serves a NixlConnector pull of a hold.
func (p *Pod) handleNixlPull(ctx *fasthttp.RequestCtx) {
	answer := func(status int, resp pullResponse) { answerPull(ctx, status, resp) }
	var req pullRequest
	if err := json.Unmarshal(ctx.PostBody(), &req); err != nil {
		answer(fasthttp.StatusBadRequest, pullResponse{Error: "bad pull request: " + err.Error()})
		return
	}
	if req.EngineID != p.engineID {
		answer(fasthttp.StatusNotFound, pullResponse{Error: "unknown engine id " + strconv.Quote(req.EngineID)})
		return
	}
	h, found, live := p.eng.takeHold(req.RequestID, time.Now())
	switch {
	case !found:
		answer(fasthttp.StatusNotFound, pullResponse{Error: "unknown request id " + strconv.Quote(req.RequestID)})
		return
	case !live:
		answer(fasthttp.StatusGone, pullResponse{Error: "hold expired"})
		return
	}
	// The hold is taken: release its blocks whatever the outcome.
	p.eng.post(event{kind: evRelease, hold: h})
	if want := appendBlockIDs(nil, h.blocks); len(req.BlockIDs) > 0 && !bytes.Equal(compactJSON(req.BlockIDs), want) {
		answer(fasthttp.StatusBadRequest, pullResponse{Error: "block ids do not match the hold"})
		return
	}
	if req.NumTokens != h.tokens {
		answer(fasthttp.StatusBadRequest, pullResponse{Error: fmt.Sprintf("hold has %d tokens, decode wants %d", h.tokens, req.NumTokens)})
		return
	}
	answer(fasthttp.StatusOK, pullResponse{NumTokens: h.tokens})
}

func compactJSON(b []byte) []byte {
	var out bytes.Buffer
	if json.Compact(&out, b) != nil {
		return b
	}
	return out.Bytes()
}

// startPull starts the goroutine that pulls s's KV; it posts evLoaded once
// the pull succeeded and the modelled transfer has ended (wall time ready,
// or transfer after a bootstrap pull's answer, which waited for the
// prefill), or at once when the pull failed or the request was cancelled.
// The loopback round trip itself is simulator overhead, not modelled time.
// Called by the engine goroutine; s.prompt and s.remote are immutable.
func (p *Pod) startPull(s *seq, ready time.Time, transfer time.Duration) {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		ok := p.pullKV(s.req.ctx, s.remote, len(s.prompt)) == nil
		at := time.Now()
		if ok {
			if s.remote.kind == refBootstrap {
				ready = later(ready, at.Add(transfer))
			}
			at = ready
			t := time.NewTimer(time.Until(ready))
			select {
			case <-t.C:
			case <-s.req.ctx.Done():
				t.Stop()
				at = time.Now()
			case <-p.done:
				t.Stop()
				return
			}
		}
		p.eng.post(event{kind: evLoaded, at: at, seq: s, ok: ok})
	}()
}

// later returns the later of a and b.
func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// pullKV asks the prefill pod named by ref for the blocks of a prompt of
// tokens tokens. The pull ends early when rctx (the request's) is done or
// the pod closes; a NixlConnector pull also after nixlPullTimeout, while a
// bootstrap pull waits as long as the prefill pod lets it.
func (p *Pod) pullKV(rctx context.Context, ref *kvRef, tokens int) error {
	var ctx context.Context
	var cancel context.CancelFunc
	if ref.kind == refNixl {
		ctx, cancel = context.WithTimeout(p.ctx, nixlPullTimeout)
	} else {
		ctx, cancel = context.WithCancel(p.ctx)
	}
	defer cancel()
	stop := context.AfterFunc(rctx, cancel)
	defer stop()
	path, body := ref.pullBody(tokens)
	url := "http://" + net.JoinHostPort(ref.host, strconv.Itoa(ref.port)) + path
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := p.pullClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var pr pullResponse
	if err := json.NewDecoder(resp.Body).Decode(&pr); err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("sim: KV pull: %d %s", resp.StatusCode, pr.Error)
	}
	return nil
}

// pullBody returns the side-channel path and body that pull ref's KV for a
// prompt of tokens tokens.
func (ref *kvRef) pullBody(tokens int) (string, []byte) {
	if ref.kind == refBootstrap {
		body, _ := json.Marshal(bootstrapPullRequest{Room: &ref.room, NumTokens: tokens})
		return bootstrapPullPath, body
	}
	body, _ := json.Marshal(pullRequest{EngineID: ref.engineID, RequestID: ref.requestID,
		BlockIDs: json.RawMessage(nonEmpty(ref.blockIDs)), NumTokens: tokens})
	return sidePullPath, body
}

func nonEmpty(s string) string {
	if s == "" {
		return "null"
	}
	return s
}
