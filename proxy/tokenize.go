package proxy

import "github.com/kvroute/kvroute/discovery"

// Tokenizer is engine truth's tokenizer (kvevents.Tokenizer) as the
// request path sees it: Offer hands it the body forwarded to ep, whose
// prompt's rendering is promptBytes long with byte blocks hashes, to be
// tokenized off the request path. Offer copies what it keeps, never
// blocks, and is called concurrently.
type Tokenizer interface {
	Offer(ep *discovery.Endpoint, lora string, hashes []uint64, promptBytes int, body []byte)
}

// adapterOf returns model when ep serves it as a LoRA adapter (its engine
// keys the adapter's blocks apart), "" for the base model.
func adapterOf(ep *discovery.Endpoint, model string) string {
	if m := ep.Models(); m != nil && m.Adapter(model) {
		return model
	}
	return ""
}
