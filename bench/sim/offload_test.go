package sim

import (
	"fmt"
	"slices"
	"testing"
)

// TestCPUTierServesEvictedPrefix: a prefix evicted from the GPU is loaded
// back from the CPU tier faster than a pod without one recomputes it, is
// counted as vLLM counts connector hits, and is announced on both media.
func TestCPUTierServesEvictedPrefix(t *testing.T) {
	const n = 1000            // prompt tokens: 62 full blocks and a partial one
	full := (n - 1) / 16 * 16 // the most a prefix can hit: vLLM recomputes the last token

	base := fastConfig()
	base.NumGPUBlocks = 80
	_, url := servePod(t, base)
	recompute := measureSecondA(t, url, n)

	cfg := base
	cfg.CPUBlocks = 200
	cfg.KVEventsPort = -1
	p, url := servePod(t, cfg)
	sub := subscribeKV(t, p, "")
	loaded := measureSecondA(t, url, n)

	t.Logf("second A: recomputed after %d GPU-hit tokens in %.1f ms; loaded %v CPU tokens after %v GPU tokens in %.1f ms",
		int(recompute.gpuHits), recompute.ttft*1e3, loaded.extHits, loaded.gpuHits, loaded.ttft*1e3)
	if recompute.gpuHits == 0 || recompute.gpuHits >= float64(full) || recompute.extHits != 0 {
		t.Fatalf("without a CPU tier: %+v, want a partial GPU hit and no external hits", recompute)
	}
	if loaded.gpuHits != recompute.gpuHits || loaded.extHits != float64(full)-loaded.gpuHits || loaded.cached != full {
		t.Errorf("with a CPU tier: %+v, want the same GPU hit, the rest of the %d-token prefix from the CPU, all cached", loaded, full)
	}
	if loaded.ttft >= recompute.ttft/2 {
		t.Errorf("TTFT %.1f ms with the CPU tier, %.1f ms recomputing: want the load much faster", loaded.ttft*1e3, recompute.ttft*1e3)
	}
	checkOffloadSeries(t, url)

	// The events: A's blocks were stored on both media; the reload stores
	// the loaded blocks on the GPU again, after the blocks that stayed.
	checkCPUTierEvents(t, sub, chainHashes(tokenPromptU32(1000, n), 16, rootHash(""))[:full/16], int(loaded.gpuHits)/16)
}

// secondA is what measureSecondA reports of the second A.
type secondA struct {
	ttft             float64
	cached           int
	gpuHits, extHits float64
}

// measureSecondA sends prompt A, then C (which evicts most of A from the 80
// GPU blocks), then A again, each n tokens, to the pod at url, and returns
// the second A's modelled TTFT (seconds), cached tokens and prefix-cache
// hits.
func measureSecondA(t *testing.T, url string, n int) secondA {
	t.Helper()
	promptA, promptC := tokenPrompt(1000, n), tokenPrompt(50000, n)
	c := newClient(t)
	send := func(prompt []int) completionJSON {
		t.Helper()
		code, _, body := post(t, c, url+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 1})
		if code != 200 {
			t.Fatalf("%d %s", code, body)
		}
		return decodeCompletion(t, body)
	}
	send(promptA)
	send(promptC)
	before := scrape(t, c, url)
	r := send(promptA)
	after := scrape(t, c, url)
	delta := func(name string) float64 { return metricValue(t, after, name) - metricValue(t, before, name) }
	return secondA{
		ttft: delta("vllm:time_to_first_token_seconds"), cached: r.Usage.cached(),
		gpuHits: delta("vllm:prefix_cache_hits_total"), extHits: delta("vllm:external_prefix_cache_hits_total"),
	}
}

// checkOffloadSeries checks that the pod at url exports vLLM's offloading
// metrics for both transfer types, each with some transfer counted.
func checkOffloadSeries(t *testing.T, url string) {
	t.Helper()
	mfs := scrape(t, newClient(t), url)
	for _, name := range []string{"vllm:kv_offload_total_bytes_total", "vllm:kv_offload_total_time_total", "vllm:kv_offload_size"} {
		for _, m := range mfs[name].GetMetric() {
			if v := m.GetCounter().GetValue() + m.GetHistogram().GetSampleSum(); v <= 0 {
				t.Errorf("%s %v: %v", name, m.GetLabel(), v)
			}
		}
		if len(mfs[name].GetMetric()) != 2 {
			t.Errorf("%s: %d series, want GPU_to_CPU and CPU_to_GPU", name, len(mfs[name].GetMetric()))
		}
	}
}

