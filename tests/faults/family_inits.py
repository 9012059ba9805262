"""Planted init mistakes on issue 39's families (tests/test_init_families.py): each model file here builds
its family as examples/families/ does, then gives the root an initialiser a user might write for
`init meta with METHOD`, the family's own `init_weights` followed by one mistake. build_model() initialises
as transformers does, so the init check's unsharded model is right, and `init meta with` the method is not.
Each mistake's tensor is one the family's correct plans had a false alarm on (issue 39, class 2)."""

import torch

from examples.families import gpt_oss, jamba, modernbert


class _AsTransformers:
    """transformers reads a class defined outside it as a user's code, and its initialiser then skips every
    module with no parameters of its own: these subclasses add one method and are otherwise the family's
    class, initialised as it is (the one mistake is the method's)."""

    @classmethod
    def is_custom_code(cls) -> bool:
        return False


class RoutersZeroed(_AsTransformers, gpt_oss.GptOssForCausalLM):
    """gpt-oss with an init that zeroes each router's bias, as a dense layer's would be: 4 elements, too
    small to test in distribution, and of scale 0 where the unsharded bias is drawn with std 0.02."""

    def init_weights_zeroing_routers(self) -> None:
        self.init_weights()
        for name, module in self.named_modules():
            if name.endswith("mlp.router"):
                torch.nn.init.zeros_(module.bias)


class ALogDrawn(_AsTransformers, jamba.JambaForCausalLM):
    """Jamba with an init that draws `mamba.A_log` as it draws a weight (normal, std 0.02), where the
    unsharded one holds log(1..d_state) on every row."""

    def init_weights_drawing_a_log(self) -> None:
        self.init_weights()
        for name, module in self.named_modules():
            if name.endswith(".mamba"):
                torch.nn.init.normal_(module.A_log, std=0.02)


class DecoderLast(_AsTransformers, modernbert.ModernBertForMaskedLM):
    """ModernBERT with an init that initialises the decoder last, with the decoder's std (the tied token
    embedding then holds std 0.01 truncated, half what transformers gives it): what `init meta` did before
    it initialised a tied tensor once, as its source."""

    def init_weights_decoder_last(self) -> None:
        self.init_weights()
        std = self.config.initializer_range / (2.0 * self.config.num_hidden_layers) ** 0.5
        torch.nn.init.trunc_normal_(self.decoder.weight, std=std, a=-3 * std, b=3 * std)


def _as(family, cls):
    """`family`'s model built by its own build_model(), as `cls` (the same tensors, one more method)."""
    model = family.build_model()
    model.__class__ = cls
    return model


def gpt_oss_routers_zeroed():
    return _as(gpt_oss, RoutersZeroed)


def jamba_a_log_drawn():
    return _as(jamba, ALogDrawn)


def modernbert_decoder_last():
    return _as(modernbert, DecoderLast)
