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

// The KV side channel stands in for NIXL: a decode pod given a reference
// (kv_transfer_params with do_remote_prefill) makes one real loopback request
// to the prefill pod's side-channel listener (remote_host:remote_port), which
// validates the reference and releases its hold; the decode pod then waits
// the modelled transfer time before the sequence counts as prefilled.

// sidePullPath is the side channel's only route.
const sidePullPath = "/kv/pull"

// pullRequest is the side-channel request body.
type pullRequest struct {
	EngineID  string          `json:"remote_engine_id"`
	RequestID string          `json:"remote_request_id"`
	BlockIDs  json.RawMessage `json:"remote_block_ids"`
	NumTokens int             `json:"num_tokens"`
}

// pullResponse is the side-channel answer.
type pullResponse struct {
	NumTokens int    `json:"num_tokens,omitempty"`
	Error     string `json:"error,omitempty"`
}

// handleSide serves the side channel of a prefill pod.
func (p *Pod) handleSide(ctx *fasthttp.RequestCtx) {
	if string(ctx.Path()) != sidePullPath || !ctx.IsPost() {
		ctx.SetStatusCode(fasthttp.StatusNotFound)
		return
	}
	answer := func(status int, resp pullResponse) {
		b, _ := json.Marshal(resp)
		ctx.SetStatusCode(status)
		ctx.SetContentType("application/json")
		ctx.SetBody(b)
	}
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
// the pull succeeded and the modelled transfer has ended (wall time ready),
// or at once when the pull failed. The loopback round trip itself is
// simulator overhead, not modelled time. Called by the engine goroutine;
// s.prompt and s.remote are immutable.
func (p *Pod) startPull(s *seq, ready time.Time) {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		ok := p.pullKV(s.remote, len(s.prompt)) == nil
		at := time.Now()
		if ok {
			at = ready
			t := time.NewTimer(time.Until(ready))
			select {
			case <-t.C:
			case <-p.done:
				t.Stop()
				return
			}
		}
		p.eng.post(event{kind: evLoaded, at: at, seq: s, ok: ok})
	}()
}

// pullKV asks the prefill pod named by ref for the blocks of a prompt of
// tokens tokens.
func (p *Pod) pullKV(ref *kvRef, tokens int) error {
	body, _ := json.Marshal(pullRequest{EngineID: ref.engineID, RequestID: ref.requestID,
		BlockIDs: json.RawMessage(nonEmpty(ref.blockIDs)), NumTokens: tokens})
	ctx, cancel := context.WithTimeout(p.ctx, 10*time.Second)
	defer cancel()
	url := "http://" + net.JoinHostPort(ref.host, strconv.Itoa(ref.port)) + sidePullPath
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

func nonEmpty(s string) string {
	if s == "" {
		return "null"
	}
	return s
}
