package scenario

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvroute/kvroute/bench/load"
	"github.com/kvroute/kvroute/bench/workload"
)

// InstantBackend is a fasthttp server that answers every request at once
// with a fixed vLLM-shaped completion: a text/event-stream of Tokens
// one-word chunks, a usage chunk and data: [DONE] when the body asks for
// "stream": true, else one JSON completion. Against it, the only work in a
// request is HTTP, so it shows what a router hop costs. Safe for
// concurrent use.
type InstantBackend struct {
	// URL is the backend's base URL.
	URL    string
	srv    *fasthttp.Server
	served chan error
	stream []byte
	full   []byte
}

// StartInstantBackend listens on addr ("127.0.0.1:0" for any port) and
// serves until Close. tokens is the completion length (≥ 1).
func StartInstantBackend(addr string, tokens int) (*InstantBackend, error) {
	tokens = max(tokens, 1)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	b := &InstantBackend{URL: "http://" + ln.Addr().String(), served: make(chan error, 1)}
	const head = `{"id":"cmpl-instant","object":"text_completion","created":1700000000,"model":"instant","choices":[`
	usage := `"usage":{"prompt_tokens":256,"total_tokens":` + strconv.Itoa(256+tokens) +
		`,"completion_tokens":` + strconv.Itoa(tokens) + `,"prompt_tokens_details":{"cached_tokens":0}}`
	var s, text strings.Builder
	for i := range tokens {
		finish := "null"
		if i == tokens-1 {
			finish = `"length"`
		}
		fmt.Fprintf(&s, "data: %s{\"index\":0,\"text\":\" word\",\"logprobs\":null,\"finish_reason\":%s,\"stop_reason\":null}],\"usage\":null}\n\n", head, finish)
		text.WriteString(" word")
	}
	fmt.Fprintf(&s, "data: %s],%s}\n\ndata: [DONE]\n\n", head, usage)
	b.stream = []byte(s.String())
	b.full = []byte(head + `{"index":0,"text":"` + text.String() + `","logprobs":null,"finish_reason":"length","stop_reason":null}],` + usage + "}")
	b.srv = &fasthttp.Server{Handler: b.handle, Name: "instant", NoDefaultDate: true, ReadBufferSize: 16 << 10}
	go func() { b.served <- b.srv.Serve(ln) }()
	return b, nil
}

func (b *InstantBackend) handle(ctx *fasthttp.RequestCtx) {
	body := ctx.PostBody()
	if bytes.Contains(body, []byte(`"stream":true`)) || bytes.Contains(body, []byte(`"stream": true`)) {
		ctx.SetContentType("text/event-stream; charset=utf-8")
		ctx.SetBody(b.stream)
		return
	}
	ctx.SetContentType("application/json")
	ctx.SetBody(b.full)
}

// Close stops the backend and waits for it.
func (b *InstantBackend) Close() error {
	err := b.srv.Shutdown()
	return errors.Join(err, <-b.served)
}

// OverheadConfig configures RunOverhead. Zero fields take the defaults
// noted.
type OverheadConfig struct {
	// Concurrency lists the closed-loop connection counts to measure
	// (default 1 and 32: one request at a time, then saturation).
	Concurrency []int `json:"concurrency"`
	// Duration is each measurement's length (default 5 s).
	Duration time.Duration `json:"duration"`
	// PromptTokens is the prompt length (default 256, ≈ 1.2 KiB of text).
	PromptTokens int `json:"prompt_tokens"`
	// OutputTokens is the number of streamed chunks (default 4).
	OutputTokens int `json:"output_tokens"`
	// Policy routes inside kvroute (default least-request: a cheap pick
	// without the prefix index, so the figure is the hop with its body
	// parsing and hashing; kvroute's own default policy is prefix).
	Policy Policy `json:"-"`
	Seed   uint64 `json:"seed"`
}

