package main

import (
	"io"
	"os"
	"strings"
	"testing"
)

// flagsDoc is the page that holds the generated flag reference.
const flagsDoc = "docs/flags.md"

const (
	flagsBegin = "<!-- flags:begin (generated from the flag definitions by TestFlagReference; KVROUTE_UPDATE_DOCS=1 go test -run TestFlagReference . rewrites it) -->\n"
	flagsEnd   = "<!-- flags:end -->"
)

// TestFlagReference keeps the flag reference in docs/flags.md equal to what
// the flag definitions generate. With KVROUTE_UPDATE_DOCS=1 it rewrites the
// reference between the markers instead of failing.
func TestFlagReference(t *testing.T) {
	defaults, err := parseConfig(nil, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	want := newFlags(defaults).Markdown()
	doc, err := os.ReadFile(flagsDoc)
	if err != nil {
		t.Fatal(err)
	}
	s := string(doc)
	i, j := strings.Index(s, flagsBegin), strings.Index(s, flagsEnd)
	if i < 0 || j < i {
		t.Fatalf("%s has no flag reference between %q and %q", flagsDoc, strings.TrimSpace(flagsBegin), flagsEnd)
	}
	got := s[i+len(flagsBegin) : j]
	if got == want {
		return
	}
	if os.Getenv("KVROUTE_UPDATE_DOCS") == "1" {
		if err := os.WriteFile(flagsDoc, []byte(s[:i+len(flagsBegin)]+want+s[j:]), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	t.Errorf("%s's flag reference is stale: run KVROUTE_UPDATE_DOCS=1 go test -run TestFlagReference .", flagsDoc)
}
