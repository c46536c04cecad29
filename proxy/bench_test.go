package proxy

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/kvevents"
	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

// completionResponse is an instant backend's answer, shaped like vLLM's
// non-streaming /v1/completions body.
const completionResponse = `{"id":"cmpl-0","object":"text_completion","created":1748736946,"model":"m","choices":[{"index":0,"text":" a city in California.","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_logprobs":null}],"usage":{"prompt_tokens":256,"total_tokens":260,"completion_tokens":4,"prompt_tokens_details":null},"kv_transfer_params":null}`

// instantBackend is a fasthttp server on loopback that answers every
// request at once.
func instantBackend(tb testing.TB) string { return instantAnswer(tb, completionResponse) }

// instantAnswer is a fasthttp server on loopback that answers every
// request at once with the JSON answer.
func instantAnswer(tb testing.TB, answer string) string {
	return instantHandler(tb, func(ctx *fasthttp.RequestCtx) {
		ctx.SetContentType("application/json")
		ctx.SetBodyString(answer)
	})
}

// instantHandler is a fasthttp server on loopback serving h.
func instantHandler(tb testing.TB, h fasthttp.RequestHandler) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	s := &fasthttp.Server{Handler: h}
	go func() { _ = s.Serve(ln) }()
	tb.Cleanup(func() { _ = s.Shutdown() })
	return "http://" + ln.Addr().String()
}

// completionBody returns a /v1/completions body of about n bytes.
func completionBody(n int) []byte {
	prompt := strings.Repeat("The quick brown fox jumps over the lazy dog. ", n/45+1)[:n-60]
	b, _ := json.Marshal(map[string]any{"model": "m", "prompt": prompt, "max_tokens": 16})
	return b
}

// chatBody returns a /v1/chat/completions body of about n bytes: a long
// system prompt and a few turns.
func chatBody(n int) []byte {
	sys := strings.Repeat("You are a helpful assistant. Follow the policy below exactly. ", n/62+1)[:n-400]
	b, _ := json.Marshal(map[string]any{
		"model": "meta-llama/Llama-3.1-8B-Instruct",
		"messages": []map[string]any{
			{"role": "system", "content": sys},
			{"role": "user", "content": "Summarise the policy."},
			{"role": "assistant", "content": "It says to be helpful."},
			{"role": "user", "content": []map[string]any{{"type": "text", "text": "More detail, please."}}},
		},
		"max_tokens": 64, "stream": false,
	})
	return b
}

// BenchmarkHopLatency measures, in one run, the latency of the same request
// sent directly to an instant loopback backend and through kvroute, one
// request at a time, alternating, and reports the p50 and p99 of both and
// the added latency of the kvroute hop (parsing and hashing included).
func BenchmarkHopLatency(b *testing.B) {
	for _, size := range hopBodies {
		b.Run(size.name, func(b *testing.B) {
			backend := instantBackend(b)
			h := startProxy(b, routing.NewLeastRequest(nil), Options{Limits: Limits{MaxBodyBytes: 1 << 20}}, backend)
			d, v := alternate(b, size.path, size.body, backend, h.url)
			b.ReportMetric(pct(d, 0.5), "direct-p50-µs")
			b.ReportMetric(pct(v, 0.5), "kvroute-p50-µs")
			b.ReportMetric(pct(v, 0.5)-pct(d, 0.5), "added-p50-µs")
			b.ReportMetric(pct(v, 0.99)-pct(d, 0.99), "added-p99-µs")
		})
	}
}

// BenchmarkHopEngineTruth measures, in one run, the hop of kvroute
// without and with engine truth's tokenizer on the request path (each
// answered prompt checked for a link, a new one offered), one request at a
// time, alternating, and reports both p50s and their difference. The
// backend cannot tokenize, so a prompt is offered once and then only
// checked: the steady state of a fleet whose prompts recur.
func BenchmarkHopEngineTruth(b *testing.B) {
	for _, size := range hopBodies {
		b.Run(size.name, func(b *testing.B) {
			backend := instantBackend(b)
			opt := Options{Limits: Limits{MaxBodyBytes: 1 << 20}}
			off := startProxy(b, routing.NewLeastRequest(nil), opt, backend)
			truth := prefix.NewTruth(prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: 1024}), prefix.TruthConfig{BlockBytes: 1024})
			tok := kvevents.NewTokenizer(truth, kvevents.TokenizerConfig{})
			opt.Tokenizer = tok
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { defer close(done); tok.Run(ctx) }()
			b.Cleanup(func() { cancel(); <-done })
			on := startProxy(b, routing.NewLeastRequest(nil), opt, backend)
			x, y := alternate(b, size.path, size.body, off.url, on.url)
			b.ReportMetric(pct(x, 0.5), "off-p50-µs")
			b.ReportMetric(pct(y, 0.5), "on-p50-µs")
			b.ReportMetric(pct(y, 0.5)-pct(x, 0.5), "on-minus-off-p50-µs")
		})
	}
}

