package main

import (
	"io"
	"os"
	"strings"
	"testing"
)

const (
	flagsBegin = "<!-- flags:begin (generated from the flag definitions by TestFlagReference; KVROUTE_UPDATE_README=1 go test -run TestFlagReference . rewrites it) -->\n"
	flagsEnd   = "<!-- flags:end -->"
)

// TestFlagReference keeps the README's flag reference equal to what the
// flag definitions generate.
func TestFlagReference(t *testing.T) {
	defaults, err := parseConfig(nil, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	want := newFlags(defaults).Markdown()
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	s := string(readme)
	i, j := strings.Index(s, flagsBegin), strings.Index(s, flagsEnd)
	if i < 0 || j < i {
		t.Fatalf("README.md has no flag reference between %q and %q", strings.TrimSpace(flagsBegin), flagsEnd)
	}
	got := s[i+len(flagsBegin) : j]
	if got == want {
		return
	}
	if os.Getenv("KVROUTE_UPDATE_README") == "1" {
		if err := os.WriteFile("README.md", []byte(s[:i+len(flagsBegin)]+want+s[j:]), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	t.Errorf("README.md's flag reference is stale: run KVROUTE_UPDATE_README=1 go test -run TestFlagReference .")
}
