package sim

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestStepCostDerivation(t *testing.T) {
	cfg := DefaultConfig()
	tests := []struct {
		name          string
		prefill, ctx  int
		lo, hi        time.Duration
		documentation string
	}{
		{name: "decode batch 1, 2k context", ctx: 2048, lo: 6 * time.Millisecond, hi: 7 * time.Millisecond},
		{name: "decode batch 64, 2k contexts", ctx: 64 * 2048, lo: 14 * time.Millisecond, hi: 16 * time.Millisecond},
		{name: "prefill 2048 cold", prefill: 2048, ctx: 2048, lo: 115 * time.Millisecond, hi: 130 * time.Millisecond},
		{name: "prefill 8192 budget", prefill: 8192, ctx: 8192, lo: 420 * time.Millisecond, hi: 440 * time.Millisecond},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if d := cfg.StepCost(tc.prefill, tc.ctx); d < tc.lo || d > tc.hi {
				t.Errorf("StepCost(%d, %d) = %v, want [%v, %v]", tc.prefill, tc.ctx, d, tc.lo, tc.hi)
			}
		})
	}
	if d := cfg.TransferCost(2047); d < 7*time.Millisecond || d > 9*time.Millisecond {
		t.Errorf("TransferCost(2047) = %v, want ≈ 7.7 ms", d)
	}
}

// ttftOf runs one non-streaming request and returns its modelled TTFT (from
// the pod's histogram) and its usage.
func ttftOf(t *testing.T, c *http.Client, url, path, body string) (time.Duration, usageJSON) {
	t.Helper()
	before := scrape(t, c, url)
	code, _, resp := post(t, c, url+path, body)
	if code != 200 {
		t.Fatalf("status %d: %s", code, resp)
	}
	after := scrape(t, c, url)
	if n := histCount(t, after, "vllm:time_to_first_token_seconds") - histCount(t, before, "vllm:time_to_first_token_seconds"); n != 1 {
		t.Fatalf("%d TTFT observations, want 1", n)
	}
	sec := metricValue(t, after, "vllm:time_to_first_token_seconds") - metricValue(t, before, "vllm:time_to_first_token_seconds")
	return time.Duration(sec * float64(time.Second)), decodeCompletion(t, resp).Usage
}

