package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/textproto"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/valyala/fasthttp"

	"github.com/kvroute/kvroute/bench/llmd"
	"github.com/kvroute/kvroute/bench/sim"
)

// rawEndpoint is an engine on loopback whose answers a test writes by
// hand: serve gets each request's body and the connection, after the
// request was read.
type rawEndpoint struct {
	url    string
	mu     sync.Mutex
	bodies []string
	lines  []string // the requests' first lines
}

func startRawEndpoint(t *testing.T, serve func(c net.Conn, body []byte)) *rawEndpoint {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e := &rawEndpoint{url: "http://" + ln.Addr().String()}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(30 * time.Second))
				tp := textproto.NewReader(bufio.NewReader(c))
				for {
					line, err := tp.ReadLine()
					if err != nil {
						return
					}
					h, err := tp.ReadMIMEHeader()
					if err != nil {
						return
					}
					n, _ := strconv.Atoi(h.Get("Content-Length"))
					body := make([]byte, n)
					if _, err := io.ReadFull(tp.R, body); err != nil {
						return
					}
					e.mu.Lock()
					e.bodies, e.lines = append(e.bodies, string(body)), append(e.lines, line)
					e.mu.Unlock()
					serve(c, body)
				}
			}()
		}
	}()
	return e
}

func (e *rawEndpoint) received() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.bodies...)
}

// sseHead starts a chunked event stream; sseEvent writes one event as
// one chunk.
func sseHead(c net.Conn) {
	_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
}

func sseEvent(c net.Conn, ev string) {
	ev = "data: " + ev + "\n\n"
	_, _ = fmt.Fprintf(c, "%x\r\n%s\r\n", len(ev), ev)
}

func sseEnd(c net.Conn) {
	sseEvent(c, "[DONE]")
	_, _ = io.WriteString(c, "0\r\n\r\n")
}

// reset closes c with a TCP reset.
func reset(c net.Conn) {
	_ = c.(*net.TCPConn).SetLinger(0)
	_ = c.Close()
}

// chunkOf is a vLLM stream chunk of id with one token of text.
func chunkOf(chat bool, id, model, text string, finish string) string {
	fr := "null"
	if finish != "" {
		fr = strconv.Quote(finish)
	}
	t, _ := json.Marshal(text)
	if chat {
		return fmt.Sprintf(`{"id":%q,"object":"chat.completion.chunk","created":1700000001,"model":%q,"choices":[{"index":0,"delta":{"content":%s},"logprobs":null,"finish_reason":%s}]}`, id, model, t, fr)
	}
	return fmt.Sprintf(`{"id":%q,"object":"text_completion","created":1700000001,"model":%q,"choices":[{"index":0,"text":%s,"logprobs":null,"finish_reason":%s,"stop_reason":null}],"usage":null}`, id, model, t, fr)
}

