"""transformers' ViTForImageClassification (ViT), from a small ViTConfig: its patch embedding is a Conv2d,
a 4-D weight (issue 39). 2 layers, hidden 64, 16x16 images in 4x4 patches, 10 classes; the loss is
cross-entropy on random labels drawn from the images' own generator."""

import torch
import torch.nn.functional as F
from transformers import ViTConfig, ViTForImageClassification

CLASSES = 10


def build_model() -> ViTForImageClassification:
    config = ViTConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=16,
        patch_size=4,
        num_labels=CLASSES,
        attn_implementation="sdpa",
    )
    return ViTForImageClassification(config)


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, 3, 16, 16, generator=generator)  # pixel values


def loss(output, pixels: torch.Tensor) -> torch.Tensor:
    labels = (pixels.flatten(1).sum(1) > 0).long()  # a label each image's pixels decide
    return F.cross_entropy(output.logits, labels)
