"""Checkpoints that outlive a plan: save, load and convert model and optimizer state at any world size."""
