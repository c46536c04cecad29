package sim

import (
	"errors"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

// engineConfig is e on a zero Config, defaults filled.
func engineConfig(t *testing.T, e Engine) Config {
	t.Helper()
	var c Config
	e.Fill(&c)
	if err := c.Validate(); err != nil {
		t.Fatalf("%s: %v", e.Name, err)
	}
	return c
}

func TestProfileTable(t *testing.T) {
	ps := Profiles()
	if ps[0].Name != DefaultProfile {
		t.Fatalf("first profile %q, want the default", ps[0].Name)
	}
	if got := ProfileNames(); !slices.Equal(got, []string{ProfileH100_8B, ProfileA100_8B, ProfileSlowLarge, ProfileFastSmall, ProfileMixed}) {
		t.Fatalf("ProfileNames() = %v", got)
	}
	for _, p := range ps {
		t.Run(p.Name, func(t *testing.T) {
			if p.About == "" || len(p.Engines) == 0 {
				t.Fatalf("profile %+v lacks a description or engines", p)
			}
			for _, e := range p.Engines {
				c := engineConfig(t, e)
				if e.Name == "" || c.Model != p.Engines[0].Model {
					t.Errorf("engine %q serves %q; every pod of a fleet must serve %q", e.Name, c.Model, p.Engines[0].Model)
				}
				// Every engine field is set, so no default leaks in.
				v := reflect.ValueOf(e)
				for i := range v.NumField() {
					if v.Field(i).IsZero() {
						t.Errorf("engine %s: %s is zero", e.Name, v.Type().Field(i).Name)
					}
				}
			}
			got, err := LookupProfile(p.Name)
			if err != nil || !reflect.DeepEqual(got, p) {
				t.Fatalf("LookupProfile(%q) = %+v, %v", p.Name, got, err)
			}
		})
	}
	if p, err := LookupProfile(""); err != nil || p.Name != DefaultProfile {
		t.Errorf(`LookupProfile("") = %q, %v`, p.Name, err)
	}
	if _, err := LookupProfile("tpu-v5"); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "slow-large") {
		t.Errorf("unknown profile: %v", err)
	}
}

// h100-8b is DefaultConfig, field for field.
func TestDefaultProfileIsDefaultConfig(t *testing.T) {
	p, _ := LookupProfile(DefaultProfile)
	if got := engineConfig(t, p.Engines[0]); !reflect.DeepEqual(got, DefaultConfig()) {
		t.Fatalf("h100-8b = %+v\nDefaultConfig = %+v", got, DefaultConfig())
	}
}

// The figures each profile's comment documents, in modelled time from
// StepCost: decode steps (2,048-token contexts) at several batch sizes and
// the step of a cold 2,048-token prompt.
func TestProfileFigures(t *testing.T) {
	m := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	type fig struct {
		name         string
		prefill, ctx int
		lo, hi       time.Duration
	}
	for _, tc := range []struct {
		engine Engine
		figs   []fig
	}{
		{engine: engineH100_8B, figs: []fig{
			{name: "decode batch 1", ctx: 2048, lo: m(6.9), hi: m(7.0)},
			{name: "decode batch 64", ctx: 64 * 2048, lo: m(14.2), hi: m(14.4)},
			{name: "cold 2,048 prompt", prefill: 2048, ctx: 2048, lo: m(121), hi: m(123)}}},
		{engine: engineA100_8B, figs: []fig{
			{name: "decode batch 1", ctx: 2048, lo: m(11.1), hi: m(11.3)},
			{name: "decode batch 64", ctx: 64 * 2048, lo: m(23.2), hi: m(23.4)},
			{name: "cold 2,048 prompt", prefill: 2048, ctx: 2048, lo: m(360), hi: m(365)}}},
		{engine: engine4xA100_70B, figs: []fig{
			{name: "decode batch 1", ctx: 2048, lo: m(27.5), hi: m(27.8)},
			{name: "decode batch 8 (max_num_seqs)", ctx: 8 * 2048, lo: m(28.4), hi: m(28.6)},
			{name: "cold 2,048 prompt", prefill: 2048, ctx: 2048, lo: m(1000), hi: m(1020)}}},
		{engine: engineH100_3B, figs: []fig{
			{name: "decode batch 1", ctx: 2048, lo: m(3.1), hi: m(3.3)},
			{name: "decode batch 16", ctx: 16 * 2048, lo: m(4.6), hi: m(4.8)},
			{name: "decode batch 64", ctx: 64 * 2048, lo: m(9.5), hi: m(9.7)},
			{name: "cold 2,048 prompt", prefill: 2048, ctx: 2048, lo: m(49), hi: m(51)}}},
	} {
		c := engineConfig(t, tc.engine)
		for _, f := range tc.figs {
			t.Run(tc.engine.Name+"/"+f.name, func(t *testing.T) {
				if d := c.StepCost(f.prefill, f.ctx); d < f.lo || d > f.hi {
					t.Errorf("StepCost(%d, %d) = %v, want [%v, %v]", f.prefill, f.ctx, d, f.lo, f.hi)
				}
			})
		}
	}
}

