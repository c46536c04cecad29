package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/routing"
)

// TestModelRouting: pods behind one kvroute serve different models and
// LoRA adapters (a pool mid-upgrade, adapters loaded per pod). Every
// request is answered by a pod that serves its model, under every policy;
// an unknown model gets kvroute's own 404 without reaching a pod; GET
// /v1/models is the union of the pods' lists.
func TestModelRouting(t *testing.T) {
	fleet, err := sim.StartFleetOf(
		sim.Config{TimeScale: 1000, Model: "llama-a", LoRAs: []string{"sql-lora"}},
		sim.Config{TimeScale: 1000, Model: "llama-a", Seed: 1},
		sim.Config{TimeScale: 1000, Model: "llama-b", Seed: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fleet.Close() })
	serves := map[string][]int{"llama-a": {0, 1}, "sql-lora": {0}, "llama-b": {2}}

	for _, policy := range []string{"prefix", "round-robin", "least-request", "random"} {
		t.Run(policy, func(t *testing.T) {
			addrs, stop := startKvroute(t, "--backends", strings.Join(fleet.URLs(), ","), "--policy", policy,
				"--models-interval", "100ms")
			defer stop()
			api := "http://" + addrs.API

			var ids []string
			for deadline := time.Now().Add(10 * time.Second); ; {
				ids = modelIDs(t, api)
				if len(ids) == 3 || time.Now().After(deadline) {
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
			if want := []string{"llama-a", "llama-b", "sql-lora"}; fmt.Sprint(ids) != fmt.Sprint(want) {
				t.Fatalf("GET /v1/models lists %v, want the union %v", ids, want)
			}

			for _, model := range []string{"llama-a", "sql-lora", "llama-b"} {
				before := make([]float64, fleet.Len())
				for i := range before {
					before[i] = podRequests(t, fleet.Pod(i))
				}
				for i := range 12 {
					code, body := postCompletion(t, api, model, fmt.Sprintf("request %d for %s: %s", i, model, strings.Repeat("context ", 200)))
					if code != 200 {
						t.Fatalf("%s: %d %s", model, code, body)
					}
				}
				var got []int
				for i := range before {
					if podRequests(t, fleet.Pod(i)) > before[i] {
						got = append(got, i)
					}
				}
				if len(got) == 0 || !isSubset(got, serves[model]) {
					t.Errorf("%s was served by pods %v; only %v serve it", model, got, serves[model])
				}
			}

			before := podRequests(t, fleet.Pod(0)) + podRequests(t, fleet.Pod(1)) + podRequests(t, fleet.Pod(2))
			code, body := postCompletion(t, api, "no-such-model", "hello")
			if code != 404 || !strings.Contains(body, "The model `no-such-model` does not exist.") || !strings.Contains(body, `"code":"model_not_found"`) {
				t.Errorf("unknown model: %d %s, want kvroute's 404", code, body)
			}
			if after := podRequests(t, fleet.Pod(0)) + podRequests(t, fleet.Pod(1)) + podRequests(t, fleet.Pod(2)); after != before {
				t.Errorf("the unknown model reached a pod")
			}
		})
	}
}

func isSubset(a, b []int) bool {
	for _, x := range a {
		if !slices.Contains(b, x) {
			return false
		}
	}
	return true
}

func modelIDs(t *testing.T, api string) []string {
	t.Helper()
	resp, err := http.Get(api + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var list struct {
		Object string `json:"object"`
		Data   []struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil || list.Object != "list" {
		return nil
	}
	var ids []string
	for _, m := range list.Data {
		ids = append(ids, m.ID)
	}
	slices.Sort(ids)
	return ids
}

func postCompletion(t *testing.T, api, model, prompt string) (int, string) {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"model": model, "prompt": prompt, "max_tokens": 2})
	resp, err := http.Post(api+"/v1/completions", "application/json", strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// TestLoRASlotRouting: two pods serving adapters a and b with vLLM's
// default --max-loras 1. While one pod runs a long request for a, kvroute
// (scraping vllm:lora_requests_info) sends requests for b to the other
// pod, where they need not wait for an adapter slot, and /debug/route shows
// the wait it avoided.
func TestLoRASlotRouting(t *testing.T) {
	fleet, err := sim.StartFleetOf(
		sim.Config{TimeScale: 5, Model: "base", LoRAs: []string{"a", "b"}},
		sim.Config{TimeScale: 5, Model: "base", LoRAs: []string{"a", "b"}, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fleet.Close() })
	addrs, stop := startKvroute(t, "--backends", strings.Join(fleet.URLs(), ","),
		"--models-interval", "100ms", "--scrape-interval", "200ms")
	defer stop()
	api, admin := "http://"+addrs.API, "http://"+addrs.Admin
	// Until kvroute has read both pods' model lists (it counts a request
	// against an adapter slot only where the list names it an adapter).
	for deadline := time.Now().Add(10 * time.Second); !modelsKnown(t, admin, 2); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("kvroute never read both pods' model lists")
		}
	}

	// A long request for a: 3,000 tokens, ≈ 5 s of wall time.
	long := make(chan int, 1)
	go func() {
		b, _ := json.Marshal(map[string]any{"model": "a", "prompt": "a long answer, please", "max_tokens": 3000, "ignore_eos": true})
		resp, err := http.Post(api+"/v1/completions", "application/json", strings.NewReader(string(b)))
		if err != nil {
			long <- 0
			return
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		long <- resp.StatusCode
	}()
	// Until kvroute's scrape shows the slot taken: /debug/route for b
	// names the pod and the wait.
	var busy string
	for deadline := time.Now().Add(10 * time.Second); busy == ""; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("kvroute never saw an engine run out of LoRA slots")
		}
		for _, term := range explainRoute(t, admin, `{"model":"b","prompt":"probe"}`) {
			if term.LoRASlotWaitSec > 0 {
				busy = term.Endpoint
			}
		}
	}
	pods := map[string]*sim.Pod{fleet.URLs()[0]: fleet.Pod(0), fleet.URLs()[1]: fleet.Pod(1)}
	before := podRequests(t, pods[busy])
	for i := range 8 {
		if code, body := postCompletion(t, api, "b", fmt.Sprintf("question %d for b: %s", i, strings.Repeat("words ", 100))); code != 200 {
			t.Fatalf("b: %d %s", code, body)
		}
	}
	select {
	case code := <-long:
		t.Fatalf("the long request for a ended (%d) before the requests for b did: nothing was tested", code)
	default:
	}
	if n := podRequests(t, pods[busy]) - before; n != 0 {
		t.Errorf("%v requests for b went to %s, whose only LoRA slot a holds", n, busy)
	}
	if code := <-long; code != 200 {
		t.Errorf("the long request for a: %d", code)
	}
}

// modelsKnown reports whether /debug/endpoints shows n endpoints with
// their model lists read.
func modelsKnown(t *testing.T, admin string, n int) bool {
	t.Helper()
	resp, err := http.Get(admin + "/debug/endpoints")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var eps []struct {
		Models []string `json:"models"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&eps); err != nil {
		t.Fatalf("/debug/endpoints: %v", err)
	}
	known := 0
	for _, e := range eps {
		if len(e.Models) > 0 {
			known++
		}
	}
	return known == n
}

// explainRoute posts a completions body to /debug/route and returns the
// endpoints' terms.
func explainRoute(t *testing.T, admin, body string) []routing.Term {
	t.Helper()
	resp, err := http.Post(admin+"/debug/route?path=/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct {
		Endpoints []routing.Term `json:"endpoints"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatalf("/debug/route: %v", err)
	}
	return out.Endpoints
}
