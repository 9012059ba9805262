"""The device a mesh is on: `auto` is cuda where there is a GPU, else cpu (printed programs paste this too)."""

from __future__ import annotations


def mesh_device(device):
    """The device type of a mesh: `auto` is cuda where there is a GPU, else cpu."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
