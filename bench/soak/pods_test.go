package soak

import (
	"bufio"
	"bytes"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/sim"
)

func TestScanRequestID(t *testing.T) {
	for _, c := range []struct {
		in      string
		id      string
		scanned bool
	}{
		{"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: soak-7\r\nContent-Length: 2\r\n\r\n{}", "soak-7", true},
		{"POST / HTTP/1.1\r\nx-request-id:  soak-8 \r\n\r\n", "soak-8", true},
		{"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", "", true},
		{"POST / HTTP/1.1\r\nHost: x\r\nContent-Le", "", false},                            // headers continue in the next read
		{"POST / HTTP/1.1\r\nHost: x\r\n\r\n{\"a\":\"\\r\\nX-Request-Id: no\"}", "", true}, // not in the body
	} {
		id, scanned := scanRequestID([]byte(c.in))
		if id != c.id || scanned != c.scanned {
			t.Errorf("scanRequestID(%q) = %q, %v; want %q, %v", c.in, id, scanned, c.id, c.scanned)
		}
	}
}

func TestRespTracker(t *testing.T) {
	feed := func(parts ...string) respTracker {
		var tr respTracker
		for _, p := range parts {
			tr.write([]byte(p))
		}
		return tr
	}
	head := "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
	ev := "data: {\"x\":0}\n\n"
	chunk := "10\r\n" + ev + "\r\n"
	if tr := feed(head, chunk, chunk); !tr.active || !tr.chunked || tr.done {
		t.Fatalf("stream in progress: %+v", tr)
	}
	if tr := feed(head[:20], head[20:]+chunk, chunk+"0\r\n\r\n"); !tr.done {
		t.Fatalf("finished stream not done: %+v", tr)
	}
	if tr := feed(head, "5\r\nab0\r\n\r\n"); tr.done {
		// data "ab0\r\n" looks like the last chunk without its line start
		t.Fatalf("data ending in 0CRLF taken for the end: %+v", tr)
	}
	if tr := feed(head + "0\r\n\r\n"); !tr.done {
		t.Fatalf("empty chunked body not done: %+v", tr)
	}
	if tr := feed("HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345"); tr.done || tr.chunked {
		t.Fatalf("half a fixed body: %+v", tr)
	}
	if tr := feed("HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345", "67890"); !tr.done {
		t.Fatalf("whole fixed body not done: %+v", tr)
	}
	if tr := feed("HTTP/1.1 204 No Content\r\n\r\n"); !tr.done {
		t.Fatalf("bodyless answer not done: %+v", tr)
	}
}

// stream posts a streaming completion of n tokens with request id id to
// url and returns the response (status checked).
func stream(t *testing.T, hc *http.Client, url, id string, n int) *http.Response {
	t.Helper()
	body := `{"prompt":"hello there","max_tokens":` + strconv.Itoa(n) + `,"ignore_eos":true,"stream":true}`
	req, _ := http.NewRequest(http.MethodPost, url+"/v1/completions", strings.NewReader(body))
	req.Header.Set("X-Request-Id", id)
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
	return resp
}

// TestPodCuts checks what the pods' connections tell: a drop fault and a
// kill are cuts with the request's id, a client that leaves is not, a
// mid-stream stall holds the stream until released, and a killed pod comes
// back on its address.
func TestPodCuts(t *testing.T) {
	cfg := sim.DefaultConfig()
	cfg.NumGPUBlocks = 1024
	pods, err := startPods([]sim.Config{cfg})
	if err != nil {
		t.Fatal(err)
	}
	defer pods.close()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: 20 * time.Second}
	sl, url := pods.slots[0], pods.urls()[0]

	// A dropped connection.
	sl.setFaults(sim.Faults{DropAfterTokens: 3})
	resp := stream(t, hc, url, "t-drop", 50)
	if _, err := io.ReadAll(resp.Body); err == nil {
		t.Fatal("dropped stream read without error")
	}
	resp.Body.Close()
	sl.setFaults(sim.Faults{})
	waitFor(t, func() bool { return pods.cutReason("t-drop") == CutDrop })

	// A client that leaves is no cut.
	resp = stream(t, hc, url, "t-leave", 400)
	br := bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()

	// A mid-stream stall holds the stream until released.
	release := sl.stallMidStream()
	resp = stream(t, hc, url, "t-stall", 20)
	got := make(chan error, 1)
	go func() {
		_, err := io.ReadAll(resp.Body)
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("stream ended during a stall: %v", err)
	case <-time.After(400 * time.Millisecond):
	}
	release()
	if err := <-got; err != nil {
		t.Fatalf("stalled stream after release: %v", err)
	}
	resp.Body.Close()
	if pods.stalledWrites.Load() == 0 {
		t.Fatal("no write counted as stalled")
	}

	// A kill cuts the running stream; the pod comes back on its address.
	resp = stream(t, hc, url, "t-kill", 2000)
	br = bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	sl.kill()
	if _, err := io.ReadAll(br); err == nil {
		t.Fatal("killed stream read without error")
	}
	resp.Body.Close()
	if r := pods.cutReason("t-kill"); r != CutKill {
		t.Fatalf("kill recorded as %q", r)
	}
	if err := sl.restart(); err != nil {
		t.Fatal(err)
	}
	if pods.urls()[0] != url {
		t.Fatalf("restarted on %s, want %s", pods.urls()[0], url)
	}
	resp = stream(t, hc, url, "t-after", 5)
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || !bytes.Contains(b, []byte("[DONE]")) {
		t.Fatalf("after restart: %v, %q", err, b)
	}

	if r := pods.cutReason("t-leave"); r != "" {
		t.Errorf("client that left recorded as cut %q", r)
	}
	for _, id := range []string{"t-stall", "t-after"} {
		if r := pods.cutReason(id); r != "" {
			t.Errorf("%s recorded as cut %q", id, r)
		}
	}
	if pods.reached("t-drop") != 1 || pods.reached("t-after") != 1 || pods.reached("never") != 0 {
		t.Errorf("reached: t-drop %d, t-after %d", pods.reached("t-drop"), pods.reached("t-after"))
	}
	if n := pods.cutCounts(); n[CutKill] != 1 || n[CutDrop] != 1 {
		t.Errorf("cut counts %v, want one of each", n)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatal("condition not met within 5 s")
}
