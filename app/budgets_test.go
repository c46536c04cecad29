package app

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A bad --tenant-budgets file stops kvroute at start with an error naming
// the file, the tenant and the field; a good one is in force.
func TestBudgetsFileAtStart(t *testing.T) {
	dir := t.TempDir()
	for name, c := range map[string]struct{ file, want string }{
		"missing": {"", "no such file"},
		"typo":    {`{"tenants": {"batch": {"id": "default", "max_concurency": 3}}}`, `unknown field "max_concurency"`},
		"bad":     {`{"tenants": {"batch": {"id": "default", "weight": -2}}}`, `tenant "batch": weight -2`},
		"good":    {`{"tenants": {"batch": {"id": "default", "max_concurrency": 3}}}`, ""},
	} {
		cfg := DefaultConfig()
		cfg.Backends = []string{"http://127.0.0.1:9"}
		cfg.BudgetsFile = filepath.Join(dir, name+".json")
		if c.file != "" {
			if err := os.WriteFile(cfg.BudgetsFile, []byte(c.file), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		_, err := New(cfg, nil)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%s: %v", name, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), cfg.BudgetsFile)):
			t.Errorf("%s: error %v, want one naming the file and saying %q", name, err, c.want)
		}
	}
}
