package main

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"
)

// maxFuncLines is the most lines a function may span, from its func
// keyword to its closing brace (issue #35): past that, a function is
// split into named helpers or table-driven subtests.
const maxFuncLines = 100

// houseSkipDirs are the directories TestNoLongFunctions does not walk:
// git's, the build output, and test inputs (which may be anything).
var houseSkipDirs = map[string]bool{".git": true, "bin": true, "testdata": true}

// TestNoLongFunctions fails for every function declaration or literal in
// the repository's Go files, tests included, that spans more than
// maxFuncLines lines. It parses syntax only (no type checking), so it
// stays fast.
func TestNoLongFunctions(t *testing.T) {
	fset := token.NewFileSet()
	files := 0
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if path != "." && houseSkipDirs[d.Name()] {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		files++
		ast.Inspect(f, func(n ast.Node) bool {
			var body *ast.BlockStmt
			name := "function literal"
			switch fn := n.(type) {
			case *ast.FuncDecl:
				body, name = fn.Body, fn.Name.Name
			case *ast.FuncLit:
				body = fn.Body
			}
			if body == nil { // not a function, or one declared without a body
				return true
			}
			start := fset.Position(n.Pos())
			if lines := fset.Position(body.End()).Line - start.Line + 1; lines > maxFuncLines {
				t.Errorf("%s:%d: %s spans %d lines, over %d: split it into named helpers or table-driven subtests",
					start.Filename, start.Line, name, lines, maxFuncLines)
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files == 0 {
		t.Fatal("no Go files found: the test must run in the repository's root")
	}
}
