package proxy

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/routing"
)

// streamResult is what a client read of one streamed completion.
type streamResult struct {
	ids        map[string]bool
	text       string
	finish     string
	completion int
	errEvents  int
	done       time.Time
	err        error
}

// streamAs sends a streamed completion of maxTokens as tenant key and
// reads it to its end.
func streamAs(url, key, prompt string, maxTokens int) streamResult {
	res := streamResult{ids: map[string]bool{}}
	body := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":%d,"stream":true,"ignore_eos":true,"stream_options":{"include_usage":true}}`, prompt, maxTokens)
	req, err := http.NewRequest(http.MethodPost, url+"/v1/completions", strings.NewReader(body))
	if err != nil {
		res.err = err
		return res
	}
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		res.err = err
		return res
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		res.err = fmt.Errorf("status %d", resp.StatusCode)
		return res
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		d, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || d == "[DONE]" {
			continue
		}
		var ev struct {
			ID      string          `json:"id"`
			Error   json.RawMessage `json:"error"`
			Choices []struct {
				Text         string `json:"text"`
				FinishReason string `json:"finish_reason"`
			} `json:"choices"`
			Usage *struct {
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
		}
		if err := json.Unmarshal([]byte(d), &ev); err != nil {
			res.err = err
			return res
		}
		if ev.Error != nil {
			res.errEvents++
		}
		res.ids[ev.ID] = true
		for _, c := range ev.Choices {
			res.text += c.Text
			if c.FinishReason != "" {
				res.finish = c.FinishReason
			}
		}
		if ev.Usage != nil {
			res.completion = ev.Usage.CompletionTokens
		}
	}
	res.err = sc.Err()
	res.done = time.Now()
	return res
}

// A quiet tenant's request on a fleet full of a flood's streams takes the
// place of the flood's stream that started last: that stream is cut and
// continues once a place frees, and its client reads one whole stream.
// Without preemption the quiet request waits for a flood stream to end.
func TestPreemptionGivesTheQuietTenantAPlace(t *testing.T) {
	for _, preempt := range []bool{true, false} {
		t.Run(fmt.Sprintf("preempt=%v", preempt), func(t *testing.T) {
			cfg := sim.DefaultConfig()
			cfg.Model, cfg.TimeScale, cfg.MaxNumSeqs = "m", 1, 2
			fleet := startSimFleet(t, 1, cfg)
			opt := Options{Limits: Limits{QueueTimeout: 30 * time.Second, MaxQueue: 16, MaxMigrations: 2},
				Tenants: TenantOptions{Preempt: preempt}, Logger: zaptest.NewLogger(t)}
			h := startProxy(t, routing.NewLeastRequest(nil), opt, fleet.URL(0))
			h.pool.Load().Endpoints[0].SetCosts(&discovery.Costs{BatchLimit: 2}) // learned: two at once
			// Two flood streams of about two seconds fill the engine.
			const long = 300
			floods := make(chan streamResult, 2)
			for i := range 2 {
				go func() { floods <- streamAs(h.url, "noisy", fmt.Sprintf("flood %d: tell a long story. ", i), long) }()
			}
			for deadline := time.Now().Add(guard); h.inFlight() < 2; time.Sleep(time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatal("the flood's streams did not start")
				}
			}
			time.Sleep(100 * time.Millisecond) // both stream
			quiet := streamAs(h.url, "quiet", "quiet: a short answer. ", 8)
			if quiet.err != nil || quiet.completion != 8 || quiet.errEvents > 0 {
				t.Fatalf("quiet stream: %+v", quiet)
			}
			var first time.Time
			for range 2 {
				f := <-floods
				if f.err != nil || f.completion != long || f.finish != "length" || len(f.ids) != 1 || f.errEvents > 0 || f.text == "" {
					t.Fatalf("flood stream: err %v, %d tokens, finish %q, ids %v, %d error events", f.err, f.completion, f.finish, f.ids, f.errEvents)
				}
				if first.IsZero() || f.done.Before(first) {
					first = f.done
				}
			}
			cut := counterValue(t, h.reg, "kvroute_migrations_total", map[string]string{"cause": "preempted", "outcome": "continued"})
			if preempt && (cut != 1 || !quiet.done.Before(first)) {
				t.Errorf("%v flood streams cut, quiet stream ended %v before the first flood stream, want one cut and before", cut, first.Sub(quiet.done))
			}
			if !preempt && (cut != 0 || quiet.done.Before(first)) {
				t.Errorf("without preemption: %v cut, quiet stream ended %v before the first flood stream", cut, first.Sub(quiet.done))
			}
			h.waitIdle(t)
		})
	}
}