// The bands the profiles stand for: slow-large 1–3k prefill tokens/s and
// 20–40 ms per output token at its batch limit; fast-small ≥ 50k tokens/s
// and ≈ 5 ms per token; a100-8b a third of h100-8b's prefill rate and
// ≈ 0.6 of its decode speed.
func TestProfileBands(t *testing.T) {
	perToken := func(c Config, batch int) time.Duration { return c.StepCost(0, batch*2048) }
	// prefillRate is tokens/s of the prompt-dependent part of a prefill.
	prefillRate := func(c Config) float64 {
		return 4096 / (c.StepCost(8192, 0) - c.StepCost(4096, 0)).Seconds()
	}
	h100, a100 := engineConfig(t, engineH100_8B), engineConfig(t, engineA100_8B)
	slow, fast := engineConfig(t, engine4xA100_70B), engineConfig(t, engineH100_3B)
	checks := []struct {
		name   string
		v      float64
		lo, hi float64
	}{
		{name: "slow-large prefill tokens/s", v: prefillRate(slow), lo: 1000, hi: 3000},
		{name: "slow-large ms/token at max_num_seqs", v: ms(perToken(slow, slow.MaxNumSeqs)), lo: 20, hi: 40},
		{name: "slow-large max_num_seqs", v: float64(slow.MaxNumSeqs), lo: 8, hi: 8},
		{name: "fast-small prefill tokens/s", v: prefillRate(fast), lo: 0.999 * 50000, hi: 1e9}, // ns truncation
		{name: "fast-small ms/token at batch 16", v: ms(perToken(fast, 16)), lo: 4, hi: 6},
		{name: "fast-small max_num_seqs", v: float64(fast.MaxNumSeqs), lo: 256, hi: 256},
		{name: "a100/h100 prefill rate", v: prefillRate(a100) / prefillRate(h100), lo: 0.28, hi: 0.36},
		{name: "h100/a100 decode step at batch 1", v: float64(perToken(h100, 1)) / float64(perToken(a100, 1)), lo: 0.5, hi: 0.7},
	}
	for _, c := range checks {
		if c.v < c.lo || c.v > c.hi {
			t.Errorf("%s = %.4g, want [%g, %g]", c.name, c.v, c.lo, c.hi)
		}
	}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// A fleet of a profile: engines alternate, seeds count up, explicit
// settings win over the profile's.
func TestProfileConfigs(t *testing.T) {
	p, _ := LookupProfile(ProfileMixed)
	cfgs := p.Configs(5, Config{Seed: 10, NumGPUBlocks: 1463, TimeScale: 2})
	for i, c := range cfgs {
		want := engineA100_8B
		if i%2 == 0 {
			want = engineH100_8B
		}
		if c.Seed != 10+uint64(i) || c.NumGPUBlocks != 1463 || c.TimeScale != 2 ||
			c.MemBandwidth != want.MemBandwidth || c.PrefillTokensPerSec != want.PrefillTokensPerSec {
			t.Errorf("pod %d: %+v, want engine %s with the explicit settings", i, c, want.Name)
		}
	}
	var c Config
	if err := c.ApplyProfile(ProfileSlowLarge); err != nil || c.MaxNumSeqs != 8 || c.TPSize != 4 {
		t.Errorf("ApplyProfile(slow-large): %v, %+v", err, c)
	}
	if err := c.ApplyProfile(ProfileMixed); !errors.Is(err, ErrConfig) {
		t.Errorf("ApplyProfile(mixed) = %v, want an ErrConfig", err)
	}
}

// A mixed fleet starts, its pods configured per engine and serving one
// model name.
func TestStartProfileFleet(t *testing.T) {
	p, _ := LookupProfile(ProfileMixed)
	f, err := StartProfileFleet(p, 2, fastConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	c := newClient(t)
	for i := range f.Len() {
		if got, want := f.Pod(i).Config().MemBandwidth, p.Engine(i).MemBandwidth; got != want {
			t.Errorf("pod %d bandwidth %g, want %g", i, got, want)
		}
		code, body := get(t, c, f.URL(i)+"/v1/models")
		if code != 200 || !strings.Contains(string(body), p.Engines[0].Model) {
			t.Errorf("pod %d /v1/models: %d %s", i, code, body)
		}
	}
}