// OverheadRow compares direct and routed runs at one concurrency.
type OverheadRow struct {
	Concurrency int           `json:"concurrency"`
	Direct      *load.Summary `json:"direct"`
	Via         *load.Summary `json:"via_kvroute"`
	// Added latency (routed − direct) of the E2E latency percentiles, ms.
	AddedP50 float64 `json:"added_p50_ms"`
	AddedP90 float64 `json:"added_p90_ms"`
	AddedP99 float64 `json:"added_p99_ms"`
	// ThroughputRatio is routed ÷ direct requests per second.
	ThroughputRatio float64       `json:"throughput_ratio"`
	CPUDirect       load.CPUStats `json:"cpu_direct"`
	CPUVia          load.CPUStats `json:"cpu_via"`
}

// OverheadReport is RunOverhead's outcome.
type OverheadReport struct {
	Config      OverheadConfig `json:"config"`
	Policy      string         `json:"policy"`
	Machine     Machine        `json:"machine"`
	Started     time.Time      `json:"started"`
	WallSeconds float64        `json:"wall_s"`
	Rows        []OverheadRow  `json:"rows"`
}

// RunOverhead measures what a kvroute hop costs: at each concurrency a
// closed loop drives an InstantBackend directly, then through an
// in-process kvroute, for Duration each.
func RunOverhead(ctx context.Context, cfg OverheadConfig) (*OverheadReport, error) {
	if len(cfg.Concurrency) == 0 {
		cfg.Concurrency = []int{1, 32}
	}
	if cfg.Duration <= 0 {
		cfg.Duration = 5 * time.Second
	}
	if cfg.PromptTokens <= 0 {
		cfg.PromptTokens = 256
	}
	if cfg.OutputTokens <= 0 {
		cfg.OutputTokens = 4
	}
	if cfg.Policy.Name == "" {
		p, err := policyNamed("least-request")
		if err != nil {
			return nil, err
		}
		cfg.Policy = p
	}
	rep := &OverheadReport{Config: cfg, Policy: cfg.Policy.Name, Machine: ThisMachine(), Started: time.Now()}
	defer func() { rep.WallSeconds = time.Since(rep.Started).Seconds() }()
	w, err := workload.Config{Kind: workload.KindRandom, Seed: cfg.Seed, Requests: 256,
		InputTokens: cfg.PromptTokens, OutputTokens: cfg.OutputTokens}.Build()
	if err != nil {
		return nil, err
	}
	be, err := StartInstantBackend("127.0.0.1:0", cfg.OutputTokens)
	if err != nil {
		return nil, err
	}
	defer be.Close()
	rt, err := StartRouter(cfg.Policy, []string{be.URL}, nil)
	if err != nil {
		return nil, err
	}
	defer rt.Close()
	run := func(url string, c int) (*load.Result, error) {
		return load.Run(ctx, load.Config{BaseURL: url, Workload: w, Seed: cfg.Seed,
			Load: load.Load{Arrival: load.ArrivalClosed, Concurrency: c, Duration: cfg.Duration}})
	}
	for _, c := range cfg.Concurrency {
		d, err := run(be.URL, c)
		if err != nil {
			return rep, err
		}
		v, err := run(rt.URL, c)
		if err != nil {
			return rep, err
		}
		row := OverheadRow{Concurrency: c, Direct: &d.Summary, Via: &v.Summary, CPUDirect: d.CPU, CPUVia: v.CPU,
			AddedP50: v.Summary.E2EL.P50 - d.Summary.E2EL.P50,
			AddedP90: v.Summary.E2EL.P90 - d.Summary.E2EL.P90,
			AddedP99: v.Summary.E2EL.P99 - d.Summary.E2EL.P99,
		}
		if d.Summary.RequestThroughput > 0 {
			row.ThroughputRatio = v.Summary.RequestThroughput / d.Summary.RequestThroughput
		}
		rep.Rows = append(rep.Rows, row)
	}
	return rep, nil
}
