package load

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/workload"
)

// rawServer answers every request on a loopback listener with respond,
// which writes raw bytes (status line included) and may close early. It
// returns the base URL.
func rawServer(t *testing.T, respond func(c net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				req, err := http.ReadRequest(bufio.NewReader(c))
				if err != nil {
					return
				}
				_, _ = io.Copy(io.Discard, req.Body)
				respond(c)
			})
		}
	})
	return "http://" + ln.Addr().String()
}

// chunked writes an SSE body as HTTP/1.1 chunks, one per piece; end adds
// the terminating chunk.
func chunked(c net.Conn, pieces []string, end bool) {
	fmt.Fprint(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
	for _, p := range pieces {
		fmt.Fprintf(c, "%x\r\n%s\r\n", len(p), p)
	}
	if end {
		fmt.Fprint(c, "0\r\n\r\n")
	}
}

// byteByByte splits s into one-byte pieces, so every line arrives split.
func byteByByte(s string) []string {
	out := make([]string, len(s))
	for i := range s {
		out[i] = s[i : i+1]
	}
	return out
}

const (
	cmplChunk = `data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"%s","logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}` + "\n\n"
	chatRole  = `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}` + "\n\n"
	chatChunk = `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"%s"},"logprobs":null,"finish_reason":null}]}` + "\n\n"
	usageEv   = `data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":12,"total_tokens":15,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}}}` + "\n\n"
	doneEv    = "data: [DONE]\n\n"
)

func TestClientStreams(t *testing.T) {
	cmpl := fmt.Sprintf(cmplChunk, " San") + fmt.Sprintf(cmplChunk, " Francisco") + fmt.Sprintf(cmplChunk, " is")
	for _, tc := range []struct {
		name       string
		api        workload.API
		respond    func(c net.Conn)
		wantErr    string
		wantStatus int
		wantOut    int
		wantITL    int
		wantAnswer string
		wantUsage  bool
	}{
		{
			name:    "completions split byte by byte",
			respond: func(c net.Conn) { chunked(c, byteByByte(cmpl+usageEv+doneEv), true) },
			wantOut: 3, wantITL: 2, wantAnswer: " San Francisco is", wantUsage: true, wantStatus: 200,
		},
		{
			name: "chat with role chunk and CRLF lines",
			api:  workload.APIChat,
			respond: func(c net.Conn) {
				body := chatRole + fmt.Sprintf(chatChunk, "Hello") + fmt.Sprintf(chatChunk, ` \"world\"`) + usageEv + doneEv
				chunked(c, []string{strings.ReplaceAll(body, "\n", "\r\n")}, true)
			},
			wantOut: 3, wantITL: 1, wantAnswer: `Hello "world"`, wantUsage: true, wantStatus: 200,
		},
		{
			name:    "no usage chunk counts content chunks",
			respond: func(c net.Conn) { chunked(c, []string{cmpl, doneEv}, true) },
			wantOut: 3, wantITL: 2, wantAnswer: " San Francisco is", wantStatus: 200,
		},
		{
			name: "known length body",
			respond: func(c net.Conn) {
				fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(cmpl+doneEv), cmpl+doneEv)
			},
			wantOut: 3, wantITL: 2, wantAnswer: " San Francisco is", wantStatus: 200,
		},
		{
			name:    "truncated stream",
			respond: func(c net.Conn) { chunked(c, []string{fmt.Sprintf(cmplChunk, "a")}, false) },
			wantErr: ErrKindTruncated, wantStatus: 200,
		},
		{
			name: "error status",
			respond: func(c net.Conn) {
				b := `{"error":{"message":"busy","type":"ServiceUnavailableError","param":null,"code":503}}`
				fmt.Fprintf(c, "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(b), b)
			},
			wantErr: "http_503", wantStatus: 503,
		},
		{
			name: "error event in the stream",
			respond: func(c net.Conn) {
				chunked(c, []string{fmt.Sprintf(cmplChunk, "a"), `data: {"error":{"message":"boom","code":500}}` + "\n\n", doneEv}, true)
			},
			wantErr: ErrKindStream, wantStatus: 200,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			url := rawServer(t, tc.respond)
			c, err := newClient(url, tc.api, 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer c.close()
			var res RequestResult
			answer := c.do(context.Background(), []byte(`{}`), true, 1, &res)
			if res.Err != tc.wantErr || res.Status != tc.wantStatus {
				t.Fatalf("err %q status %d, want %q %d", res.Err, res.Status, tc.wantErr, tc.wantStatus)
			}
			if tc.wantErr != "" {
				if res.E2EL <= 0 {
					t.Fatal("a failure must still record its duration")
				}
				if tc.wantStatus != 200 && !strings.Contains(res.ErrDetail, `"code":503`) {
					t.Fatalf("the error's detail is %q, want the answer's body", res.ErrDetail)
				}
				return
			}
			if res.OutputTokens != tc.wantOut || len(res.ITL) != tc.wantITL || answer != tc.wantAnswer {
				t.Fatalf("out %d itl %d answer %q, want %d %d %q", res.OutputTokens, len(res.ITL), answer, tc.wantOut, tc.wantITL, tc.wantAnswer)
			}
			if tc.wantUsage && (res.PromptTokens != 12 || res.CachedTokens != 8) {
				t.Fatalf("usage prompt %d cached %d", res.PromptTokens, res.CachedTokens)
			}
			if !(res.TTFT > 0 && res.TTFT <= res.E2EL) || res.TPOT < 0 {
				t.Fatalf("ttft %v e2el %v tpot %v", res.TTFT, res.E2EL, res.TPOT)
			}
		})
	}
}

// doOnce sends one completions request to url with the given timeout.
func doOnce(t *testing.T, url string, timeout time.Duration) RequestResult {
	t.Helper()
	c, err := newClient(url, workload.APICompletions, timeout)
	if err != nil {
		t.Fatal(err)
	}
	defer c.close()
	var res RequestResult
	c.do(context.Background(), []byte(`{}`), false, 1, &res)
	return res
}

func TestClientFailures(t *testing.T) {
	t.Run("connection refused", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		url := "http://" + ln.Addr().String()
		ln.Close()
		if res := doOnce(t, url, time.Second); res.Err != ErrKindConnection {
			t.Fatalf("err %q, want connection", res.Err)
		}
	})
	t.Run("timeout", func(t *testing.T) {
		release := make(chan struct{})
		defer close(release)
		url := rawServer(t, func(net.Conn) { <-release })
		if res := doOnce(t, url, 50*time.Millisecond); res.Err != ErrKindTimeout {
			t.Fatalf("err %q, want timeout", res.Err)
		}
	})
	t.Run("cancelled mid-stream", func(t *testing.T) {
		release := make(chan struct{})
		defer close(release)
		started := make(chan struct{})
		url := rawServer(t, func(c net.Conn) {
			chunked(c, []string{fmt.Sprintf(cmplChunk, "a")}, false)
			close(started)
			<-release
		})
		c, _ := newClient(url, workload.APICompletions, time.Minute)
		ctx, cancel := context.WithCancel(context.Background())
		go func() { <-started; cancel(); c.close() }()
		var res RequestResult
		c.do(ctx, []byte(`{}`), false, 1, &res)
		if res.Err != ErrKindCanceled {
			t.Fatalf("err %q, want canceled", res.Err)
		}
	})
	t.Run("bad base URL", func(t *testing.T) {
		for _, u := range []string{"", "ftp://x", "127.0.0.1:8000", "http://"} {
			if _, err := newClient(u, workload.APICompletions, time.Second); err == nil {
				t.Errorf("accepted %q", u)
			}
		}
	})
}
