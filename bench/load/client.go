package load

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
	"github.com/valyala/fastjson"

	"github.com/kvroute/kvroute/bench/workload"
	"github.com/kvroute/kvroute/discovery"
)

// Error kinds of RequestResult.Err.
const (
	// ErrKindConnection: no response headers (refused, reset, closed).
	ErrKindConnection = "connection"
	// ErrKindTimeout: the request timeout expired.
	ErrKindTimeout = "timeout"
	// ErrKindTruncated: the stream ended or broke before data: [DONE].
	ErrKindTruncated = "truncated"
	// ErrKindStream: the server sent an error event inside the stream.
	ErrKindStream = "stream_error"
	// ErrKindCanceled: the run was interrupted.
	ErrKindCanceled = "canceled"
	// ErrKindHTTP prefixes a non-200 status: "http_503".
	ErrKindHTTP = "http_"
)

// RequestResult is what the generator measured for one request. Times are
// in modelled seconds (wall × time scale).
type RequestResult struct {
	// Session indexes Workload.Sessions; Turn is the turn within it.
	Session int `json:"session"`
	Turn    int `json:"turn"`
	// Stage is the load stage the request was sent in.
	Stage int `json:"stage"`
	// Start is when it was sent, from the start of the run.
	Start float64 `json:"start_s"`
	// TTFT is send → first streamed content; E2EL send → end of stream (or
	// failure); TPOT = (E2EL − TTFT)/(OutputTokens − 1).
	TTFT float64 `json:"ttft_s"`
	TPOT float64 `json:"tpot_s"`
	E2EL float64 `json:"e2el_s"`
	// Token counts from the usage chunk (OutputTokens falls back to the
	// number of content chunks when the server sends no usage).
	PromptTokens int `json:"prompt_tokens"`
	OutputTokens int `json:"output_tokens"`
	CachedTokens int `json:"cached_tokens"`
	// Status is the HTTP status (0 without response).
	Status int `json:"status"`
	// Err is "" on success, else one of the ErrKind values ("http_503");
	// ErrDetail, when known, its start: the answer's body (a non-200) or
	// the client's error (no answer), at most errDetailBytes.
	Err       string `json:"err,omitempty"`
	ErrDetail string `json:"err_detail,omitempty"`
	// RetryAfter: the answer carried a Retry-After header.
	RetryAfter bool `json:"retry_after,omitempty"`
	// ITL holds every gap between consecutive content chunks, in modelled
	// seconds. Not serialised.
	ITL []float32 `json:"-"`
}

// client sends requests to one base URL over fasthttp with streamed
// response bodies. Safe for concurrent use.
type client struct {
	hc      *fasthttp.HostClient
	uri     string
	apiKey  string // sent as Authorization: Bearer when set
	timeout time.Duration
	conns   connSet
	parsers fastjson.ParserPool
	bufs    sync.Pool // *exchange
}

// newClient returns a client for api requests to baseURL
// ("http[s]://host[:port][/prefix]"). timeout bounds one request from send
// to the end of its stream (wall time).
func newClient(baseURL string, api workload.API, timeout time.Duration) (*client, error) {
	u, err := url.Parse(strings.TrimRight(baseURL, "/"))
	if err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
		return nil, fmt.Errorf("%w: base URL %q must be http(s)://host[:port][/prefix]", ErrConfig, baseURL)
	}
	addr := u.Host
	if u.Port() == "" {
		port := "80"
		if u.Scheme == "https" {
			port = "443"
		}
		addr = net.JoinHostPort(u.Hostname(), port)
	}
	c := &client{uri: u.Scheme + "://" + u.Host + u.EscapedPath() + api.Path(), timeout: timeout}
	c.hc = &fasthttp.HostClient{
		Addr:  addr,
		IsTLS: u.Scheme == "https",
		Name:  "kvbench",
		Dial:  c.conns.dial,
		// Every stream holds a connection; never refuse one.
		MaxConns: 1 << 20,
		// An idle connection is never reused just as vLLM closes it.
		MaxIdleConnDuration:    discovery.EngineIdleTimeout,
		ReadBufferSize:         16 << 10,
		WriteBufferSize:        16 << 10,
		DisablePathNormalizing: true,
		StreamResponseBody:     true,
		// A pooled keep-alive connection the server had closed answers
		// the request written on it with EOF before any byte: resend on
		// the next one, and on a new one when the pool holds only dead
		// ones. llama-server closes its connection after every streamed
		// response without saying so (no Connection: close), so a burst
		// can meet several; resending once failed 14 of 96 requests.
		MaxIdemponentCallAttempts: maxStaleResends,
		RetryIfErr: func(_ *fasthttp.Request, _ int, err error) (bool, bool) {
			return false, errors.Is(err, io.EOF)
		},
	}
	c.bufs.New = func() any { return &exchange{buf: make([]byte, 32<<10)} }
	return c, nil
}

