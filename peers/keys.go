package peers

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"fmt"
	"os"
	"strings"
)

// maxKeys bounds a key file: the primary and the keys kept for a rotation.
const maxKeys = 16

// ReadKeys reads a gossip key file: one base64 key per line (16, 24 or 32
// bytes decoded: AES-128, -192 or -256), the first the primary, with which
// messages are sent; the others are still accepted, for a rotation. Blank
// lines and lines starting with # are skipped.
func ReadKeys(path string) ([][]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("gossip key file: %w", err)
	}
	keys, err := ParseKeys(b)
	if err != nil {
		return nil, fmt.Errorf("gossip key file %s: %w", path, err)
	}
	return keys, nil
}

// ParseKeys parses a key file's contents (see ReadKeys).
func ParseKeys(b []byte) ([][]byte, error) {
	var keys [][]byte
	sc := bufio.NewScanner(bytes.NewReader(b))
	for line := 1; sc.Scan(); line++ {
		s := strings.TrimSpace(sc.Text())
		if s == "" || strings.HasPrefix(s, "#") {
			continue
		}
		k, err := base64.StdEncoding.DecodeString(s)
		if err != nil {
			return nil, fmt.Errorf("line %d: not base64", line)
		}
		switch len(k) {
		case 16, 24, 32:
		default:
			return nil, fmt.Errorf("line %d: a key of %d bytes; want 16, 24 or 32 (e.g. openssl rand -base64 32)", line, len(k))
		}
		if len(keys) == maxKeys {
			return nil, fmt.Errorf("more than %d keys", maxKeys)
		}
		keys = append(keys, k)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("no key")
	}
	return keys, nil
}
