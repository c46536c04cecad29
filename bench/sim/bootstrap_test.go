package sim

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
	"github.com/valyala/fastjson"
)

// bootLeg describes the body that an SGLang router sends to both legs.
type bootLeg struct {
	chat   bool
	stream bool
	input  string // the "prompt" (completions) or the user message (chat), JSON
	host   string // bootstrap_host, JSON
	port   string // bootstrap_port, JSON
	room   string // bootstrap_room, JSON
	max    int    // max_tokens
}

// path returns the leg's endpoint.
func (l bootLeg) path() string {
	if l.chat {
		return "/v1/chat/completions"
	}
	return "/v1/completions"
}

// body returns the leg's JSON body.
func (l bootLeg) body() string {
	b := `{"model":"meta-llama/Llama-3.1-8B-Instruct",`
	if l.chat {
		b += `"messages":[{"role":"user","content":` + l.input + `}]`
	} else {
		b += `"prompt":` + l.input
	}
	b += fmt.Sprintf(`,"max_tokens":%d,"stream":%t`, l.max, l.stream)
	if l.stream {
		b += `,"stream_options":{"include_usage":true}`
	}
	return b + `,"bootstrap_host":` + l.host + `,"bootstrap_port":` + l.port + `,"bootstrap_room":` + l.room + `}`
}

// roomLeg returns a one-prompt leg for room of the prefill pod p.
func roomLeg(p *Pod, input string, room uint64) bootLeg {
	return bootLeg{input: input, host: `"127.0.0.1"`, port: strconv.Itoa(sidePort(p)),
		room: strconv.FormatUint(room, 10), max: 8}
}

// sidePort returns the port of p's side channel (its bootstrap server).
func sidePort(p *Pod) int {
	_, port, _ := net.SplitHostPort(p.SideChannelAddr())
	n, _ := strconv.Atoi(port)
	return n
}

// jsonInput returns JSON for a prompt of n token ids from first.
func jsonInput(first, n int) string {
	b, _ := json.Marshal(tokenPrompt(first, n))
	return string(b)
}

// legAnswer is the raw answer of a leg sent from another goroutine.
type legAnswer struct {
	code int
	body []byte
	took time.Duration
	err  error
}

// sendLeg sends leg to url from a new goroutine.
func sendLeg(c *http.Client, url string, leg bootLeg) <-chan legAnswer {
	out := make(chan legAnswer, 1)
	go func() {
		start := time.Now()
		resp, err := c.Post(url+leg.path(), "application/json", strings.NewReader(leg.body()))
		if err != nil {
			out <- legAnswer{err: err}
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		out <- legAnswer{code: resp.StatusCode, body: b, took: time.Since(start), err: err}
	}()
	return out
}

// legResult is what a test checks of a leg's answer, streamed or not.
type legResult struct {
	usage    usageJSON
	finishes map[int]string // finish reason per choice index
	kv       json.RawMessage
	took     time.Duration
}

// awaitLeg waits for a leg's answer and reads it; it must be a 200.
func awaitLeg(t *testing.T, ch <-chan legAnswer, stream bool) legResult {
	t.Helper()
	var a legAnswer
	select {
	case a = <-ch:
	case <-time.After(10 * time.Second):
		t.Fatal("leg did not answer")
	}
	if a.err != nil || a.code != 200 {
		t.Fatalf("leg: %d %s %v", a.code, a.body, a.err)
	}
	res := legResult{finishes: map[int]string{}, took: a.took}
	if !stream {
		r := decodeCompletion(t, a.body)
		for _, c := range r.Choices {
			res.finishes[c.Index] = *c.FinishReason
		}
		res.usage, res.kv = r.Usage, r.KVTransferParams
		return res
	}
	ev := sseEvents(t, a.body)
	if ev[len(ev)-1] != "[DONE]" {
		t.Fatalf("stream does not end with [DONE]: %s", a.body)
	}
	for _, e := range ev[:len(ev)-1] {
		var r completionJSON
		if err := json.Unmarshal([]byte(e), &r); err != nil {
			t.Fatal(err)
		}
		for _, c := range r.Choices {
			if c.FinishReason != nil {
				res.finishes[c.Index] = *c.FinishReason
			}
		}
		res.usage = r.Usage
	}
	return res
}

// waitRoom waits until room id of the prefill pod p is in state.
func waitRoom(t *testing.T, p *Pod, id uint64, state roomState) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		p.eng.mu.Lock()
		r := p.eng.rooms[id]
		ok := r != nil && r.state == state
		p.eng.mu.Unlock()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("room %d never reached state %d", id, state)
		}
		time.Sleep(time.Millisecond)
	}
}