// maxStaleResends bounds the sends of one request over pooled connections
// the server had closed (each is dropped when found).
const maxStaleResends = 64

// close closes every connection, idle or busy: reads blocked in a stream
// return at once.
func (c *client) close() {
	c.hc.CloseIdleConnections()
	c.conns.closeAll()
}

// connSet tracks a client's connections so an interrupted run can close
// the busy ones too (fasthttp has no per-request cancellation).
type connSet struct {
	mu     sync.Mutex
	m      map[*trackedConn]struct{}
	closed bool
}

// dialTimeout bounds establishing one connection.
const dialTimeout = 10 * time.Second

func (s *connSet) dial(addr string) (net.Conn, error) {
	c, err := net.DialTimeout("tcp", addr, dialTimeout)
	if err != nil {
		return nil, err
	}
	tc := &trackedConn{Conn: c, set: s}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		c.Close()
		return nil, net.ErrClosed
	}
	if s.m == nil {
		s.m = make(map[*trackedConn]struct{})
	}
	s.m[tc] = struct{}{}
	return tc, nil
}

func (s *connSet) closeAll() {
	s.mu.Lock()
	s.closed = true
	conns := make([]*trackedConn, 0, len(s.m))
	for c := range s.m {
		conns = append(conns, c)
	}
	s.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
}

type trackedConn struct {
	net.Conn
	set  *connSet
	once sync.Once
}

func (c *trackedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		c.set.mu.Lock()
		delete(c.set.m, c)
		c.set.mu.Unlock()
	})
	return err
}

// exchange is one request's scratch space, pooled.
type exchange struct {
	body    []byte
	buf     []byte // read buffer
	pending []byte // bytes of an incomplete line
	answer  []byte
}

// do sends body and measures the streamed response into res (times scaled
// by scale). When keepAnswer is set it returns the generated text. ctx only
// tells a cancelled run from a timeout; cancellation itself works by
// closing the connections (see close).
func (c *client) do(ctx context.Context, body []byte, keepAnswer bool, scale float64, res *RequestResult) string {
	x := c.bufs.Get().(*exchange)
	defer c.bufs.Put(x)
	x.pending, x.answer = x.pending[:0], x.answer[:0]

	req := fasthttp.AcquireRequest()
	resp := fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.Header.SetMethod(fasthttp.MethodPost)
	req.SetRequestURI(c.uri)
	req.Header.SetContentType("application/json")
	req.SetBodyRaw(body)
	if c.apiKey != "" {
		req.Header.Set(fasthttp.HeaderAuthorization, "Bearer "+c.apiKey)
	}
	if c.timeout > 0 {
		req.SetTimeout(c.timeout)
	}

	start := time.Now()
	since := func(t time.Time) float64 { return t.Sub(start).Seconds() * scale }
	fail := func(kind string) string {
		res.Err = kind
		res.E2EL = since(time.Now())
		return ""
	}
	if err := c.hc.Do(req, resp); err != nil {
		res.ErrDetail = detail([]byte(err.Error()))
		return fail(classify(ctx, err, ErrKindConnection))
	}
	defer resp.CloseBodyStream() //nolint:errcheck // the stream is done either way
	res.Status = resp.StatusCode()
	res.RetryAfter = len(resp.Header.Peek(fasthttp.HeaderRetryAfter)) > 0
	stream := resp.BodyStream()
	if res.Status != fasthttp.StatusOK {
		var body []byte
		if stream != nil {
			var b bytes.Buffer
			_, _ = io.Copy(&b, io.LimitReader(stream, 64<<10))
			body = b.Bytes()
		} else {
			body = resp.Body()
		}
		res.ErrDetail = detail(body)
		return fail(ErrKindHTTP + strconv.Itoa(res.Status))
	}
	if stream == nil {
		stream = bytes.NewReader(resp.Body())
	}

	m := meter{res: res, scale: scale, keepAnswer: keepAnswer, answer: x.answer}
	end, kind := c.read(ctx, stream, x, &m)
	x.answer = m.answer
	if kind != "" {
		return fail(kind)
	}
	res.E2EL = since(end)
	if m.streamErr {
		return fail(ErrKindStream)
	}
	if m.first.IsZero() {
		m.first = time.Now()
	}
	res.TTFT = since(m.first)
	if res.OutputTokens == 0 {
		res.OutputTokens = m.chunks
	}
	if res.OutputTokens > 1 {
		res.TPOT = (res.E2EL - res.TTFT) / float64(res.OutputTokens-1)
	}
	if keepAnswer {
		return string(m.answer)
	}
	return ""
}