// eachEvent calls f with the data of each event of the stream r, as it
// arrives.
func eachEvent(t *testing.T, r io.Reader, f func(data string)) {
	t.Helper()
	rd := bufio.NewReader(r)
	for {
		line, err := rd.ReadString('\n')
		if err == io.EOF {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		if d, ok := strings.CutPrefix(strings.TrimSpace(line), "data: "); ok {
			f(d)
		}
	}
}

// readStream reads a streamed answer through kvroute: the events' data.
func readStream(t *testing.T, url, body string) []string {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	var out []string
	for _, ev := range strings.Split(strings.TrimSuffix(string(b), "\n\n"), "\n\n") {
		d, ok := strings.CutPrefix(ev, "data: ")
		if !ok {
			t.Fatalf("event %q", ev)
		}
		out = append(out, d)
	}
	return out
}

// A stream whose endpoint fails after some tokens (reset, stalled past
// the idle timeout, an error event) is continued on another: the
// continuation's request is the original followed by exactly the text
// sent, with the tokens left; the client reads one stream with the first
// leg's id, created and model, the usage of both legs and one [DONE].
func TestMigrateContinuesTheText(t *testing.T) {
	for _, tc := range []migrateCase{
		{name: "completion reset", cause: "cut",
			body: `{"model":"m","prompt":"Say \"hi\"","max_tokens":5,"min_tokens":4,"stream":true,"stream_options":{"include_usage":true},"ignore_eos":true}`,
			fail: reset},
		{name: "chat closed early", cause: "cut", chat: true,
			body: `{"model":"m","messages":[{"role":"user","content":"Say hi"}],"max_completion_tokens":5,"stream":true,"stream_options":{"include_usage":true}}`,
			fail: func(c net.Conn) { _ = c.Close() }},
		{name: "completion stalled", cause: "timeout",
			body: `{"model":"m","prompt":"Say hi","max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}`,
			fail: func(c net.Conn) { time.Sleep(2 * time.Second) }},
		{name: "chat error event", cause: "error", chat: true,
			body: `{"model":"m","messages":[{"role":"user","content":"Say hi"}],"max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}`,
			fail: func(c net.Conn) {
				sseEvent(c, `{"error":{"message":"EngineCore died","type":"InternalServerError","param":null,"code":500}}`)
				sseEnd(c)
			}},
	} {
		t.Run(tc.name, tc.run)
	}
}

// migrateFirst is the text the first leg of TestMigrateContinuesTheText
// sends, a token an event, before it fails; migrateSent is its tokens.
var migrateFirst = []string{" Hello", ", \"w\u00f6rld\"", " \\n"}

const migrateSent = 3

// migrateCase is a stream (body, a chat's when chat) whose first leg fails
// after migrateFirst as fail makes it, a migration of cause.
type migrateCase struct {
	name, body, cause string
	chat              bool
	fail              func(c net.Conn)
}

func (tc migrateCase) run(t *testing.T) {
	a := startRawEndpoint(t, func(c net.Conn, _ []byte) {
		sseHead(c)
		if tc.chat {
			sseEvent(c, `{"id":"chatcmpl-A","object":"chat.completion.chunk","created":1700000001,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`)
		}
		for _, x := range migrateFirst {
			sseEvent(c, chunkOf(tc.chat, "cmpl-A", "m", x, ""))
		}
		tc.fail(c)
	})
	b := startRawEndpoint(t, func(c net.Conn, _ []byte) {
		sseHead(c)
		if tc.chat {
			sseEvent(c, `{"id":"chatcmpl-B","object":"chat.completion.chunk","created":1800000002,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`)
		}
		sseEvent(c, chunkOf(tc.chat, "cmpl-B", "m", " again", ""))
		sseEvent(c, chunkOf(tc.chat, "cmpl-B", "m", "!", "length"))
		sseEvent(c, `{"id":"cmpl-B","object":"chat.completion.chunk","created":1800000002,"model":"m","choices":[],"usage":{"prompt_tokens":12,"total_tokens":14,"completion_tokens":2}}`)
		sseEnd(c)
	})
	h := startProxy(t, fixedOrder{}, Options{Limits: Limits{MaxMigrations: 2, StreamIdleTimeout: 300 * time.Millisecond}}, a.url, b.url)
	path := "/v1/completions"
	if tc.chat {
		path = "/v1/chat/completions"
	}
	events := readStream(t, h.url+path, tc.body)
	tc.checkContinuation(t, b.received())
	checkOneStream(t, events)
	if v := counterValue(t, h.reg, "kvroute_migrations_total", map[string]string{"cause": tc.cause, "outcome": "continued"}); v != 1 {
		t.Errorf("kvroute_migrations_total{cause=%q,outcome=continued} = %v", tc.cause, v)
	}
}

// checkContinuation checks what the second endpoint was asked (got, the
// bodies it received): the original, the text sent, the tokens left.
func (tc migrateCase) checkContinuation(t *testing.T, got []string) {
	t.Helper()
	if len(got) != 1 {
		t.Fatalf("B received %d requests", len(got))
	}
	var req map[string]any
	if err := json.Unmarshal([]byte(got[0]), &req); err != nil {
		t.Fatalf("continuation body %s: %v", got[0], err)
	}
	text := strings.Join(migrateFirst, "")
	if tc.chat {
		msgs := req["messages"].([]any)
		last := msgs[len(msgs)-1].(map[string]any)
		if len(msgs) != 2 || last["role"] != "assistant" || last["content"] != text ||
			req["continue_final_message"] != true || req["add_generation_prompt"] != false {
			t.Errorf("chat continuation %s", got[0])
		}
	} else if req["prompt"] != `Say "hi"`+text && req["prompt"] != "Say hi"+text {
		t.Errorf("prompt %q, want the original followed by %q", req["prompt"], text)
	}
	for _, k := range []string{"max_tokens", "max_completion_tokens", "min_tokens"} {
		var orig map[string]any
		_ = json.Unmarshal([]byte(tc.body), &orig)
		if v, ok := orig[k]; ok && req[k] != v.(float64)-migrateSent {
			t.Errorf("%s %v, want %v", k, req[k], v.(float64)-migrateSent)
		}
	}
	if req["stream"] != true || req["model"] != "m" {
		t.Errorf("continuation %s", got[0])
	}
}

// checkOneStream checks what the client read (events): one stream, with
// the first leg's id, created and model, the text of both legs, the usage
// of both and one [DONE].
func checkOneStream(t *testing.T, events []string) {
	t.Helper()
	var all string
	done, usage := 0, 0
	for _, ev := range events {
		if ev == "[DONE]" {
			done++
			continue
		}
		var c struct {
			ID, Model string
			Created   int
			Error     any
			Choices   []struct {
				Text  string
				Delta struct{ Content string }
			}
			Usage *struct {
				PromptTokens     int `json:"prompt_tokens"`
				CompletionTokens int `json:"completion_tokens"`
				TotalTokens      int `json:"total_tokens"`
			} `json:"usage"`
		}
		if err := json.Unmarshal([]byte(ev), &c); err != nil {
			t.Fatalf("event %q: %v", ev, err)
		}
		if c.Error != nil {
			t.Fatalf("the client got an error event: %s", ev)
		}
		if (c.ID != "cmpl-A" && c.ID != "chatcmpl-A") || c.Created != 1700000001 || c.Model != "m" {
			t.Errorf("event of another stream: %s", ev)
		}
		for _, ch := range c.Choices {
			all += ch.Text + ch.Delta.Content
		}
		if c.Usage != nil {
			usage++
			if c.Usage.CompletionTokens != migrateSent+2 || c.Usage.PromptTokens != 12-migrateSent || c.Usage.TotalTokens != 12+2 {
				t.Errorf("usage %+v", *c.Usage)
			}
		}
	}
	if text := strings.Join(migrateFirst, ""); all != text+" again!" || done != 1 || usage != 1 {
		t.Errorf("text %q, %d [DONE], %d usage chunks", all, done, usage)
	}
}

// What cannot be continued faithfully ends as before, with the error
// event: two choices, log probabilities, migrations off.
func TestMigrateOnlyWhatContinues(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		max        int
	}{
		{"two choices", `{"model":"m","prompt":"x","n":2,"stream":true}`, 2},
		{"logprobs", `{"model":"m","prompt":"x","logprobs":1,"stream":true}`, 2},
		{"token ids", `{"model":"m","prompt":[1,2,3],"stream":true}`, 2},
		{"off", `{"model":"m","prompt":"x","stream":true}`, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := startRawEndpoint(t, func(c net.Conn, _ []byte) {
				sseHead(c)
				sseEvent(c, chunkOf(false, "cmpl-A", "m", " one", ""))
				reset(c)
			})
			b := startRawEndpoint(t, func(c net.Conn, _ []byte) { t.Error("B was asked to continue") })
			h := startProxy(t, fixedOrder{}, Options{Limits: Limits{MaxMigrations: tc.max}}, a.url, b.url)
			events := readStream(t, h.url+"/v1/completions", tc.body)
			if len(events) < 3 || !strings.Contains(events[len(events)-2], "upstream_stream_cut") || events[len(events)-1] != "[DONE]" {
				t.Errorf("events %q, want the cut's error event and [DONE]", events)
			}
		})
	}
}