func TestPrefixCacheTTFT(t *testing.T) {
	ids, _ := json.Marshal(tokenPrompt(1000, 2048))
	text := SyntheticText(2048, 7)
	tests := []struct {
		name, path, body string
		prompt           int
	}{
		{name: "token ids", path: "/v1/completions", prompt: 2048,
			body: `{"prompt":` + string(ids) + `,"max_tokens":1}`},
		{name: "text", path: "/v1/completions", prompt: 2048,
			body: `{"prompt":"` + text + `","max_tokens":1}`},
		{name: "chat", path: "/v1/chat/completions", prompt: CountTokens(ChatBOS + ChatStart + "user" + ChatEnd + text + ChatEOT + ChatGenHdr),
			body: `{"messages":[{"role":"user","content":"` + text + `"}],"max_tokens":1}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, url := servePod(t, Config{TimeScale: 100})
			c := newClient(t)
			cold, u1 := ttftOf(t, c, url, tc.path, tc.body)
			warm, u2 := ttftOf(t, c, url, tc.path, tc.body)
			if u1.PromptTokens != tc.prompt || u2.PromptTokens != tc.prompt {
				t.Fatalf("prompt tokens %d, %d; want %d", u1.PromptTokens, u2.PromptTokens, tc.prompt)
			}
			wantCached := (tc.prompt - 1) / 16 * 16
			if u1.cached() != 0 || u2.cached() != wantCached {
				t.Errorf("cached tokens %d then %d, want 0 then %d", u1.cached(), u2.cached(), wantCached)
			}
			if cold < 5*warm {
				t.Errorf("cold TTFT %v, warm %v: want ≥ 5× lower", cold, warm)
			}
			m := scrape(t, c, url)
			if q := metricValue(t, m, "vllm:prefix_cache_queries_total"); q != float64(2*tc.prompt) {
				t.Errorf("prefix queries %v, want %d", q, 2*tc.prompt)
			}
			if h := metricValue(t, m, "vllm:prefix_cache_hits_total"); h != float64(u1.cached()+u2.cached()) {
				t.Errorf("prefix hits %v, usage says %d", h, u1.cached()+u2.cached())
			}
			if k := metricValue(t, m, "vllm:kv_cache_usage_perc"); k != 0 {
				t.Errorf("kv usage %v after all requests finished", k)
			}
		})
	}
}

func TestMultiTurnChatHitsPreviousAnswer(t *testing.T) {
	_, url := servePod(t, fastConfig())
	c := newClient(t)
	user1 := SyntheticText(300, 1)
	code, _, body := post(t, c, url+"/v1/chat/completions", map[string]any{
		"messages": []map[string]string{{"role": "user", "content": user1}}, "max_tokens": 40})
	if code != 200 {
		t.Fatalf("%d %s", code, body)
	}
	r1 := decodeCompletion(t, body)
	answer := r1.Choices[0].Message.Content
	if n := CountTokens(answer); n != 40 {
		t.Fatalf("answer %q has %d tokens, want 40", answer, n)
	}
	code, _, body = post(t, c, url+"/v1/chat/completions", map[string]any{
		"messages": []map[string]string{{"role": "user", "content": user1}, {"role": "assistant", "content": answer},
			{"role": "user", "content": "and then?"}}, "max_tokens": 4})
	if code != 200 {
		t.Fatalf("%d %s", code, body)
	}
	r2 := decodeCompletion(t, body)
	// Turn 1 computed its prompt and all but its last generated token.
	want := (r1.Usage.PromptTokens + 40 - 1) / 16 * 16
	if got := r2.Usage.cached(); got != want {
		t.Errorf("turn 2 cached %d tokens, want %d (turn 1: %d prompt + 40 generated)", got, want, r1.Usage.PromptTokens)
	}
}

func TestEviction(t *testing.T) {
	_, url := servePod(t, Config{TimeScale: 1000, NumGPUBlocks: 64})
	c := newClient(t)
	prompt := func(first int) string {
		ids, _ := json.Marshal(tokenPrompt(first, 512)) // 32 blocks
		return `{"prompt":` + string(ids) + `,"max_tokens":1}`
	}
	a, b, cc := prompt(10000), prompt(20000), prompt(30000)
	steps := []struct {
		name   string
		body   string
		cached int
	}{
		{"A cold", a, 0},
		{"B cold", b, 0},
		{"A warm", a, 496},
		{"C evicts B, the least recently used", cc, 0},
		{"A still cached", a, 496},
		{"B was evicted", b, 0},
	}
	for _, st := range steps {
		code, _, body := post(t, c, url+"/v1/completions", st.body)
		if code != 200 {
			t.Fatalf("%s: %d %s", st.name, code, body)
		}
		if got := decodeCompletion(t, body).Usage.cached(); got != st.cached {
			t.Errorf("%s: cached %d, want %d", st.name, got, st.cached)
		}
	}
	ids, _ := json.Marshal(tokenPrompt(1, 1024))
	code, _, body := post(t, c, url+"/v1/completions", `{"prompt":`+string(ids)+`,"max_tokens":1}`)
	if code != 400 || !strings.Contains(string(body), "KV cache blocks") {
		t.Errorf("request larger than the cache: %d %s", code, body)
	}
}

func TestBlockCacheLRU(t *testing.T) {
	c := newBlockCache(4)
	var got []int32
	for range 4 {
		got = append(got, c.alloc())
	}
	if c.free != 0 || c.used() != 4 {
		t.Fatalf("free %d used %d", c.free, c.used())
	}
	for i, id := range got {
		c.register(id, uint64(100+i))
	}
	c.releaseAll(got) // tail first: got[3] is the least recently used
	if i, ok := c.lookup(101); !ok || i != got[1] {
		t.Fatalf("lookup 101 = %d %v", i, ok)
	}
	c.acquire(got[1]) // pinned: must not be evicted
	evicted := c.alloc()
	if evicted != got[3] {
		t.Errorf("evicted %d, want the least recently freed %d", evicted, got[3])
	}
	if _, ok := c.lookup(103); ok {
		t.Error("evicted block still findable")
	}
	c.register(evicted, 101) // duplicate content: the pinned block stays canonical
	if i, _ := c.lookup(101); i != got[1] {
		t.Errorf("duplicate register moved hash 101 to %d", i)
	}
}

// stepRecorder collects StepInfo from a pod's engine goroutine.
type stepRecorder struct {
	mu    sync.Mutex
	steps []StepInfo
	cond  func(StepInfo) bool
	hit   chan struct{}
	once  sync.Once
}

func newStepRecorder(cond func(StepInfo) bool) *stepRecorder {
	return &stepRecorder{cond: cond, hit: make(chan struct{})}
}

func (r *stepRecorder) record(s StepInfo) {
	r.mu.Lock()
	r.steps = append(r.steps, s)
	r.mu.Unlock()
	if r.cond != nil && r.cond(s) {
		r.once.Do(func() { close(r.hit) })
	}
}

func (r *stepRecorder) all() []StepInfo {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]StepInfo(nil), r.steps...)
}

// openStream starts a streaming completion and returns once its first
// event arrived; cancel closes the connection.
func openStream(t *testing.T, c *http.Client, url, body string) (cancel func()) {
	t.Helper()
	ctx, cancelCtx := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/completions", strings.NewReader(body))
	resp, err := c.Do(req)
	if err != nil {
		cancelCtx()
		t.Fatal(err)
	}
	br := bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil {
		cancelCtx()
		t.Fatal(err)
	}
	return func() {
		cancelCtx()
		resp.Body.Close()
	}
}

func TestQueueingWhenFull(t *testing.T) {
	t.Run("seq limit", func(t *testing.T) {
		rec := newStepRecorder(func(s StepInfo) bool { return s.Waiting == 2 && s.Running == 2 })
		p, url := servePod(t, Config{TimeScale: 100, MaxNumSeqs: 2, OnStep: rec.record})
		c := newClient(t)
		long := `{"prompt":"keep going","max_tokens":30000,"stream":true}`
		stop1 := openStream(t, c, url, long)
		stop2 := openStream(t, c, url, long)
		results := make(chan usageJSON, 2)
		for i := range 2 {
			go func() {
				_, _, body := post(t, c, url+"/v1/completions", fmt.Sprintf(`{"prompt":"queued %d","max_tokens":2}`, i))
				results <- decodeCompletion(t, body).Usage
			}()
		}
		<-rec.hit // both queued behind the two running streams
		if st := p.Stats(); st.Running != 2 {
			t.Errorf("stats %+v while full", st)
		}
		m := scrape(t, c, url)
		if w := metricValue(t, m, "vllm:num_requests_waiting"); w != 2 {
			t.Errorf("vllm:num_requests_waiting = %v, want 2", w)
		}
		stop1()
		stop2()
		for range 2 {
			if u := <-results; u.CompletionTokens != 2 {
				t.Errorf("queued request usage %+v", u)
			}
		}
		m = scrape(t, c, url)
		if q := metricValue(t, m, "vllm:request_queue_time_seconds"); q <= 0 {
			t.Errorf("queue time sum %v, want > 0", q)
		}
	})
	t.Run("token budget chunks a long prefill", func(t *testing.T) {
		rec := newStepRecorder(nil)
		_, url := servePod(t, Config{TimeScale: 1000, MaxNumBatchedTokens: 256, OnStep: rec.record})
		c := newClient(t)
		ids, _ := json.Marshal(tokenPrompt(1, 1000))
		code, _, body := post(t, c, url+"/v1/completions", `{"prompt":`+string(ids)+`,"max_tokens":1}`)
		if code != 200 {
			t.Fatalf("%d %s", code, body)
		}
		var chunks []int
		for _, s := range rec.all() {
			chunks = append(chunks, s.PrefillTokens)
		}
		if want := []int{256, 256, 256, 232}; fmt.Sprint(chunks) != fmt.Sprint(want) {
			t.Errorf("prefill tokens per step %v, want %v", chunks, want)
		}
	})
}

func TestStepTimeGrowsWithBatch(t *testing.T) {
	rec := newStepRecorder(nil)
	// TimeScale 20 keeps the 64 prefills running for ≈ 0.3 s of wall time, so
	// a request whose handler the race detector or a busy machine delays still
	// joins the batch before the first ones finish decoding.
	p, url := servePod(t, Config{TimeScale: 20, OnStep: rec.record})
	c := newClient(t)
	// run sends n requests at once: a stall fault gathers them first, so they
	// reach the engine together and the batch really holds n sequences.
	run := func(n int) {
		if err := p.SetFaults(Faults{StallUntilRelease: true}); err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				ids, _ := json.Marshal(tokenPrompt(1+i*2048, 2048))
				code, _, body := post(t, c, url+"/v1/completions", `{"prompt":`+string(ids)+`,"max_tokens":32}`)
				if code != 200 {
					t.Errorf("%d %s", code, body)
				}
			})
		}
		for p.Stats().Stalled < n {
			runtime.Gosched()
		}
		p.ReleaseStalls()
		wg.Wait()
	}
	run(1)
	run(64)
	var d1, d64 time.Duration
	for _, s := range rec.all() {
		if s.PrefillTokens > 0 {
			continue
		}
		switch s.DecodeSeqs {
		case 1:
			d1 = s.Duration
		case 64:
			d64 = s.Duration
		}
	}
	if d1 == 0 || d64 == 0 {
		t.Fatalf("no decode-only steps at batch 1 (%v) or 64 (%v)", d1, d64)
	}
	if d1 < 6*time.Millisecond || d1 > 7*time.Millisecond || d64 < 14*time.Millisecond || d64 > 16*time.Millisecond {
		t.Errorf("decode step %v at batch 1, %v at batch 64; want 6–7 ms and 14–16 ms", d1, d64)
	}
}

func TestStreamingFaultsAndAbort(t *testing.T) {
	p, url := servePod(t, Config{TimeScale: 1000, Faults: Faults{DropAfterTokens: 3}})
	c := newClient(t)
	req, _ := http.NewRequest(http.MethodPost, url+"/v1/completions", strings.NewReader(`{"prompt":"x","max_tokens":10,"stream":true}`))
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err == nil {
		t.Errorf("stream ended cleanly, want a cut connection: %s", body)
	}
	if n := strings.Count(string(body), "data: {"); n != 3 {
		t.Errorf("%d events before the drop, want 3", n)
	}
	// The engine aborts the cut request and frees its blocks.
	if err := p.SetFaults(Faults{}); err != nil {
		t.Fatal(err)
	}
	code, _, out := post(t, c, url+"/v1/completions", `{"prompt":"x","max_tokens":3}`)
	if code != 200 {
		t.Errorf("after drop: %d %s", code, out)
	}
}

func TestFaultAdmin(t *testing.T) {
	p, url := servePod(t, Config{TimeScale: 1000, Seed: 3})
	c := newClient(t)
	setFaults := func(body string) {
		t.Helper()
		if code, _, out := post(t, c, url+"/sim/faults", body); code != 200 {
			t.Fatalf("POST /sim/faults %s: %d %s", body, code, out)
		}
	}
	t.Run("error rate", func(t *testing.T) {
		setFaults(`{"error_rate":1,"error_status":503}`)
		code, _, body := post(t, c, url+"/v1/completions", `{"prompt":"x"}`)
		if code != 503 || !strings.Contains(string(body), `"code":503`) {
			t.Errorf("%d %s", code, body)
		}
		setFaults(`{"error_rate":0.5}`)
		fails := 0
		for range 40 {
			if code, _, _ := post(t, c, url+"/v1/completions", `{"prompt":"x","max_tokens":1}`); code == 500 {
				fails++
			}
		}
		if fails < 8 || fails > 32 {
			t.Errorf("%d of 40 failed at rate 0.5", fails)
		}
	})
	t.Run("health", func(t *testing.T) {
		setFaults(`{"health_fail":true}`)
		if code, _ := get(t, c, url+"/health"); code != 503 {
			t.Errorf("health %d, want 503", code)
		}
		setFaults(`{}`)
		if code, _ := get(t, c, url+"/health"); code != 200 {
			t.Errorf("health %d, want 200", code)
		}
	})
	t.Run("stall until release", func(t *testing.T) {
		setFaults(`{"stall_until_release":true}`)
		done := make(chan int)
		go func() {
			code, _, _ := post(t, c, url+"/v1/completions", `{"prompt":"x","max_tokens":1}`)
			done <- code
		}()
		for p.Stats().Stalled == 0 {
			runtime.Gosched() // the request is on its way to the stall
		}
		select {
		case code := <-done:
			t.Fatalf("stalled request finished before the release: %d", code)
		default:
		}
		p.ReleaseStalls()
		if code := <-done; code != 200 {
			t.Errorf("released request: %d", code)
		}
		setFaults(`{}`)
	})
	t.Run("stall duration", func(t *testing.T) {
		setFaults(`{"stall_first_byte":"30ms"}`)
		start := time.Now()
		post(t, c, url+"/v1/completions", `{"prompt":"x","max_tokens":1}`)
		if d := time.Since(start); d < 30*time.Millisecond {
			t.Errorf("request took %v, want ≥ 30ms stall", d)
		}
		setFaults(`{}`)
	})
	t.Run("startup delay", func(t *testing.T) {
		_, url := servePod(t, Config{Faults: Faults{StartupDelay: Duration(time.Hour)}})
		if code, _ := get(t, c, url+"/health"); code != 503 {
			t.Errorf("health during startup %d", code)
		}
		if code, _, _ := post(t, c, url+"/v1/completions", `{"prompt":"x"}`); code != 503 {
			t.Errorf("inference during startup %d", code)
		}
	})
}

func TestFleetRestart(t *testing.T) {
	f, err := StartFleet(2, Config{TimeScale: 1000})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	c := newClient(t)
	ids, _ := json.Marshal(tokenPrompt(5, 100))
	body := `{"prompt":` + string(ids) + `,"max_tokens":1}`
	url := f.URL(0)
	post(t, c, url+"/v1/completions", body)
	_, _, out := post(t, c, url+"/v1/completions", body)
	if got := decodeCompletion(t, out).Usage.cached(); got != 96 {
		t.Fatalf("warm cached %d, want 96", got)
	}
	start := metricValue(t, scrape(t, c, url), "process_start_time_seconds")
	oldID := f.Pod(0).EngineID()
	if err := f.Restart(0); err != nil {
		t.Fatal(err)
	}
	c.Transport.(*http.Transport).CloseIdleConnections()
	if f.URL(0) != url {
		t.Errorf("restarted pod moved from %s to %s", url, f.URL(0))
	}
	if s := metricValue(t, scrape(t, c, url), "process_start_time_seconds"); s <= start {
		t.Errorf("start time %v after restart, was %v", s, start)
	}
	if f.Pod(0).EngineID() == oldID {
		t.Error("engine id survived the restart")
	}
	_, _, out = post(t, c, url+"/v1/completions", body)
	if got := decodeCompletion(t, out).Usage.cached(); got != 0 {
		t.Errorf("cached %d after restart, want an empty cache", got)
	}
}