// prefillTokens sums the prompt tokens that the steps computed.
func prefillTokens(rec *stepRecorder) int {
	n := 0
	for _, s := range rec.all() {
		n += s.PrefillTokens
	}
	return n
}

// checkDecode checks the decode pod's figures after one handoff: ext
// external hits (pulled tokens) and failed failed transfers.
func checkDecode(t *testing.T, url string, ext, failed float64) {
	t.Helper()
	m := scrape(t, newClient(t), url)
	if h := metricValue(t, m, "vllm:external_prefix_cache_hits_total"); h != ext {
		t.Errorf("external hits %v, want %v", h, ext)
	}
	if f := metricValue(t, m, "vllm:nixl_num_failed_transfers"); f != failed {
		t.Errorf("%v failed transfers, want %v", f, failed)
	}
}

// TestBootstrapHandoff runs SGLang's concurrent legs with the decode leg
// first: its pull waits in the room until the prefill leg arrives and ends,
// and the decode pod computes no prompt.
func TestBootstrapHandoff(t *testing.T) {
	for _, chat := range []bool{false, true} {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("chat=%t stream=%t", chat, stream), func(t *testing.T) {
				prefill, purl := servePod(t, Config{TimeScale: 100, Role: RolePrefill, Seed: 1})
				rec := newStepRecorder(nil)
				_, durl := servePod(t, Config{TimeScale: 100, Role: RoleDecode, Seed: 2, OnStep: rec.record})
				c := newClient(t)
				const room = math.MaxInt64 // the top of the router's range
				leg := roomLeg(prefill, jsonInput(300, 1500), room)
				if chat {
					leg.input = strconv.Quote(strings.Repeat("tell me more ", 400))
				}
				leg.chat, leg.stream = chat, stream

				decodeAns := sendLeg(c, durl, leg)
				waitRoom(t, prefill, room, roomAwaited)
				p := awaitLeg(t, sendLeg(c, purl, leg), stream)
				d := awaitLeg(t, decodeAns, stream)

				if p.usage.CompletionTokens != 1 || p.finishes[0] != "length" || len(p.finishes) != 1 {
					t.Errorf("prefill leg: %+v, want one token ending on length", p)
				}
				if !stream && string(p.kv) != "null" {
					t.Errorf("prefill leg kv_transfer_params %s, want null", p.kv)
				}
				n := p.usage.PromptTokens
				if u := d.usage; u.PromptTokens != n || u.CompletionTokens != 8 || u.cached() != n-1 || d.finishes[0] != "length" {
					t.Errorf("decode usage %+v (finish %v), want %d prompt tokens, %d cached (pulled), 8 generated", u, d.finishes, n, n-1)
				}
				if got := prefillTokens(rec); got != 0 {
					t.Errorf("the decode pod computed %d prompt tokens, want 0", got)
				}
				checkDecode(t, durl, float64(n-1), 0)
				if st := prefill.Stats(); st.HeldBlocks != 0 {
					t.Errorf("prefill pod still holds %d blocks after the pull", st.HeldBlocks)
				}
			})
		}
	}
}

