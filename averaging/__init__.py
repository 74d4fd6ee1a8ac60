"""Decentralized parameter averaging: DHT matchmaking, butterfly all-reduce in groups."""