// hopBodies are the bodies the hop benchmarks send.
var hopBodies = []struct {
	name string
	path string
	body []byte
}{
	{"completion-1KiB", "/v1/completions", completionBody(1 << 10)},
	{"chat-128KiB", "/v1/chat/completions", chatBody(128 << 10)},
}

// alternate sends body to path at base URLs x and y, one request at a
// time, alternating: 200 of each to warm connections and pools, then b.N
// timed; it returns the sorted latencies of each.
func alternate(b *testing.B, path string, body []byte, x, y string) (xs, ys []time.Duration) {
	cx := &fasthttp.HostClient{Addr: strings.TrimPrefix(x, "http://"), MaxConns: 1}
	cy := &fasthttp.HostClient{Addr: strings.TrimPrefix(y, "http://"), MaxConns: 1}
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	req.Header.SetMethod("POST")
	req.Header.SetContentType("application/json")
	req.SetRequestURI(path)
	req.SetHost("kvroute.test")
	req.SetBody(body)
	do := func(c *fasthttp.HostClient) time.Duration {
		t0 := time.Now()
		if err := c.Do(req, resp); err != nil || resp.StatusCode() != 200 {
			b.Fatalf("%v %d %s", err, resp.StatusCode(), resp.Body())
		}
		return time.Since(t0)
	}
	for i := 0; i < 200; i++ {
		do(cx)
		do(cy)
	}
	xs, ys = make([]time.Duration, 0, b.N), make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		xs = append(xs, do(cx))
		ys = append(ys, do(cy))
	}
	b.StopTimer()
	slices.Sort(xs)
	slices.Sort(ys)
	return xs, ys
}

// pct returns the q-quantile of sorted latencies x in µs.
func pct(x []time.Duration, q float64) float64 {
	return float64(x[int(q*float64(len(x)-1))].Nanoseconds()) / 1e3
}