// read reads stream into m up to data: [DONE], then drains the rest so the
// connection can be reused. It returns when [DONE] arrived, or else the
// error kind that ended the stream first.
func (c *client) read(ctx context.Context, stream io.Reader, x *exchange, m *meter) (time.Time, string) {
	p := c.parsers.Get()
	defer c.parsers.Put(p)
	for {
		n, rerr := stream.Read(x.buf)
		now := time.Now()
		if n > 0 && m.feed(p, x, x.buf[:n], now) {
			// Read the end of the chunked body so the connection is reused.
			_, _ = io.Copy(io.Discard, io.LimitReader(stream, 64<<10))
			return now, ""
		}
		if rerr != nil {
			if rerr == io.EOF {
				return now, ErrKindTruncated
			}
			return now, classify(ctx, rerr, ErrKindTruncated)
		}
	}
}

// meter accumulates what one response stream carried. Not safe for
// concurrent use.
type meter struct {
	res         *RequestResult
	scale       float64
	keepAnswer  bool
	answer      []byte // the generated text, when keepAnswer
	first, last time.Time
	chunks      int  // content chunks
	streamErr   bool // an error event arrived
}

// feed appends data (read at now) to x.pending and handles its complete
// lines; it reports whether data: [DONE] was among them.
func (m *meter) feed(p *fastjson.Parser, x *exchange, data []byte, now time.Time) bool {
	x.pending = append(x.pending, data...)
	consumed := 0
	done := false
	for !done {
		i := bytes.IndexByte(x.pending[consumed:], '\n')
		if i < 0 {
			break
		}
		line := bytes.TrimRight(x.pending[consumed:consumed+i], "\r")
		consumed += i + 1
		payload, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			continue // blank line, comment or another SSE field
		}
		payload = bytes.TrimLeft(payload, " ")
		if done = string(payload) == "[DONE]"; !done {
			m.event(parseEvent(p, payload), now)
		}
	}
	x.pending = append(x.pending[:0], x.pending[consumed:]...)
	return done
}

// event records one parsed chunk that arrived at now.
func (m *meter) event(ev event, now time.Time) {
	switch {
	case ev.err:
		m.streamErr = true
	case len(ev.text) > 0:
		if m.first.IsZero() {
			m.first = now
		} else {
			m.res.ITL = append(m.res.ITL, float32(now.Sub(m.last).Seconds()*m.scale))
		}
		m.last = now
		m.chunks++
		if m.keepAnswer {
			m.answer = append(m.answer, ev.text...)
		}
	}
	if ev.usage {
		m.res.PromptTokens, m.res.OutputTokens, m.res.CachedTokens = ev.prompt, ev.completion, ev.cached
	}
}

// classify names a transport error: a cancelled run, a timeout, or other.
func classify(ctx context.Context, err error, other string) string {
	if ctx.Err() != nil {
		return ErrKindCanceled
	}
	var ne net.Error
	if errors.Is(err, fasthttp.ErrTimeout) || errors.Is(err, os.ErrDeadlineExceeded) ||
		errors.As(err, &ne) && ne.Timeout() {
		return ErrKindTimeout
	}
	return other
}

// event is what one SSE data payload carried.
type event struct {
	text                       []byte // generated text (completions text, chat delta content or reasoning)
	usage                      bool
	prompt, completion, cached int
	err                        bool
}

// parseEvent reads one OpenAI streaming chunk. Unparseable payloads count as
// stream errors.
func parseEvent(p *fastjson.Parser, payload []byte) event {
	var ev event
	v, err := p.ParseBytes(payload)
	if err != nil || v.Type() != fastjson.TypeObject {
		ev.err = true
		return ev
	}
	if v.Get("error") != nil || string(v.GetStringBytes("object")) == "error" {
		ev.err = true
		return ev
	}
	if ch := v.GetArray("choices"); len(ch) > 0 {
		c := ch[0]
		if t := c.GetStringBytes("text"); len(t) > 0 {
			ev.text = t
		} else if d := c.Get("delta"); d != nil {
			if t := d.GetStringBytes("content"); len(t) > 0 {
				ev.text = t
			} else if t := d.GetStringBytes("reasoning_content"); len(t) > 0 {
				ev.text = t
			}
		}
	}
	if u := v.Get("usage"); u != nil && u.Type() == fastjson.TypeObject {
		ev.usage = true
		ev.prompt = u.GetInt("prompt_tokens")
		ev.completion = u.GetInt("completion_tokens")
		ev.cached = u.GetInt("prompt_tokens_details", "cached_tokens")
	}
	return ev
}

// errDetailBytes bounds a failure's detail (RequestResult.ErrDetail).
const errDetailBytes = 256

// detail is b's start as a failure's detail.
func detail(b []byte) string { return string(b[:min(len(b), errDetailBytes)]) }
