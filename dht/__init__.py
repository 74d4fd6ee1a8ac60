"""Kademlia DHT: trio-native, wire-compatible with the kademlia package, with expiring signed records."""
