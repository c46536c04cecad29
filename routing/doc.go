// Package routing decides which endpoint serves a request. It owns the
// parsed view of an inference request (Request), the Picker seam, the table
// of policies by name (Policies: round-robin, random, least-request and the
// prefix-aware, sticky-until-saturated prefix policy) and the Decision they
// return. The basic policies never block or allocate; the prefix policy
// takes its index's and its homes' mutexes for microseconds per pick and
// allocates only when a new prefix key arrives.
package routing
