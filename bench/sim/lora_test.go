package sim

import (
	"encoding/json"
	"fmt"
	"testing"
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
