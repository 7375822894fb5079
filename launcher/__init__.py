"""Rank layout, spawning, start-up handshake, supervision and teardown of one node's processes."""
