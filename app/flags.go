package app

import (
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/pflag"
)

// Flags is a command line's flags in titled groups: pflag lists every flag
// in one block, and kvroute's and kvbench's --help list them by topic.
// Add flags to the groups, then Parse.
type Flags struct {
	name, header string
	titles       []string
	groups       []*pflag.FlagSet
	all          *pflag.FlagSet
}

// NewFlags returns an empty command line; header opens its --help.
func NewFlags(name, header string) *Flags { return &Flags{name: name, header: header} }

// Group returns a new group of flags titled title; its flags are listed in
// the order they are added.
func (f *Flags) Group(title string) *pflag.FlagSet {
	fs := pflag.NewFlagSet(title, pflag.ContinueOnError)
	fs.SortFlags = false
	f.titles, f.groups = append(f.titles, title), append(f.groups, fs)
	return fs
}

// Parse parses args into the groups' flags. --help writes the usage to
// usage and returns pflag.ErrHelp; arguments that are not flags are an
// error. After Parse, All holds every flag.
func (f *Flags) Parse(args []string, usage io.Writer) error {
	f.all = pflag.NewFlagSet(f.name, pflag.ContinueOnError)
	f.all.SetOutput(io.Discard)
	f.all.Usage = func() {}
	for _, g := range f.groups {
		f.all.AddFlagSet(g)
	}
	if err := f.all.Parse(args); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			f.WriteUsage(usage)
		}
		return err
	}
	if f.all.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %q", f.all.Args())
	}
	return nil
}

// All returns the set of every flag (nil before Parse).
func (f *Flags) All() *pflag.FlagSet { return f.all }

// WriteUsage writes the header and every group's flags.
func (f *Flags) WriteUsage(w io.Writer) {
	fmt.Fprint(w, f.header)
	for i, g := range f.groups {
		fmt.Fprintf(w, "\n%s:\n%s", f.titles[i], g.FlagUsages())
	}
}

// Markdown returns the flags as Markdown tables, one per group under a
// second-level heading: name (with its value type), default and meaning,
// from the flag definitions (the flag reference in docs/flags.md is this,
// kept current by a test).
func (f *Flags) Markdown() string {
	var b strings.Builder
	for i, g := range f.groups {
		fmt.Fprintf(&b, "## %s\n\n| flag | default | meaning |\n|---|---|---|\n", f.titles[i])
		g.VisitAll(func(fl *pflag.Flag) {
			typ, usage := pflag.UnquoteUsage(fl)
			name := "`--" + fl.Name
			if typ != "" && fl.Value.Type() != "bool" {
				name += " " + typ
			}
			def := fl.DefValue
			switch {
			case def == "" || def == "[]":
				def = "—"
			case fl.Value.Type() == "string":
				def = "`" + def + "`"
			}
			fmt.Fprintf(&b, "| %s` | %s | %s |\n", name, def, strings.ReplaceAll(usage, "|", `\|`))
		})
		b.WriteString("\n")
	}
	return b.String()
}