// TestBootstrapBatched pulls one room per prompt of a batched request, with
// scalar and list hosts and ports.
func TestBootstrapBatched(t *testing.T) {
	for _, lists := range []bool{false, true} {
		t.Run(fmt.Sprintf("lists=%t", lists), func(t *testing.T) {
			prefill, purl := servePod(t, Config{TimeScale: 100, Role: RolePrefill, Seed: 1})
			rec := newStepRecorder(nil)
			_, durl := servePod(t, Config{TimeScale: 100, Role: RoleDecode, Seed: 2, OnStep: rec.record})
			c := newClient(t)
			rooms := []uint64{1 << 62, 7, 1<<63 - 2}
			leg := roomLeg(prefill, "["+jsonInput(10, 100)+","+jsonInput(2000, 200)+","+jsonInput(5000, 300)+"]", 0)
			leg.room, leg.max = fmt.Sprintf("[%d,%d,%d]", rooms[0], rooms[1], rooms[2]), 4
			if lists {
				leg.host = `["127.0.0.1","127.0.0.1","127.0.0.1"]`
				leg.port = fmt.Sprintf("[%s,%[1]s,%[1]s]", leg.port)
			}
			decodeAns := sendLeg(c, durl, leg)
			for _, r := range rooms {
				waitRoom(t, prefill, r, roomAwaited)
			}
			p := awaitLeg(t, sendLeg(c, purl, leg), false)
			d := awaitLeg(t, decodeAns, false)
			if p.usage.CompletionTokens != 3 || len(p.finishes) != 3 || p.finishes[2] != "length" {
				t.Errorf("prefill leg %+v, want one token per prompt", p)
			}
			if u := d.usage; u.PromptTokens != 600 || u.CompletionTokens != 12 || u.cached() != 597 {
				t.Errorf("decode usage %+v, want 600 prompt tokens, 597 pulled, 12 generated", u)
			}
			if got := prefillTokens(rec); got != 0 {
				t.Errorf("the decode pod computed %d prompt tokens, want 0", got)
			}
			checkDecode(t, durl, 597, 0)
		})
	}
}

// TestBootstrapPrefillFails checks that a decode pod whose prefill leg fails
// learns it promptly, computes the prompt itself and counts a failed
// transfer.
func TestBootstrapPrefillFails(t *testing.T) {
	const room = 4242
	tests := []struct {
		name    string
		prefill Config
		// act makes the prefill leg fail once the decode pod's pull waits.
		act func(t *testing.T, p *Pod, url string, leg bootLeg)
	}{
		{name: "model not found", prefill: Config{Model: "another-model"}, act: func(t *testing.T, p *Pod, url string, leg bootLeg) {
			if a := <-sendLeg(newClient(t), url, leg); a.code != 404 {
				t.Errorf("prefill leg: %d %s, want 404", a.code, a.body)
			}
		}},
		{name: "injected error", prefill: Config{Faults: Faults{ErrorRate: 1}}, act: func(t *testing.T, p *Pod, url string, leg bootLeg) {
			if a := <-sendLeg(newClient(t), url, leg); a.code != 500 {
				t.Errorf("prefill leg: %d %s, want 500", a.code, a.body)
			}
		}},
		{name: "aborted", act: func(t *testing.T, p *Pod, _ string, _ bootLeg) {
			// The client of the prefill leg went away before the step.
			rooms, aerr := p.openRooms([]uint64{room})
			if aerr != nil {
				t.Fatal(aerr.msg)
			}
			r := newRequest()
			r.seqs = []*seq{{req: r, prompt: make([]uint32, 400), maxTokens: 1, ignoreEOS: true, room: rooms[0]}}
			r.cancel()
			p.eng.post(event{kind: evRequest, req: r})
		}},
		{name: "prefill pod closed", prefill: Config{Faults: Faults{StallUntilRelease: true}}, act: func(t *testing.T, p *Pod, url string, leg bootLeg) {
			ans := sendLeg(newClient(t), url, leg)
			waitRoom(t, p, room, roomPending)
			p.Close()
			<-ans
		}},
		{name: "no prefill leg", prefill: Config{BootstrapWaitTimeout: 100 * time.Millisecond}, act: func(*testing.T, *Pod, string, bootLeg) {}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pcfg := tc.prefill
			pcfg.TimeScale, pcfg.Role = 1000, RolePrefill
			prefill, purl := servePod(t, pcfg)
			rec := newStepRecorder(nil)
			_, durl := servePod(t, Config{TimeScale: 1000, Role: RoleDecode, OnStep: rec.record})
			leg := roomLeg(prefill, jsonInput(900, 400), room)
			decodeAns := sendLeg(newClient(t), durl, leg)
			waitRoom(t, prefill, room, roomAwaited)
			tc.act(t, prefill, purl, leg)
			d := awaitLeg(t, decodeAns, false)
			if u := d.usage; u.PromptTokens != 400 || u.CompletionTokens != 8 || u.cached() != 0 {
				t.Errorf("decode usage %+v, want a local prefill of 400 tokens", u)
			}
			if got := prefillTokens(rec); got != 400 {
				t.Errorf("the decode pod computed %d prompt tokens, want 400", got)
			}
			if d.took > 5*time.Second {
				t.Errorf("the decode leg took %v: the failure did not reach its pull promptly", d.took)
			}
			checkDecode(t, durl, 0, 1)
		})
	}
}

