package prefix

import "unsafe"

// unsafeBytes views s as a byte slice without copying. The caller must not
// modify the result.
func unsafeBytes(s string) []byte {
	return unsafe.Slice(unsafe.StringData(s), len(s))
}