// BenchmarkParse compares kvroute's one-pass parse (fastjson, canonical
// rendering and block hashing included) with decoding the same body into a
// typed struct with encoding/json, which extracts less.
func BenchmarkParse(b *testing.B) {
	body := chatBody(128 << 10)
	for _, near := range []int{0, 2, 4} {
		// near > 0: with the near-identical prompt detector normalising
		// the first blocks (of 1 KiB) beside (default 2).
		b.Run(fmt.Sprintf("kvroute-128KiB-chat/near-miss-blocks=%d", near), func(b *testing.B) {
			var st reqState
			st.nearBlocks = near
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				st.req.Reset()
				if err := st.parse(routing.KindChat, body, 1024, 256); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	b.Run("encoding-json-128KiB-chat", func(b *testing.B) {
		type message struct {
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
		}
		var req struct {
			Model     string    `json:"model"`
			Messages  []message `json:"messages"`
			MaxTokens int       `json:"max_tokens"`
			Stream    bool      `json:"stream"`
		}
		b.SetBytes(int64(len(body)))
		b.ReportAllocs()
		for i := 0; i < b.N; i++ {
			if err := json.Unmarshal(body, &req); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func TestBenchBodiesAreTheAdvertisedSize(t *testing.T) {
	for _, c := range []struct {
		got, want int
	}{{len(completionBody(1 << 10)), 1 << 10}, {len(chatBody(128 << 10)), 128 << 10}} {
		if c.got < c.want*9/10 || c.got > c.want*11/10 {
			t.Errorf("body of %d bytes, want about %d", c.got, c.want)
		}
	}
}

// prefillAnswer is an instant prefill pod's answer: vLLM's, with a
// NixlConnector reference.
const prefillAnswer = `{"id":"cmpl-0","object":"text_completion","created":1748736946,"model":"m","choices":[{"index":0,"text":" a","logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":{"prompt_tokens":256,"total_tokens":257,"completion_tokens":1,"prompt_tokens_details":null},"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]],"remote_engine_id":"f2e8e2e0-e662-4568-a07b-c05a1e5e4ee5","remote_request_id":"cmpl-0-0","remote_host":"10.0.0.9","remote_port":5557,"tp_size":1}}`

// BenchmarkPDHop measures, in one run, the same request through kvroute
// to an instant decode pod alone (aggregated) and with a prefill leg to an
// instant prefill pod first (the vLLM protocol: the prefill body rewritten,
// the reference read and spliced into the decode body), one at a time,
// alternating; it reports what disaggregation adds: the second hop and the
// JSON work.
func BenchmarkPDHop(b *testing.B) {
	for _, size := range hopBodies {
		b.Run(size.name, func(b *testing.B) {
			decode, prefill := instantBackend(b), instantAnswer(b, prefillAnswer)
			agg := startPD(b, Options{}, pdPools{mixed: []string{decode}})
			pd := startPD(b, Options{PD: PDOptions{Decider: routing.PDDecider{MinUncachedTokens: 1}}},
				pdPools{prefill: []string{prefill}, decode: []string{decode}})
			a, p := alternate(b, size.path, size.body, agg.url, pd.url)
			if n := pdDecisions(b, pd, routing.PDSplit); int(n) != b.N+200 {
				b.Fatalf("%v of %d requests disaggregated", n, b.N+200)
			}
			b.ReportMetric(pct(a, 0.5), "aggregated-p50-µs")
			b.ReportMetric(pct(p, 0.5), "pd-p50-µs")
			b.ReportMetric(pct(p, 0.5)-pct(a, 0.5), "pd-added-p50-µs")
			b.ReportMetric(pct(p, 0.99)-pct(a, 0.99), "pd-added-p99-µs")
		})
	}
}

// BenchmarkPDLongPromptTTFT sends long new prompts one at a time through
// kvroute to a simulated prefill pod and decode pod in real time, and
// reports their time to first token against the cost model's sum of what
// disaggregation must take: the prefill pod's prefill step, the KV
// transfer and the decode pod's first step (the hop is what the ratio
// leaves). A decode pod that computed the prompt itself would take the
// same prefill again on top of the transfer-free first step, so a ratio
// near 1 also shows it did not.
func BenchmarkPDLongPromptTTFT(b *testing.B) {
	const tokens = 4096
	cfg := sim.Config{TimeScale: 1, Model: "m"}
	pre := cfg
	pre.Role = sim.RolePrefill
	dec := cfg
	dec.Role, dec.Seed = sim.RoleDecode, 1
	fleet, err := sim.StartFleetOf(pre, dec)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = fleet.Close() })
	h := startPD(b, Options{}, pdPools{prefill: []string{fleet.URL(0)}, decode: []string{fleet.URL(1)}})
	def := sim.DefaultConfig()
	// The prompt's tokens, approximately: the simulator tokenises the
	// text; its usage gives the exact count.
	var ttfts, models []float64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		body := pdCompletion(promptWords(fmt.Sprintf("n%d", i), tokens), true, `"stream_options":{"include_usage":true}`)
		t0 := time.Now()
		resp := post(b, h.url+"/v1/completions", body)
		br := bufio.NewReader(resp.Body)
		if _, err := br.ReadString('\n'); err != nil {
			b.Fatal(err)
		}
		ttft := time.Since(t0)
		rest, _ := io.ReadAll(br)
		resp.Body.Close()
		prompt, cached, _ := usageOf(b, "data: "+string(rest[strings.Index(string(rest), "data: ")+6:]))
		if cached != prompt-1 {
			b.Fatalf("decode pod computed the prompt: %d of %d cached", cached, prompt)
		}
		model := def.StepCost(prompt, prompt) + def.TransferCost(prompt-1) + def.StepCost(0, prompt)
		ttfts, models = append(ttfts, ttft.Seconds()), append(models, model.Seconds())
	}
	b.StopTimer()
	var sum, msum float64
	for i := range ttfts {
		sum, msum = sum+ttfts[i], msum+models[i]
	}
	b.ReportMetric(1000*sum/float64(len(ttfts)), "ttft-ms")
	b.ReportMetric(1000*msum/float64(len(models)), "model-ms")
	b.ReportMetric(sum/msum, "ttft/model")
}
