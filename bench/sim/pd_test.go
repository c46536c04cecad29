package sim

import (
	"encoding/json"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// kvParams is the NixlConnector handoff reference.
type kvParams struct {
	DoRemotePrefill bool            `json:"do_remote_prefill"`
	DoRemoteDecode  bool            `json:"do_remote_decode"`
	RemoteBlockIDs  json.RawMessage `json:"remote_block_ids"`
	RemoteEngineID  string          `json:"remote_engine_id"`
	RemoteRequestID string          `json:"remote_request_id"`
	RemoteHost      string          `json:"remote_host"`
	RemotePort      int             `json:"remote_port"`
	TPSize          int             `json:"tp_size"`
}

// prefillLeg is the body a router sends to the prefill pod (vLLM's NixlConnector proxy protocol,
// docs.vllm.ai "NixlConnector Usage Guide").
func prefillLeg(prompt string) string {
	return `{"prompt":` + prompt + `,"max_tokens":1,"stream":false,` +
		`"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,` +
		`"remote_block_ids":null,"remote_host":null,"remote_port":null}}`
}

func decodeLeg(prompt string, kv []byte) string {
	return `{"prompt":` + prompt + `,"max_tokens":8,"stream":true,"stream_options":{"include_usage":true},"kv_transfer_params":` + string(kv) + `}`
}

// runPrefill sends the prefill leg and returns the reference.
func runPrefill(t *testing.T, url, prompt, reqID string) []byte {
	t.Helper()
	code, _, body := post(t, newClient(t), url+"/v1/completions", prefillLeg(prompt), "X-Request-Id", reqID)
	if code != 200 {
		t.Fatalf("prefill leg: %d %s", code, body)
	}
	r := decodeCompletion(t, body)
	if r.Usage.CompletionTokens != 1 || *r.Choices[0].FinishReason != "length" {
		t.Fatalf("prefill leg answer %s", body)
	}
	if string(r.KVTransferParams) == "null" {
		t.Fatalf("prefill leg returned no kv_transfer_params: %s", body)
	}
	return r.KVTransferParams
}

// streamUsage runs a streaming request and returns the final usage chunk.
func streamUsage(t *testing.T, url, body string) usageJSON {
	t.Helper()
	code, hdr, out := post(t, newClient(t), url+"/v1/completions", body)
	if code != 200 || !strings.HasPrefix(hdr.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("decode leg: %d %s", code, out)
	}
	ev := sseEvents(t, out)
	var u struct{ Usage usageJSON }
	if err := json.Unmarshal([]byte(ev[len(ev)-2]), &u); err != nil {
		t.Fatal(err)
	}
	return u.Usage
}

func TestPrefillDecodeHandoff(t *testing.T) {
	prefill, purl := servePod(t, Config{TimeScale: 100, Role: RolePrefill, Seed: 1})
	decode, durl := servePod(t, Config{TimeScale: 100, Role: RoleDecode, Seed: 2})
	c := newClient(t)
	ids, _ := json.Marshal(tokenPrompt(500, 2048))
	prompt := string(ids)

	kv := runPrefill(t, purl, prompt, "req-1")
	var ref kvParams
	if err := json.Unmarshal(kv, &ref); err != nil {
		t.Fatal(err)
	}
	sample := readWire(t, "pd-prefill-response.json")
	requireSuperset(t, "kv_transfer_params", keySet(t, kv), append(keySet(t, field(t, sample, "kv_transfer_params")), "remote_request_id"))
	var blocks [][]int
	if err := json.Unmarshal(ref.RemoteBlockIDs, &blocks); err != nil || len(blocks) != 1 || len(blocks[0]) != 128 {
		t.Errorf("remote_block_ids %s, want one list of 128 blocks", ref.RemoteBlockIDs)
	}
	if !ref.DoRemotePrefill || ref.DoRemoteDecode || ref.RemoteEngineID != prefill.EngineID() ||
		ref.RemoteRequestID != "cmpl-req-1-0" || net.JoinHostPort(ref.RemoteHost, strconv.Itoa(ref.RemotePort)) != prefill.SideChannelAddr() || ref.TPSize != 1 {
		t.Errorf("reference %+v", ref)
	}
	if st := prefill.Stats(); st.HeldBlocks != 128 || st.UsedBlocks != 128 {
		t.Errorf("prefill pod holds %d of %d used blocks, want 128 of 128", st.HeldBlocks, st.UsedBlocks)
	}
	if h := metricValue(t, scrape(t, c, purl), "kvsim:kv_held_blocks"); h != 128 {
		t.Errorf("kvsim:kv_held_blocks = %v", h)
	}

	u := streamUsage(t, durl, decodeLeg(prompt, kv))
	if u.PromptTokens != 2048 || u.CompletionTokens != 8 || u.cached() != 2047 {
		t.Errorf("decode usage %+v, want 2048 prompt, 8 completion, 2047 cached (pulled)", u)
	}
	if h := prefill.Stats().HeldBlocks; h != 0 {
		t.Errorf("prefill pod still holds %d blocks after the pull", h)
	}
	dm, pm := scrape(t, c, durl), scrape(t, c, purl)
	if f := metricValue(t, dm, "vllm:nixl_num_failed_transfers"); f != 0 {
		t.Errorf("%v failed transfers", f)
	}
	if h := metricValue(t, dm, "vllm:external_prefix_cache_hits_total"); h != 2047 {
		t.Errorf("external hits %v, want 2047", h)
	}
	// The decode pod paid the transfer, not the prefill compute.
	dTTFT := metricValue(t, dm, "vllm:time_to_first_token_seconds")
	pTTFT := metricValue(t, pm, "vllm:time_to_first_token_seconds")
	if want := decode.cfg.TransferCost(2047) + decode.cfg.StepCost(0, 2048); dTTFT > want.Seconds()*1.5 || dTTFT*4 > pTTFT {
		t.Errorf("decode TTFT %.4fs (model %v), prefill TTFT %.4fs", dTTFT, want, pTTFT)
	}
	// The pulled blocks are now cached on the decode pod.
	code, _, body := post(t, c, durl+"/v1/completions", `{"prompt":`+prompt+`,"max_tokens":1}`)
	if got := decodeCompletion(t, body).Usage.cached(); code != 200 || got != 2032 {
		t.Errorf("local repeat on the decode pod: %d cached %d, want 2032", code, got)
	}
}

func TestPrefillDecodeFallback(t *testing.T) {
	ids, _ := json.Marshal(tokenPrompt(7000, 300))
	prompt := string(ids)
	closedPort := func() int {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		return port
	}
	tests := []struct {
		name   string
		hold   time.Duration // prefill pod's KVHoldTimeout
		mangle func(kv map[string]any)
	}{
		{name: "expired reference", hold: time.Nanosecond, mangle: func(map[string]any) {}},
		{name: "unknown request id", mangle: func(kv map[string]any) { kv["remote_request_id"] = "cmpl-nope-0" }},
		{name: "wrong engine id", mangle: func(kv map[string]any) { kv["remote_engine_id"] = "someone-else" }},
		{name: "wrong block ids", mangle: func(kv map[string]any) { kv["remote_block_ids"] = [][]int{{1, 2, 3}} }},
		{name: "unreachable side channel", mangle: func(kv map[string]any) { kv["remote_port"] = closedPort() }},
		{name: "malformed reference", mangle: func(kv map[string]any) { delete(kv, "remote_host") }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, purl := servePod(t, Config{TimeScale: 1000, Role: RolePrefill, KVHoldTimeout: tc.hold})
			_, durl := servePod(t, Config{TimeScale: 1000, Role: RoleDecode})
			var kv map[string]any
			if err := json.Unmarshal(runPrefill(t, purl, prompt, "fb"), &kv); err != nil {
				t.Fatal(err)
			}
			tc.mangle(kv)
			mangled, _ := json.Marshal(kv)
			u := streamUsage(t, durl, decodeLeg(prompt, mangled))
			if u.PromptTokens != 300 || u.CompletionTokens != 8 || u.cached() != 0 {
				t.Errorf("fallback usage %+v, want a local prefill of 300 tokens", u)
			}
			m := scrape(t, newClient(t), durl)
			if f := metricValue(t, m, "vllm:nixl_num_failed_transfers"); f != 1 {
				t.Errorf("%v failed transfers, want 1", f)
			}
			if h := metricValue(t, m, "vllm:external_prefix_cache_hits_total"); h != 0 {
				t.Errorf("external hits %v, want 0", h)
			}
		})
	}
}