// TestBootstrapPullStops checks that a decode pull waiting for a room ends
// promptly when its request is cancelled or the decode pod closes, and that
// a prefill pod closes promptly with a pull waiting.
func TestBootstrapPullStops(t *testing.T) {
	prefill, _ := servePod(t, Config{TimeScale: 1000, Role: RolePrefill})
	decode, durl := servePod(t, Config{TimeScale: 1000, Role: RoleDecode})
	submit := func(room uint64) *request {
		r := newRequest()
		ref := &kvRef{kind: refBootstrap, host: "127.0.0.1", port: sidePort(prefill), room: room}
		r.seqs = []*seq{{req: r, prompt: make([]uint32, 300), maxTokens: 4, remote: ref}}
		decode.eng.post(event{kind: evRequest, req: r})
		waitRoom(t, prefill, room, roomAwaited)
		return r
	}
	timed := func(what string, f func()) {
		t.Helper()
		start := time.Now()
		f()
		if took := time.Since(start); took > 2*time.Second {
			t.Errorf("%s took %v", what, took)
		}
	}

	r := submit(1)
	timed("the abort of a cancelled decode request", func() {
		r.cancel()
		decode.eng.post(event{kind: evNudge})
		for {
			r.mu.Lock()
			pub := r.seqs[0].pub
			r.mu.Unlock()
			if pub.finish != "" {
				if pub.finish != "abort" {
					t.Errorf("cancelled request finished with %q", pub.finish)
				}
				return
			}
			select {
			case <-r.wake:
			case <-time.After(5 * time.Second):
				t.Error("cancelled request never finished")
				return
			}
		}
	})
	checkDecode(t, durl, 0, 0)
	submit(2)
	timed("closing the decode pod", func() { decode.Close() })
	timed("closing the prefill pod", func() { prefill.Close() })
}

// TestBootstrapHoldExpires checks that a room nobody pulls expires like a
// NixlConnector hold, and that a late pull is told so at once.
func TestBootstrapHoldExpires(t *testing.T) {
	prefill, purl := servePod(t, Config{TimeScale: 1000, Role: RolePrefill, KVHoldTimeout: time.Nanosecond})
	c := newClient(t)
	awaitLeg(t, sendLeg(c, purl, roomLeg(prefill, jsonInput(1, 64), 99)), false)
	assertHoldExpired(t, c, prefill, purl)
	side := "http://" + prefill.SideChannelAddr() + bootstrapPullPath
	if code, _, body := post(t, c, side, `{"bootstrap_room":99,"num_tokens":64}`); code != 410 || !strings.Contains(string(body), "expired") {
		t.Errorf("late pull: %d %s, want 410 expired", code, body)
	}
}