// On the simulated engine: a pod that drops every stream after 5 tokens
// beside a healthy one, each behind a tap that records what it received
// and sent. Every client stream, completion or chat, read with the OpenAI
// SDK, completes with max_tokens completion tokens, finish_reason length
// and no error; the healthy pod was given the prompt followed by exactly
// the failing pod's text, and the client read the failing pod's text
// followed by the healthy pod's.
func TestMigrateOnTheSimulator(t *testing.T) {
	cfg := sim.DefaultConfig()
	cfg.TimeScale = 100
	cfg.Model = "m"
	fleet := startSimFleet(t, 2, cfg)
	if err := fleet.Pod(0).SetFaults(sim.Faults{DropAfterTokens: 5}); err != nil {
		t.Fatal(err)
	}
	taps := []*tap{startTap(t, fleet.URL(0)), startTap(t, fleet.URL(1))}
	h := startProxy(t, fixedOrder{}, Options{Limits: Limits{MaxMigrations: 2}}, taps[0].url, taps[1].url)
	client := openai.NewClient(option.WithBaseURL(h.url+"/v1"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const maxTokens = 16
	for i := range 3 {
		stream := client.Completions.NewStreaming(ctx, openai.CompletionNewParams{
			Model:         openai.CompletionNewParamsModel("m"),
			Prompt:        openai.CompletionNewParamsPromptUnion{OfString: openai.String(fmt.Sprintf("Request %d: tell a story. ", i))},
			MaxTokens:     openai.Int(maxTokens),
			StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
		}, option.WithJSONSet("ignore_eos", true))
		var text, finish, id string
		var completion int64
		for stream.Next() {
			c := stream.Current()
			if id == "" {
				id = c.ID
			}
			if c.ID != id {
				t.Fatalf("stream %d: chunk of %s in the stream of %s", i, c.ID, id)
			}
			for _, ch := range c.Choices {
				text += ch.Text
				if ch.FinishReason != "" {
					finish = string(ch.FinishReason)
				}
			}
			if c.Usage.CompletionTokens > 0 {
				completion = c.Usage.CompletionTokens
			}
		}
		if err := stream.Err(); err != nil {
			t.Fatalf("completion stream %d: %v", i, err)
		}
		if completion != maxTokens || finish != "length" || text == "" {
			t.Errorf("completion stream %d: %d completion tokens, finish %q, text %q", i, completion, finish, text)
		}
		checkLegs(t, taps[0].exchange(t, 2*i), taps[1].exchange(t, 2*i), false, fmt.Sprintf("Request %d: tell a story. ", i), text)

		chat := client.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
			Model:               "m",
			Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage(fmt.Sprintf("Chat %d: tell a story.", i))},
			MaxCompletionTokens: openai.Int(maxTokens),
			StreamOptions:       openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
		}, option.WithJSONSet("ignore_eos", true))
		var acc openai.ChatCompletionAccumulator
		for chat.Next() {
			acc.AddChunk(chat.Current())
		}
		if err := chat.Err(); err != nil {
			t.Fatalf("chat stream %d: %v", i, err)
		}
		if acc.Usage.CompletionTokens != maxTokens || len(acc.Choices) != 1 || acc.Choices[0].FinishReason != "length" || acc.Choices[0].Message.Content == "" {
			t.Errorf("chat stream %d: usage %+v, choices %+v", i, acc.Usage, acc.Choices)
		}
		checkLegs(t, taps[0].exchange(t, 2*i+1), taps[1].exchange(t, 2*i+1), true, "", acc.Choices[0].Message.Content)
	}
	if v := counterValue(t, h.reg, "kvroute_migrations_total", map[string]string{"cause": "cut", "outcome": "continued"}); v != 6 {
		t.Errorf("%v streams continued, want 6 (every one started on the failing pod)", v)
	}
	h.waitIdle(t)
}

