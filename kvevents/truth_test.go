package kvevents

import (
	"testing"

	"github.com/kvroute/kvroute/discovery"
	"github.com/kvroute/kvroute/prefix"
)

// TestEngineTruthTiers: with --kv-events-tiers off, blocks the engine
// copied to its CPU tier are not counted as held.
func TestEngineTruthTiers(t *testing.T) {
	ep, _ := discovery.NewEndpoint("http://127.0.0.1:1", discovery.RoleMixed)
	store := func(tier Tier) Batch {
		return Batch{Events: []Event{{Kind: BlockStored, BlockHashes: []uint64{7},
			TokenIDs: make([]uint32, 16), BlockSize: 16, Tier: tier}}}
	}
	for _, c := range []struct {
		name  string
		tiers bool
		cpu   int
	}{{"tiers on", true, 1}, {"tiers off", false, 0}} {
		t.Run(c.name, func(t *testing.T) {
			cfg := EngineTruthConfig{BlockBytes: 1024, Tiers: c.tiers} // kvroute's default block size
			et := NewEngineTruth(cfg, &discovery.Pool{}, prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: 8}), nil)
			for _, tier := range []Tier{TierGPU, TierCPU} {
				b := store(tier)
				et.KVBatch(ep, &b)
			}
			if got := et.truth.Stats().Blocks; got[0] != 1 || got[1] != c.cpu {
				t.Fatalf("blocks by tier %v, want [1 %d 0]", got, c.cpu)
			}
		})
	}
}
