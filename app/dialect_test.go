package app

import (
	"testing"

	"go.uber.org/zap"

	"github.com/kvroute/kvroute/discovery"
)

// TestEngineDialectFlag: --engine-dialect pins every endpoint's dialect
// in the Fleet the builder makes; auto leaves it to detection; an unknown
// name does not validate.
func TestEngineDialectFlag(t *testing.T) {
	for _, tc := range []struct {
		flag string
		want discovery.Dialect
	}{
		{flag: "auto", want: discovery.DialectUnknown},
		{flag: "ollama", want: discovery.DialectOllama},
		{flag: "llamacpp", want: discovery.DialectLlamaCpp},
	} {
		t.Run(tc.flag, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Backends, cfg.EngineDialect = []string{"http://127.0.0.1:9", "http://127.0.0.1:10"}, tc.flag
			if err := cfg.Validate(); err != nil {
				t.Fatal(err)
			}
			r, err := New(cfg, zap.NewNop())
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range r.Fleet.Endpoints() {
				if s.Dialect != tc.want {
					t.Errorf("%s: dialect %v, want %v", s.URL, s.Dialect, tc.want)
				}
			}
		})
	}
	cfg := DefaultConfig()
	cfg.Backends, cfg.EngineDialect = []string{"http://127.0.0.1:9"}, "tgi"
	if cfg.Validate() == nil {
		t.Error("--engine-dialect tgi validated")
	}
}
