"""Emit: a lowered program printed as a plain torch module that a user can paste and run without shardlang."""