// checkCPUTierEvents checks sub's events of the second A, whose first
// gpuHit of hashesA (A's full blocks) stayed on the GPU: A's blocks were
// stored on the CPU as vLLM's OffloadingConnector announces them, the
// reload removed none of them from the CPU and stored the rest on the GPU
// again, after the GPU evicted exactly those.
func checkCPUTierEvents(t *testing.T, sub *kvSub, hashesA []uint64, gpuHit int) {
	t.Helper()
	batches := sub.until(t, func(e kvTestEvent) bool {
		return e.Type == "BlockStored" && e.Medium == "GPU" && e.Parent != nil && *e.Parent == hashesA[gpuHit-1]
	})
	var cpuStored []uint64
	for _, e := range kvEventsOf(batches, "BlockStored", "CPU") {
		if e.Parent != nil || len(e.Tokens) != 0 || e.LoraID != nil || e.BlockSize != 16 {
			t.Errorf("CPU store %+v, want no parent, no tokens, no LoRA, block size 16 (vLLM's OffloadingConnector)", e)
		}
		cpuStored = append(cpuStored, e.Hashes...)
	}
	if !slices.Equal(cpuStored[:len(hashesA)], hashesA) {
		t.Errorf("CPU stores begin %x, want A's blocks %x", cpuStored[:len(hashesA)], hashesA)
	}
	var gpuRemoved []uint64 // of A's blocks; the reload evicts C's too
	for _, e := range kvEventsOf(batches, "BlockRemoved", "GPU") {
		if slices.Contains(hashesA, e.Hashes[0]) {
			gpuRemoved = append(gpuRemoved, e.Hashes...)
		}
	}
	slices.Sort(gpuRemoved)
	evicted := slices.Clone(hashesA[gpuHit:])
	slices.Sort(evicted)
	if !slices.Equal(gpuRemoved, evicted) {
		t.Errorf("GPU removals %x, want A's blocks after the GPU hit %x", gpuRemoved, evicted)
	}
	gpuStores := kvEventsOf(batches, "BlockStored", "GPU")
	if last := gpuStores[len(gpuStores)-1]; !slices.Equal(last.Hashes, hashesA[gpuHit:]) || len(last.Tokens) != len(last.Hashes)*16 {
		t.Errorf("reload stored %x on the GPU with %d tokens, want %x", last.Hashes, len(last.Tokens), hashesA[gpuHit:])
	}
	if len(kvEventsOf(batches, "BlockRemoved", "CPU")) != 0 {
		t.Error("CPU removals with room in the tier")
	}
}

// TestCPUTierEviction: a full CPU tier evicts its least recently used
// blocks, each announced as a BlockRemoved on the CPU medium before the
// store that needed the room.
func TestCPUTierEviction(t *testing.T) {
	cfg := fastConfig()
	cfg.CPUBlocks = 4
	cfg.KVEventsPort = -1
	p, url := servePod(t, cfg)
	sub := subscribeKV(t, p, "")
	c := newClient(t)
	var batches []kvTestBatch
	for _, first := range []int{100, 200} {
		code, _, body := post(t, c, url+"/v1/completions", map[string]any{"prompt": tokenPrompt(first, 50), "max_tokens": 1})
		if code != 200 {
			t.Fatalf("%d %s", code, body)
		}
		batches = append(batches, sub.until(t, func(e kvTestEvent) bool { return e.Type == "BlockStored" && e.Medium == "CPU" })...)
	}
	a := chainHashes(tokenPromptU32(100, 50), 16, rootHash(""))
	b := chainHashes(tokenPromptU32(200, 50), 16, rootHash(""))
	var got []string
	for _, bt := range batches {
		for _, e := range bt.Events {
			if e.Medium == "CPU" {
				got = append(got, e.Type+" "+hexList(e.Hashes))
			}
		}
	}
	want := []string{"BlockStored " + hexList(a), "BlockRemoved " + hexList(a[:1]), "BlockRemoved " + hexList(a[1:2]), "BlockStored " + hexList(b)}
	if !slices.Equal(got, want) {
		t.Errorf("CPU events\n%q\nwant\n%q", got, want)
	}
}

func hexList(hs []uint64) string { return fmt.Sprintf("%x", hs) }
