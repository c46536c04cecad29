package main

import (
	"bytes"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"
)

// TestDocLinks keeps the Markdown files' relative links true: in every
// tracked (or new, not ignored) .md file, each link [x](path) and
// [x](path#anchor) outside code must name an existing file or directory,
// and each #anchor, in the same file or another .md file, a heading's
// GitHub slug there (or an HTML id/name). Links with a scheme (http:,
// https:, mailto:) are not followed.
func TestDocLinks(t *testing.T) {
	files := markdownFiles(t)
	if len(files) == 0 {
		t.Fatal("no Markdown files found")
	}
	docs := map[string]*mdDoc{} // by slash path, read once
	load := func(name string) (*mdDoc, error) {
		if d, ok := docs[name]; ok {
			return d, nil
		}
		data, err := os.ReadFile(filepath.FromSlash(name))
		if err != nil {
			return nil, err
		}
		d := parseMarkdown(data)
		docs[name] = d
		return d, nil
	}
	checked := 0
	for _, name := range files {
		d, err := load(name)
		if os.IsNotExist(err) {
			continue // tracked but deleted in the worktree
		}
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		for _, l := range d.links {
			checked++
			if msg := checkLink(name, l.target, load); msg != "" {
				t.Errorf("%s:%d: link %s: %s", name, l.line, l.target, msg)
			}
		}
	}
	t.Logf("%d relative links in %d Markdown files", checked, len(files))
}

