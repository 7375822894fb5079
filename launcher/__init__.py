"""Rank layout, the nodes' rendezvous, spawning, start-up handshake, supervision and teardown of one
node's processes."""
