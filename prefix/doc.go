// Package prefix owns kvroute's view of prompt prefixes: the chained block
// hashing of a prompt's canonical rendering, and (with the prefix policy) the
// approximate index from block hashes to the endpoints believed to hold them.
// It imports nothing of kvroute's.
package prefix