// A continuation that cannot start (the other endpoint answers 500, or
// sends an error event itself) ends the stream as a cut one ends: the
// client gets the text it had, one error event and one [DONE].
func TestMigrateFailsVisibly(t *testing.T) {
	for _, tc := range []struct {
		name string
		b    func(c net.Conn)
	}{
		{"continuation refused", func(c net.Conn) {
			_, _ = io.WriteString(c, "HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
		}},
		{"continuation fails too", func(c net.Conn) {
			sseHead(c)
			sseEvent(c, chunkOf(false, "cmpl-B", "m", " two", ""))
			reset(c)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := startRawEndpoint(t, func(c net.Conn, _ []byte) {
				sseHead(c)
				sseEvent(c, chunkOf(false, "cmpl-A", "m", " one", ""))
				reset(c)
			})
			b := startRawEndpoint(t, func(c net.Conn, _ []byte) { tc.b(c) })
			h := startProxy(t, fixedOrder{}, Options{Limits: Limits{MaxMigrations: 1}}, a.url, b.url)
			events := readStream(t, h.url+"/v1/completions", `{"model":"m","prompt":"x","stream":true}`)
			text, cuts, done := "", 0, 0
			for _, ev := range events {
				switch {
				case ev == "[DONE]":
					done++
				case strings.Contains(ev, "upstream_stream_cut"):
					cuts++
				default:
					var c struct{ Choices []struct{ Text string } }
					if err := json.Unmarshal([]byte(ev), &c); err != nil {
						t.Fatalf("event %q: %v", ev, err)
					}
					for _, ch := range c.Choices {
						text += ch.Text
					}
				}
			}
			if cuts != 1 || done != 1 || !strings.HasPrefix(text, " one") {
				t.Errorf("events %q", events)
			}
			h.waitIdle(t)
		})
	}
}

// On the external engine (llm-d's simulator, where ../shared has it): a
// pod killed mid-stream (SIGKILL, its connections reset), stalled past the
// stream-idle timeout, or leaving discovery. The completion and the chat
// it was streaming complete on the other pod with max_tokens completion
// tokens, finish_reason length and no error event, and the text is the
// first pod's followed by the other's (taps in front of both record what
// they received and sent).
func TestMigrateOnTheExternalSimulator(t *testing.T) {
	bin, err := llmd.Binary("")
	if errors.Is(err, llmd.ErrNoBinary) {
		t.Skipf("external engine absent: %v", err)
	} else if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ fault, cause string }{{"killed", "cut"}, {"stalled", "timeout"}, {"left", "drained"}} {
		for _, chat := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/chat=%v", tc.fault, chat), func(t *testing.T) { migrateOnLLMD(t, bin, tc.fault, tc.cause, chat) })
		}
	}
}