func TestHoldExpiresWithoutPull(t *testing.T) {
	prefill, purl := servePod(t, Config{TimeScale: 1000, Role: RolePrefill, KVHoldTimeout: time.Nanosecond})
	c := newClient(t)
	ids, _ := json.Marshal(tokenPrompt(1, 64))
	runPrefill(t, purl, string(ids), "stranded")
	assertHoldExpired(t, c, prefill, purl)
}

// assertHoldExpired checks that the prefill pod's only hold, which expired
// at once, is released and counted: the engine sweeps expired holds before
// it schedules the next request, so after that request the blocks are free.
func assertHoldExpired(t *testing.T, c *http.Client, prefill *Pod, purl string) {
	t.Helper()
	if code, _, body := post(t, c, purl+"/v1/completions", `{"prompt":"next","max_tokens":1}`); code != 200 {
		t.Fatalf("%d %s", code, body)
	}
	if e := metricValue(t, scrape(t, c, purl), "kvsim:kv_hold_expired_total"); e != 1 {
		t.Errorf("kvsim:kv_hold_expired_total = %v, want 1", e)
	}
	if st := prefill.Stats(); st.HeldBlocks != 0 || st.UsedBlocks != 0 {
		t.Errorf("after expiry %+v, want no held or used blocks", st)
	}
}
