package main

import (
	"runtime"
	"runtime/debug"
)

// version and revision are stamped at build time:
//
//	go build -ldflags "-X main.version=v1.2.3 -X main.revision=$(git rev-parse HEAD)"
//
// (the Dockerfile's VERSION and REVISION build arguments, the Makefile's
// build). Unstamped, they come from the Go build information: the module's
// version under `go install`, the VCS revision of a checkout build.
var version, revision string

// buildInfo is kvroute's version, revision and Go version.
type buildInfo struct{ Version, Revision, GoVersion string }

func readBuildInfo() buildInfo {
	b := buildInfo{Version: version, Revision: revision, GoVersion: runtime.Version()}
	if bi, ok := debug.ReadBuildInfo(); ok {
		if b.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			b.Version = bi.Main.Version
		}
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" && b.Revision == "" {
				b.Revision = s.Value
			}
		}
	}
	if b.Version == "" {
		b.Version = "dev"
	}
	if b.Revision == "" {
		b.Revision = "unknown"
	}
	return b
}

func (b buildInfo) String() string {
	return "kvroute " + b.Version + " (revision " + b.Revision + ", " + b.GoVersion + ")"
}