// TestBootstrapServer checks the bootstrap server's answers.
func TestBootstrapServer(t *testing.T) {
	prefill, purl := servePod(t, Config{TimeScale: 1000, Role: RolePrefill, BootstrapWaitTimeout: 20 * time.Millisecond})
	decode, _ := servePod(t, Config{TimeScale: 1000, Role: RoleDecode})
	c := newClient(t)
	pull := func(p *Pod, body string) (int, string) {
		code, _, b := post(t, c, "http://"+p.SideChannelAddr()+bootstrapPullPath, body)
		return code, string(b)
	}
	leg := roomLeg(prefill, jsonInput(1, 64), 5)
	awaitLeg(t, sendLeg(c, purl, leg), false)
	if a := <-sendLeg(c, purl, leg); a.code != 400 || !strings.Contains(string(a.body), "in use") {
		t.Errorf("second prefill in a held room: %d %s, want 400", a.code, a.body)
	}
	tests := []struct {
		name string
		pod  *Pod
		body string
		code int
		msg  string
	}{
		{"not JSON", prefill, `{`, 400, "bad bootstrap pull"},
		{"no room", prefill, `{"num_tokens":64}`, 400, "bad bootstrap pull"},
		{"not a prefill pod", decode, `{"bootstrap_room":5,"num_tokens":64}`, 404, "a decode pod"},
		{"unknown room", prefill, `{"bootstrap_room":6,"num_tokens":64}`, 404, "no prefill request opened it"},
		{"token count mismatch", prefill, `{"bootstrap_room":5,"num_tokens":63}`, 400, "room has 64 tokens"},
		{"pulled already", prefill, `{"bootstrap_room":5,"num_tokens":64}`, 410, "pulled already"},
	}
	for _, tc := range tests {
		if code, body := pull(tc.pod, tc.body); code != tc.code || !strings.Contains(body, tc.msg) {
			t.Errorf("%s: %d %s, want %d %q", tc.name, code, body, tc.code, tc.msg)
		}
	}
	if h := prefill.Stats().HeldBlocks; h != 0 {
		t.Errorf("a failed pull left %d blocks held", h)
	}
	if code, _ := get(t, c, "http://"+prefill.SideChannelAddr()+bootstrapPullPath); code != 404 {
		t.Errorf("GET %s: %d", bootstrapPullPath, code)
	}
}

// TestBootstrapMixedIgnores checks that a mixed pod serves a body with
// bootstrap fields as a whole request.
func TestBootstrapMixedIgnores(t *testing.T) {
	p, url := servePod(t, Config{TimeScale: 1000})
	leg := roomLeg(p, jsonInput(1, 200), 3)
	r := awaitLeg(t, sendLeg(newClient(t), url, leg), false)
	if u := r.usage; u.PromptTokens != 200 || u.CompletionTokens != 8 || u.cached() != 0 {
		t.Errorf("usage %+v, want a whole local request", u)
	}
	checkDecode(t, url, 0, 0)
	p.eng.mu.Lock()
	n := len(p.eng.rooms)
	p.eng.mu.Unlock()
	if n != 0 {
		t.Errorf("a mixed pod opened %d rooms", n)
	}
}

func TestBootstrapBadFields(t *testing.T) {
	_, url := servePod(t, Config{TimeScale: 1000})
	c := newClient(t)
	const boot = `"bootstrap_host":"127.0.0.1","bootstrap_port":8998`
	tests := []struct{ name, body, msg string }{
		{"host not a string", `{"prompt":"x","bootstrap_host":1,"bootstrap_port":8998,"bootstrap_room":1}`, "bootstrap_host must be a non-empty string"},
		{"empty host", `{"prompt":"x","bootstrap_host":"","bootstrap_port":8998,"bootstrap_room":1}`, "bootstrap_host must be"},
		{"port a string", `{"prompt":"x","bootstrap_host":"h","bootstrap_port":"8998","bootstrap_room":1}`, "bootstrap_port must be a port number"},
		{"port out of range", `{"prompt":"x","bootstrap_host":"h","bootstrap_port":70000,"bootstrap_room":1}`, "bootstrap_port must be"},
		{"negative room", `{"prompt":"x",` + boot + `,"bootstrap_room":-1}`, "bootstrap_room must be a non-negative integer"},
		{"fractional room", `{"prompt":"x",` + boot + `,"bootstrap_room":1.5}`, "bootstrap_room must be"},
		{"room beyond 2^64", `{"prompt":"x",` + boot + `,"bootstrap_room":18446744073709551616}`, "bootstrap_room must be"},
		{"room a string", `{"prompt":"x",` + boot + `,"bootstrap_room":"1"}`, "bootstrap_room must be"},
		{"room without host", `{"prompt":"x","bootstrap_port":8998,"bootstrap_room":1}`, "go together"},
		{"room without port", `{"prompt":"x","bootstrap_host":"h","bootstrap_room":1}`, "go together"},
		{"host and port without room", `{"prompt":"x",` + boot + `}`, "go together"},
		{"one room for two prompts", `{"prompt":["a","b"],` + boot + `,"bootstrap_room":1}`, "one room per sequence"},
		{"n of 2", `{"prompt":"a","n":2,` + boot + `,"bootstrap_room":1}`, "one room per sequence"},
		{"short room list", `{"prompt":["a","b"],` + boot + `,"bootstrap_room":[1]}`, "bootstrap_room has 1 elements for 2 prompts"},
		{"long host list", `{"prompt":["a","b"],"bootstrap_host":["h","h","h"],"bootstrap_port":1,"bootstrap_room":[1,2]}`, "bootstrap_host has 3 elements"},
		{"bad list element", `{"prompt":["a","b"],` + boot + `,"bootstrap_room":[1,"2"]}`, "bootstrap_room[1] must be"},
		{"null port element", `{"prompt":["a","b"],"bootstrap_host":"h","bootstrap_port":[1,null],"bootstrap_room":[1,2]}`, "bootstrap_port[1] must be"},
		{"with kv_transfer_params", `{"prompt":"x",` + boot + `,"bootstrap_room":1,"kv_transfer_params":{"do_remote_decode":true}}`, "two prefill/decode protocols"},
	}
	for _, tc := range tests {
		code, _, body := post(t, c, url+"/v1/completions", tc.body)
		var e struct {
			Error struct {
				Message, Type string
				Code          int
			}
		}
		if err := json.Unmarshal(body, &e); err != nil || code != 400 || e.Error.Code != 400 || e.Error.Type != "BadRequestError" ||
			!strings.Contains(e.Error.Message, tc.msg) {
			t.Errorf("%s: %d %s, want 400 with %q", tc.name, code, body, tc.msg)
		}
	}
}