// migrateOnLLMD runs one stream over two llm-d pods, the first of which
// fails after 5 events as fault says: killed (SIGKILL), stalled (its tap
// stops passing bytes on: the stream-idle timeout) or left (it leaves
// discovery).
func migrateOnLLMD(t *testing.T, bin, fault, cause string, chat bool) {
	s := llmd.Settings{Model: "sim-model", BlockSize: 16, KVBlocks: 1024, MaxNumSeqs: 8, MaxModelLen: 4096,
		PrefillOverhead: time.Millisecond, PrefillPerToken: 10 * time.Microsecond, InterTokenLatency: 20 * time.Millisecond, Seed: 1}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	fleet, err := llmd.Start(ctx, bin, []llmd.Settings{s, s})
	if err != nil {
		t.Fatal(err)
	}
	defer fleet.Close()
	urls := fleet.URLs()
	taps := []*tap{startTap(t, urls[0]), startTap(t, urls[1])}
	h := startProxy(t, fixedOrder{}, Options{Limits: Limits{MaxMigrations: 2, StreamIdleTimeout: 300 * time.Millisecond}}, taps[0].url, taps[1].url)
	const maxTokens = 30
	path, body := "/v1/completions", fmt.Sprintf(`{"model":"sim-model","prompt":"tell a long story about the sea","max_tokens":%d,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`, maxTokens)
	if chat {
		path, body = "/v1/chat/completions", fmt.Sprintf(`{"model":"sim-model","messages":[{"role":"user","content":"tell a long story about the sea"}],"max_tokens":%d,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`, maxTokens)
	}
	resp, err := http.Post(h.url+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var events []string
	killed := false
	eachEvent(t, resp.Body, func(d string) {
		events = append(events, d)
		if len(events) == 5 && !killed {
			switch fault {
			case "killed":
				if err := fleet.Kill(0); err != nil {
					t.Fatal(err)
				}
			case "stalled":
				taps[0].frozen.Store(true)
			case "left":
				h.pool.Publish(h.pool.Load().Endpoints[1:])
			}
			killed = true
		}
	})
	var completion int
	var finish, text string
	done := 0
	for _, ev := range events {
		if ev == "[DONE]" {
			done++
			continue
		}
		var c struct {
			Error   any
			Choices []struct {
				Text         string
				Delta        struct{ Content string }
				FinishReason string `json:"finish_reason"`
			}
			Usage *struct {
				CompletionTokens int `json:"completion_tokens"`
			}
		}
		if err := json.Unmarshal([]byte(ev), &c); err != nil || c.Error != nil {
			t.Fatalf("event %q: %v", ev, err)
		}
		for _, ch := range c.Choices {
			text += ch.Text + ch.Delta.Content
			if ch.FinishReason != "" {
				finish = ch.FinishReason
			}
		}
		if c.Usage != nil {
			completion = c.Usage.CompletionTokens
		}
	}
	if !killed || completion != maxTokens || finish != "length" || done != 1 || text == "" {
		t.Errorf("killed %v: %d completion tokens, finish %q, %d [DONE]; text %q", killed, completion, finish, done, text)
	}
	prompt := "tell a long story about the sea"
	if chat {
		prompt = ""
	}
	checkLegs(t, taps[0].exchange(t, 0), taps[1].exchange(t, 0), chat, prompt, text)
	if v := counterValue(t, h.reg, "kvroute_migrations_total", map[string]string{"cause": cause, "outcome": "continued"}); v != 1 {
		t.Errorf("%v streams continued for cause %s, want 1", v, cause)
	}
}

// A pod that leaves discovery while it streams (a rollout, a scale-down)
// hands its stream over: within the watcher's round the stream moves to
// another pod and completes there, text-exact in length.
func TestMigrateWhenTheEndpointLeaves(t *testing.T) {
	cfg := sim.DefaultConfig()
	cfg.Model = "m" // real time: about 10 ms a token
	fleet := startSimFleet(t, 2, cfg)
	h := startProxy(t, fixedOrder{}, Options{Limits: Limits{MaxMigrations: 2}}, fleet.URLs()...)
	const maxTokens = 150
	resp, err := http.Post(h.url+"/v1/completions", "application/json", strings.NewReader(fmt.Sprintf(
		`{"model":"m","prompt":"tell a long story","max_tokens":%d,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`, maxTokens)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	events, completion, left := 0, 0, false
	eachEvent(t, resp.Body, func(d string) {
		if d == "[DONE]" {
			return
		}
		var c struct {
			Error   any
			Choices []struct{ Text string }
			Usage   *struct {
				CompletionTokens int `json:"completion_tokens"`
			}
		}
		if err := json.Unmarshal([]byte(d), &c); err != nil || c.Error != nil {
			t.Fatalf("event %q: %v", d, err)
		}
		if c.Usage != nil {
			completion = c.Usage.CompletionTokens
		}
		if events++; events == 5 && !left {
			h.pool.Publish(h.pool.Load().Endpoints[1:]) // the first pod leaves
			left = true
		}
	})
	if completion != maxTokens {
		t.Errorf("%d completion tokens, want %d", completion, maxTokens)
	}
	if v := counterValue(t, h.reg, "kvroute_migrations_total", map[string]string{"cause": "drained", "outcome": "continued"}); v != 1 {
		t.Errorf("%v streams moved off the pod that left, want 1", v)
	}
}

// Control bytes in the prompt and in the continuation's text stay valid
// JSON in the continuation's body and in the events the client reads
// (fastjson's own marshalling writes an unescaped string's control bytes
// as Go escapes, \x01).
func TestMigrateKeepsJSONValid(t *testing.T) {
	a := startRawEndpoint(t, func(c net.Conn, _ []byte) {
		sseHead(c)
		sseEvent(c, chunkOf(false, "cmpl-A", "m", "\x02one", ""))
		reset(c)
	})
	b := startRawEndpoint(t, func(c net.Conn, _ []byte) {
		sseHead(c)
		sseEvent(c, chunkOf(false, "cmpl-B", "m", "\x1b[1m two", "length"))
		sseEnd(c)
	})
	// Behind base paths: the continuation goes to the second's.
	h := startProxy(t, fixedOrder{}, Options{Limits: Limits{MaxMigrations: 1}}, a.url+"/a", b.url+"/b")
	events := readStream(t, h.url+"/v1/completions", `{"model":"m","prompt":"x\u0001y","max_tokens":2,"stream":true}`)
	b.mu.Lock()
	lines := b.lines
	b.mu.Unlock()
	if len(lines) != 1 || lines[0] != "POST /b/v1/completions HTTP/1.1" {
		t.Errorf("the continuation's request line %q", lines)
	}
	var req struct{ Prompt string }
	if got := b.received(); len(got) != 1 || json.Unmarshal([]byte(got[0]), &req) != nil || req.Prompt != "x\x01y\x02one" {
		t.Fatalf("continuation %q: prompt %q", got, req.Prompt)
	}
	text := ""
	for _, ev := range events[:len(events)-1] {
		var c struct{ Choices []struct{ Text string } }
		if err := json.Unmarshal([]byte(ev), &c); err != nil {
			t.Fatalf("event %q: %v", ev, err)
		}
		text += c.Choices[0].Text
	}
	if text != "\x02one\x1b[1m two" || events[len(events)-1] != "[DONE]" {
		t.Errorf("text %q, events %q", text, events)
	}
}

// Whatever an endpoint streams, following and rewriting its events never
// panics, and an event of valid JSON is rewritten into valid JSON.
func FuzzStreamTrack(f *testing.F) {
	f.Add([]byte("data: "+chunkOf(false, "cmpl-A", "m", " hi", "")+"\n\ndata: [DONE]\n\n"), true)
	f.Add([]byte("data: "+chunkOf(true, "c", "m", "\"x\\", "stop")+"\r\n\r\ndata: {\"error\":{}}\n\n"), false)
	f.Add([]byte("data: {\"id\":\"a\",\"choices\":[{\"delta\":{\"content\":\"\\u0001\"}}],\"usage\":{\"prompt_tokens\":3}}\n\n"), true)
	f.Fuzz(func(t *testing.T, stream []byte, chat bool) {
		var lead, cont streamTrack
		lead.reset(true, chat)
		cont.reset(true, chat)
		cont.rewrite = true
		cont.leg1 = nil
		for p := stream; len(p) > 0; {
			n := eventEnd(p)
			if n < 0 {
				break
			}
			lead.follow(p[:n])
			cont.out = cont.out[:0]
			if cont.rewriteEvent(p[:n]) && len(cont.out) > 0 {
				in, _ := bytes.CutPrefix(p[:n], []byte("data: "))
				if d, ok := bytes.CutPrefix(cont.out, []byte("data: ")); ok && json.Valid(bytes.TrimSpace(in)) {
					if !json.Valid(bytes.TrimSpace(d)) {
						t.Fatalf("rewritten %q into invalid JSON %q", p[:n], cont.out)
					}
				}
			}
			p = p[n:]
		}
		if len(lead.text) > len(stream) {
			t.Fatalf("text %d bytes from a %d-byte stream", len(lead.text), len(stream))
		}
	})
}

// checkLegs checks a migrated answer against what its two pods received
// and sent: the second pod was given the prompt followed by the text the
// first pod sent (a chat: that text as the assistant's message) — all of
// it, or, when kvroute left the first pod while it still sent, a
// beginning of it — and the client read (got) exactly that text followed
// by the second pod's.
func checkLegs(t *testing.T, first, second *tapExchange, chat bool, prompt, got string) {
	t.Helper()
	var body struct {
		Prompt   string
		Messages []struct{ Role, Content string }
	}
	if err := json.Unmarshal([]byte(second.request), &body); err != nil {
		t.Fatalf("continuation %s: %v", second.request, err)
	}
	given := body.Prompt
	if chat {
		last := body.Messages[len(body.Messages)-1]
		if len(body.Messages) != 2 || last.Role != "assistant" {
			t.Fatalf("continuation %s", second.request)
		}
		given = last.Content
	}
	sent, ok := strings.CutPrefix(given, prompt)
	if !ok || sent == "" || !strings.HasPrefix(first.text, sent) {
		t.Errorf("the second pod was given %q, want %q followed by (a beginning of) the first pod's text %q", given, prompt, first.text)
	}
	if got != sent+second.text {
		t.Errorf("the client read %q, want %q + %q", got, sent, second.text)
	}
}

// tap is a reverse proxy in front of an engine that records, for each
// request, its body and the answer's bytes it passed on (up to a cut).
type tap struct {
	url    string
	frozen atomic.Bool   // stop passing answers on (a stall), until the test ends
	thaw   chan struct{} // closed when the test ends
	mu     sync.Mutex
	ex     []*tapExchange
}

type tapExchange struct {
	request string
	answer  bytes.Buffer
	text    string // the answer's text, once read (exchange)
}

func startTap(t *testing.T, target string) *tap {
	t.Helper()
	tp := &tap{thaw: make(chan struct{})}
	hc := &fasthttp.HostClient{Addr: strings.TrimPrefix(target, "http://"), StreamResponseBody: true}
	tp.url = instantHandler(t, func(ctx *fasthttp.RequestCtx) {
		x := &tapExchange{request: string(ctx.PostBody())}
		tp.mu.Lock()
		tp.ex = append(tp.ex, x)
		tp.mu.Unlock()
		resp := fasthttp.AcquireResponse()
		if err := hc.Do(&ctx.Request, resp); err != nil {
			fasthttp.ReleaseResponse(resp)
			ctx.Error(err.Error(), fasthttp.StatusBadGateway)
			return
		}
		resp.Header.CopyTo(&ctx.Response.Header)
		ctx.Response.SetBodyStream(&tapBody{tp: tp, x: x, resp: resp}, -1)
	})
	t.Cleanup(func() { close(tp.thaw) }) // before the tap's server shuts down
	return tp
}

// tapBody passes an answer on and records it.
type tapBody struct {
	tp   *tap
	x    *tapExchange
	resp *fasthttp.Response
}

func (b *tapBody) Read(p []byte) (int, error) {
	if b.tp.frozen.Load() {
		<-b.tp.thaw
		return 0, io.ErrUnexpectedEOF
	}
	n, err := b.resp.BodyStream().Read(p)
	b.tp.mu.Lock()
	b.x.answer.Write(p[:n])
	b.tp.mu.Unlock()
	return n, err
}

func (b *tapBody) Close() error {
	err := b.resp.CloseBodyStream()
	fasthttp.ReleaseResponse(b.resp)
	return err
}

// exchange returns the n-th exchange, its answer's text read from its
// complete events (a completion's text or a chat's content).
func (tp *tap) exchange(t *testing.T, n int) *tapExchange {
	t.Helper()
	tp.mu.Lock()
	defer tp.mu.Unlock()
	if n >= len(tp.ex) {
		t.Fatalf("the pod saw %d requests, not %d", len(tp.ex), n+1)
	}
	x := tp.ex[n]
	x.text = ""
	for _, ev := range strings.Split(x.answer.String(), "\n\n") {
		d, ok := strings.CutPrefix(ev, "data: ")
		if !ok || d == "[DONE]" {
			continue
		}
		var c struct {
			Choices []struct {
				Text  string
				Delta struct{ Content string }
			}
		}
		if json.Unmarshal([]byte(d), &c) == nil {
			for _, ch := range c.Choices {
				x.text += ch.Text + ch.Delta.Content
			}
		}
	}
	return x
}

// A whole (not streamed) answer whose endpoint fails between its header
// and its body reaches the client from another endpoint, whole: nothing
// had been passed on.
func TestWholeAnswerRetriedAfterItsHeader(t *testing.T) {
	a := startRawEndpoint(t, func(c net.Conn, _ []byte) {
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
		reset(c)
	})
	const answer = `{"id":"cmpl-B","object":"text_completion","choices":[{"index":0,"text":" fine","finish_reason":"length"}]}`
	b := startRawEndpoint(t, func(c net.Conn, _ []byte) {
		_, _ = fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(answer), answer)
	})
	h := startProxy(t, fixedOrder{}, Options{Limits: Limits{Retries: 2}}, a.url, b.url)
	resp, err := http.Post(h.url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"x"}`))
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 200 || string(got) != answer {
		t.Fatalf("%d %q %v", resp.StatusCode, got, err)
	}
	if len(a.received()) != 1 || len(b.received()) != 1 {
		t.Errorf("requests: %d to the failing endpoint, %d to the other", len(a.received()), len(b.received()))
	}
	h.waitIdle(t)
}

// An engine's error event mid-stream that no other endpoint can continue
// (here there is none) reaches the client as the engine wrote it: its
// reason (llama-server's "Context size has been exceeded"), then [DONE].
func TestEngineErrorEventReachesTheClient(t *testing.T) {
	const engineErr = `{"error":{"code":500,"message":"Context size has been exceeded.","type":"server_error"}}`
	a := startRawEndpoint(t, func(c net.Conn, _ []byte) {
		sseHead(c)
		sseEvent(c, chunkOf(false, "cmpl-A", "m", " one", ""))
		sseEvent(c, engineErr)
		_, _ = io.WriteString(c, "0\r\n\r\n")
	})
	h := startProxy(t, fixedOrder{}, Options{Limits: Limits{MaxMigrations: 1}}, a.url)
	events := readStream(t, h.url+"/v1/completions", `{"model":"m","prompt":"x","stream":true}`)
	if len(events) != 3 || !strings.Contains(events[0], " one") || events[1] != engineErr || events[2] != "[DONE]" {
		t.Errorf("events %q; want the token, the engine's error event, [DONE]", events)
	}
	h.waitIdle(t)
}
