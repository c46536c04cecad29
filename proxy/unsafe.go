package proxy

import "unsafe"

// b2s views b as a string without copying. The result is valid only while
// b is neither modified nor reused (here: until the request's parse state
// is released).
func b2s(b []byte) string {
	return unsafe.String(unsafe.SliceData(b), len(b))
}