// TestParseBootstrap checks that rooms up to 2^64-1 parse exactly and that
// scalars serve every prompt.
func TestParseBootstrap(t *testing.T) {
	var p fastjson.Parser
	r, aerr := parseRequest(&p, []byte(`{"prompt":["a","b"],"bootstrap_host":"h","bootstrap_port":8998,`+
		`"bootstrap_room":[9223372036854775807,18446744073709551615]}`), false, 128256)
	if aerr != nil {
		t.Fatal(aerr.msg)
	}
	b := r.boot
	if b.rooms[0] != math.MaxInt64 || b.rooms[1] != math.MaxUint64 || b.hosts[1] != "h" || b.ports[1] != 8998 {
		t.Errorf("parsed %+v", b)
	}
	if ref := b.ref(1); ref.kind != refBootstrap || ref.room != math.MaxUint64 || ref.host != "h" || ref.port != 8998 {
		t.Errorf("ref %+v", ref)
	}
	r, aerr = parseRequest(&p, []byte(`{"messages":[{"role":"user","content":"x"}],"bootstrap_host":["h"],"bootstrap_port":[1],"bootstrap_room":[0],"bootstrap_extra":null}`), true, 128256)
	if aerr != nil || r.boot.rooms[0] != 0 {
		t.Errorf("chat with one-element lists: %+v %v", r, aerr)
	}
	r, aerr = parseRequest(&p, []byte(`{"prompt":"x","bootstrap_host":null,"bootstrap_port":null,"bootstrap_room":null}`), false, 128256)
	if aerr != nil || r.boot != nil {
		t.Errorf("null fields: %+v %v, want none", r, aerr)
	}
}

func TestSideChannelPort(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	p, _ := servePod(t, Config{TimeScale: 1000, SideChannelPort: port})
	if sidePort(p) != port {
		t.Errorf("side channel on %s, want port %d", p.SideChannelAddr(), port)
	}
	if _, err := New(Config{SideChannelPort: 70000}); err == nil {
		t.Error("port 70000 accepted")
	}
	c := DefaultConfig()
	if c.SideChannelPort != 0 || c.BootstrapWaitTimeout != 30*time.Second {
		t.Errorf("defaults: port %d, wait %v", c.SideChannelPort, c.BootstrapWaitTimeout)
	}
	fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
	c.BindFlags(fs)
	if err := fs.Parse([]string{"--side-channel-port", "8998", "--bootstrap-wait-timeout", "5s"}); err != nil ||
		c.SideChannelPort != 8998 || c.BootstrapWaitTimeout != 5*time.Second {
		t.Errorf("flags: %v, port %d, wait %v", err, c.SideChannelPort, c.BootstrapWaitTimeout)
	}
}
