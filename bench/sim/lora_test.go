package sim

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"
)

// A pod with LoRA adapters serves them as models, lists them in
// /v1/models with the base model as their parent, and refuses other names.
func TestLoRAAdapters(t *testing.T) {
	_, url := servePod(t, Config{TimeScale: 1000, Model: "base", LoRAs: []string{"sql-lora", "chat-lora"}})
	c := newClient(t)
	for model, want := range map[string]int{"base": 200, "sql-lora": 200, "chat-lora": 200, "other-lora": 404} {
		code, _, body := post(t, c, url+"/v1/completions", `{"model":"`+model+`","prompt":"hi","max_tokens":1}`)
		if code != want {
			t.Errorf("model %s: %d %s, want %d", model, code, body, want)
		}
	}
	resp, err := c.Get(url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var list struct {
		Data []struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, m := range list.Data {
		p := "<nil>"
		if m.Parent != nil {
			p = *m.Parent
		}
		got = append(got, m.ID+"<"+p)
	}
	if want := "[base<<nil> sql-lora<base chat-lora<base]"; fmt.Sprint(got) != want {
		t.Errorf("/v1/models %v, want %s", got, want)
	}
}

// With --max-loras 1 a request for a second adapter waits, skipped by the
// scheduler with room in the batch, until the first adapter's request is
// done, while the base model runs beside it; vllm:lora_requests_info names
// the running and waiting adapters as vLLM's does.
func TestMaxLoRAs(t *testing.T) {
	_, url := servePod(t, Config{TimeScale: 20, Model: "base", LoRAs: []string{"a", "b"}, MaxLoRAs: 1})
	c := newClient(t)
	send := func(model string, tokens int, done chan<- time.Time) {
		go func() {
			code, _, body := post(t, c, url+"/v1/completions",
				fmt.Sprintf(`{"model":%q,"prompt":"hello there","max_tokens":%d,"ignore_eos":true}`, model, tokens))
			if code != 200 {
				t.Errorf("%s: %d %s", model, code, body)
			}
			done <- time.Now()
		}()
	}
	// info returns the labels of vllm:lora_requests_info.
	info := func() map[string]string {
		mf := scrape(t, c, url)["vllm:lora_requests_info"]
		if mf == nil || len(mf.GetMetric()) != 1 {
			t.Fatalf("vllm:lora_requests_info: %v", mf)
		}
		l := map[string]string{}
		for _, p := range mf.GetMetric()[0].GetLabel() {
			l[p.GetName()] = p.GetValue()
		}
		return l
	}
	until := func(what string, ok func(map[string]string) bool) {
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			l := info()
			if ok(l) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: lora_requests_info %v", what, l)
			}
		}
	}
	if l := info(); l["max_lora"] != "1" || l["running_lora_adapters"] != "" {
		t.Fatalf("idle pod: %v", l)
	}
	aDone, bDone, baseDone := make(chan time.Time, 1), make(chan time.Time, 1), make(chan time.Time, 1)
	send("a", 1000, aDone) // 1,000 decode steps: ≈ 0.4 s of wall time
	until("a running", func(l map[string]string) bool { return l["running_lora_adapters"] == "a" })
	send("b", 1, bDone)
	until("b waiting", func(l map[string]string) bool {
		return l["running_lora_adapters"] == "a" && l["waiting_lora_adapters"] == "b"
	})
	// The base model runs beside a, while b still waits.
	send("base", 1, baseDone)
	<-baseDone
	if l := info(); l["running_lora_adapters"] != "a" || l["waiting_lora_adapters"] != "b" {
		t.Errorf("after a base-model request: %v, want a running and b waiting", l)
	}
	<-aDone
	<-bDone
}
