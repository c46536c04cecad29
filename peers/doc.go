// Package peers is the gossip between kvroute replicas
// (github.com/hashicorp/memberlist): each replica sends the placements it
// makes (a prompt's chain of block hashes → the endpoint it went to) to
// every other replica, which merges them into its prefix index, so that a
// prefix placed by any replica is a warm route for all of them. Replicas
// find each other through a static list of gossip addresses; gossip runs
// on its own port, encrypted and authenticated with a shared key
// (memberlist's keyring) except on loopback addresses.
//
// What a peer can change: it can only add claims that an endpoint this
// replica routes to holds some prompt blocks — bounded by that endpoint's
// share of the index, expiring with the index's TTL, and dropped when its
// hashing configuration differs. It cannot remove claims, nor change
// endpoints, health, loads, homes or parameters. A malformed message is
// refused whole (fuzzed: FuzzDecode).
package peers