// markdownFiles lists the repository's Markdown files as slash paths from
// the module root: git's tracked and untracked-but-not-ignored files, or,
// without git, a walk that skips .git, bin and fuzz corpora.
func markdownFiles(t *testing.T) []string {
	out, err := exec.Command("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "*.md").Output()
	if err == nil {
		var files []string
		for _, f := range strings.Split(string(out), "\x00") {
			if f != "" && !slices.Contains(files, f) {
				files = append(files, f)
			}
		}
		return files
	}
	t.Logf("git ls-files: %v; walking the tree instead", err)
	var files []string
	err = filepath.WalkDir(".", func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if e.IsDir() {
			switch {
			case p == ".git", p == "bin", e.Name() == "fuzz" && strings.Contains(filepath.ToSlash(p), "testdata/"):
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(p, ".md") {
			files = append(files, filepath.ToSlash(p))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// mdLink is one relative link and the line it is on (from 1).
type mdLink struct {
	target string
	line   int
}

// mdDoc is what the link check needs of a Markdown file: its relative
// links, and the anchors its headings and HTML ids define.
type mdDoc struct {
	links   []mdLink
	anchors map[string]bool
}

var (
	// mdInlineLink finds the destination of [text](dest) and ![alt](dest),
	// with an optional "title".
	mdInlineLink = regexp.MustCompile(`\]\(\s*<?([^)\s>]*)>?(?:\s+"[^"]*")?\s*\)`)
	// mdRefDef is a link reference definition: [label]: dest.
	mdRefDef   = regexp.MustCompile(`^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?`)
	mdATX      = regexp.MustCompile(`^ {0,3}#{1,6}(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$`)
	mdSetext   = regexp.MustCompile(`^ {0,3}(?:=+|-+)[ \t]*$`)
	mdFence    = regexp.MustCompile("^ {0,3}(`{3,}|~{3,})")
	mdHTMLID   = regexp.MustCompile(`<a\s[^>]*(?:name|id)\s*=\s*"([^"]+)"`)
	mdScheme   = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*:`)
	mdLineAnch = regexp.MustCompile(`^L\d+(-L\d+)?$`)
	// Rendered heading text: links keep their text, images their alt.
	mdHeadingLink = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`)
	mdHTMLTag     = regexp.MustCompile(`<[^>]+>`)
)

// parseMarkdown collects a file's relative links (outside fenced code and
// code spans) and its anchors: GitHub's slug of every ATX and setext
// heading, with -1, -2, ... on repeats, and every <a name/id>.
func parseMarkdown(data []byte) *mdDoc {
	d := &mdDoc{anchors: map[string]bool{}}
	seen := map[string]int{}
	addHeading := func(text string) {
		slug := githubSlug(text)
		if n, ok := seen[slug]; ok {
			for {
				n++
				s := fmt.Sprintf("%s-%d", slug, n)
				if _, taken := seen[s]; !taken {
					seen[slug] = n
					seen[s] = 0
					d.anchors[s] = true
					return
				}
			}
		}
		seen[slug] = 0
		d.anchors[slug] = true
	}
	var fence string // the open fence's marker run, "" outside
	prev := ""       // the previous line, when it could be a setext heading's text
	for i, line := range strings.Split(string(bytes.ReplaceAll(data, []byte("\r\n"), []byte("\n"))), "\n") {
		if fence != "" {
			if m := mdFence.FindStringSubmatch(line); m != nil && m[1][0] == fence[0] && len(m[1]) >= len(fence) &&
				strings.TrimSpace(line[strings.Index(line, m[1])+len(m[1]):]) == "" {
				fence = ""
			}
			continue
		}
		if m := mdFence.FindStringSubmatch(line); m != nil {
			fence, prev = m[1], ""
			continue
		}
		if mdSetext.MatchString(line) && prev != "" {
			addHeading(prev)
			prev = ""
			continue
		}
		text := stripCodeSpans(line)
		if m := mdATX.FindStringSubmatch(line); m != nil {
			addHeading(m[1])
			prev = ""
		} else if t := strings.TrimSpace(line); t == "" || strings.HasPrefix(t, "|") || strings.HasPrefix(t, ">") ||
			strings.HasPrefix(t, "- ") || strings.HasPrefix(t, "* ") || strings.HasPrefix(t, "<") {
			prev = ""
		} else {
			prev = t
		}
		for _, m := range mdHTMLID.FindAllStringSubmatch(text, -1) {
			d.anchors[m[1]] = true
		}
		for _, m := range mdInlineLink.FindAllStringSubmatch(text, -1) {
			d.addLink(m[1], i+1)
		}
		if m := mdRefDef.FindStringSubmatch(text); m != nil {
			d.addLink(m[1], i+1)
		}
	}
	return d
}

func (d *mdDoc) addLink(target string, line int) {
	if target == "" || mdScheme.MatchString(target) {
		return // a URL: http(s), mailto and the like are not followed
	}
	d.links = append(d.links, mdLink{target: target, line: line})
}

// stripCodeSpans blanks the code spans of a line: a run of n backticks up
// to the next run of exactly n.
func stripCodeSpans(line string) string {
	var b strings.Builder
	for i := 0; i < len(line); {
		if line[i] != '`' {
			b.WriteByte(line[i])
			i++
			continue
		}
		n := 0
		for i+n < len(line) && line[i+n] == '`' {
			n++
		}
		end := -1
		for j := i + n; j < len(line); {
			if line[j] != '`' {
				j++
				continue
			}
			m := 0
			for j+m < len(line) && line[j+m] == '`' {
				m++
			}
			if m == n {
				end = j + m
				break
			}
			j += m
		}
		if end < 0 { // no closing run: literal backticks
			b.WriteString(line[i : i+n])
			i += n
			continue
		}
		b.WriteString(strings.Repeat(" ", end-i))
		i = end
	}
	return b.String()
}

// githubSlug is the anchor GitHub gives a heading: its rendered text in
// lower case, with every character but letters, marks, digits, '-', '_'
// and spaces dropped, and each space made '-'.
func githubSlug(heading string) string {
	s := mdHeadingLink.ReplaceAllString(heading, "$1")
	s = mdHTMLTag.ReplaceAllString(s, "")
	s = strings.NewReplacer("`", "", "*", "").Replace(s)
	var b strings.Builder
	for _, r := range strings.ToLower(strings.TrimSpace(s)) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-', r == '_', unicode.IsLetter(r), unicode.IsDigit(r), unicode.IsNumber(r), unicode.IsMark(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// checkLink says what is wrong with a relative link from the Markdown
// file from (a slash path from the module root), or "" when it resolves.
func checkLink(from, target string, load func(string) (*mdDoc, error)) string {
	p, anchor, _ := strings.Cut(target, "#")
	p, err := url.PathUnescape(p)
	if err != nil {
		return fmt.Sprintf("bad escape in the path: %v", err)
	}
	if anchor, err = url.PathUnescape(anchor); err != nil {
		return fmt.Sprintf("bad escape in the anchor: %v", err)
	}
	if i := strings.IndexByte(p, '?'); i >= 0 {
		p = p[:i]
	}
	file := from
	if p != "" {
		if strings.HasPrefix(p, "/") {
			file = path.Clean(strings.TrimPrefix(p, "/")) // GitHub: from the repository's root
		} else {
			file = path.Join(path.Dir(from), p)
		}
		if file == ".." || strings.HasPrefix(file, "../") {
			return fmt.Sprintf("%s is outside the repository", file)
		}
		if _, err := os.Stat(filepath.FromSlash(file)); err != nil {
			return fmt.Sprintf("%s does not exist", file)
		}
	}
	if anchor == "" {
		return ""
	}
	if !strings.HasSuffix(file, ".md") {
		if mdLineAnch.MatchString(anchor) {
			return "" // GitHub's line anchors in a source file
		}
		return fmt.Sprintf("anchor #%s on %s, which is not a Markdown file", anchor, file)
	}
	d, err := load(file)
	if err != nil {
		return err.Error()
	}
	if !d.anchors[anchor] {
		return fmt.Sprintf("%s has no heading with the anchor #%s", file, anchor)
	}
	return ""
}

// TestDocLinksSlugs pins the link check's own rules: GitHub's heading
// slugs, repeated headings, and links inside code not being links.
func TestDocLinksSlugs(t *testing.T) {
	for _, tc := range []struct{ heading, slug string }{
		{heading: "Quick start", slug: "quick-start"},
		{heading: "Engine truth: KV-cache events", slug: "engine-truth-kv-cache-events"},
		{heading: "Prefix-aware routing (--policy prefix)", slug: "prefix-aware-routing---policy-prefix"},
		{heading: "Prefill/decode disaggregation (with a decode pool)", slug: "prefilldecode-disaggregation-with-a-decode-pool"},
		{heading: "The `kvroute_*` metrics, **all**", slug: "the-kvroute_-metrics-all"},
		{heading: "See [the docs](docs/x.md) — 2× faster", slug: "see-the-docs--2-faster"},
		{heading: "Ünïcode names", slug: "ünïcode-names"},
	} {
		if got := githubSlug(tc.heading); got != tc.slug {
			t.Errorf("githubSlug(%q) = %q, want %q", tc.heading, got, tc.slug)
		}
	}
	d := parseMarkdown([]byte("# A\n\n## A\n\nA\n---\n\nB\n===\n\n```md\n# Not\n[x](nowhere.md)\n```\n" +
		"`[y](nowhere.md)` [z](here.md#a-2) [w](https://example.com/x.md) <a id=\"custom\"></a>\n"))
	for _, a := range []string{"a", "a-1", "a-2", "b", "custom"} {
		if !d.anchors[a] {
			t.Errorf("anchor %q missing; have %v", a, d.anchors)
		}
	}
	if d.anchors["not"] {
		t.Error("a heading inside a code fence made an anchor")
	}
	if len(d.links) != 1 || d.links[0].target != "here.md#a-2" || d.links[0].line != 15 {
		t.Errorf("links = %+v, want only here.md#a-2 on line 15", d.links)
	}
}
