"""Explain: what every rank of a world would hold and send, simulated in one process, and pictures of it."""
