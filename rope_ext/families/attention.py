"""Locating attention modules: what a family's locator says of each one (layer type, window, NoPE), in one place.

Family knowledge lives here, not in the installers: which modules are attention layers, the window a layer's
attention is limited to (Gemma 3's sliding layers, EXAONE 4's full layers that keep the config's window), the
layers that apply no rotary embedding (SmolLM3's ``use_rope``, EXAONE 4's hybrid NoPE layers), softcapping
that rope_ext's attention does not implement, and whether a family's attention runs the function transformers'
``AttentionInterface`` holds (Falcon picks SDPA or eager itself). The probes read a family's code or config class
once (``dispatches_through_interface``, ``rotation_refused``, ``softcapping``): ``rope_ext.families.support`` turns
them into what a family supports; ``attention_site`` applies them to one model.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from torch import nn

from rope_ext.installers.attention import AttentionLayer, AttentionSite
from rope_ext.installers.rotary import nope_layer_types


def is_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int)


@functools.cache
def dispatches_through_interface(cls: type) -> bool:
    """Whether an attention class's forward calls the function ``AttentionInterface`` holds for the config's
    implementation (Falcon's picks SDPA or eager itself, so a registered function would never run)."""
    return "ALL_ATTENTION_FUNCTIONS" in (source_of(cls.forward) or "")


def sliding_window(module: nn.Module) -> int | None:
    """The window a module's attention is limited to (what its forward passes as ``sliding_window``)."""
    if vars(module).get("is_sliding") is False:  # (EXAONE 4 keeps the config's window on its full layers too)
        return None
    if "sliding_window" in vars(module):
        return vars(module)["sliding_window"] or None
    return getattr(getattr(module, "config", None), "sliding_window", None) or None  # (0: none, as Qwen2-MoE says)


def applies_rope(module: nn.Module) -> bool:
    """Whether the module's forward applies the rotary embedding (not: SmolLM3's layers whose ``use_rope`` is off,
    EXAONE 4's full-attention layers in a hybrid, sliding-window model)."""
    attrs = vars(module)
    if "use_rope" in attrs:
        return bool(attrs["use_rope"])
    return not (attrs.get("is_sliding") is False and attrs.get("sliding_window") is not None)


def attention_layers(model: nn.Module, config: Any) -> list[AttentionLayer]:
    """The attention modules of ``model`` with each one's layer type (``config.layer_types``, if any), window and
    whether positions reach it."""
    found = []
    for module in model.modules():
        if is_attention(module):
            layer_types = getattr(module.config, "layer_types", None) or getattr(config, "layer_types", None)
            layer_type = layer_types[module.layer_idx] if layer_types else None
            nope = layer_type in nope_layer_types(module.config)  # (Beam's full layers: no rotary)
            found.append(AttentionLayer(module, layer_type, sliding_window(module), applies_rope(module) and not nope))
    return found


def attention_site(family: str, model: nn.Module, config: Any) -> AttentionSite | None:
    """The attention site of ``model``: its layers, the transformers model whose implementation they follow
    (the outermost one sharing their config), a reason programs are refused there (softcapping) and a reason the
    rotation cannot move into attention (``rotation_refused``)."""
    from transformers import PreTrainedModel

    layers = attention_layers(model, config)
    if not layers:
        return None
    layer_config = layers[0].module.config
    owner = next((m for m in model.modules() if isinstance(m, PreTrainedModel) and m.config is layer_config), model)
    softcap = getattr(layer_config, "attn_logit_softcapping", None)
    refused = None if softcap is None else softcapping_refused(softcap)
    chunk = getattr(layer_config, "attention_chunk_size", None)
    if refused is None and chunk:
        refused = chunking_refused(chunk)
    cls = type(layers[0].module)
    return AttentionSite(family, layers, owner, refused, rotation_refused(cls), softmax_scale_rule(cls))


@functools.cache
def softmax_scale_rule(cls: type):
    """The function an attention class's ``__init__`` derives its softmax scale with from the rope parameters: its
    modeling module's ``yarn_apply_mscale`` (DeepSeek-V2/V3, Kimi, GLM-4 MoE Lite, MiniCPM3 and their kin multiply
    it by YaRN's ``mscale(factor, mscale_all_dim)`` squared), read off its source; ``None``: its scale does not
    follow the rope parameters."""
    import sys

    rule = getattr(sys.modules.get(cls.__module__), "yarn_apply_mscale", None)
    calls = "yarn_apply_mscale(" in (source_of(cls.__init__) or "")
    return rule if calls and callable(rule) else None


@functools.cache
def rotation_refused(cls: type) -> str | None:
    """Why queries and keys of this attention class cannot be rotated at attention time instead of by its own
    forward (``None``: they can). Position rules need it: they get q and k unrotated and rotate them in HF's
    ``rotate_half`` layout right before attention. Two things break that, read off the family's own code:

    * its ``apply_rotary_pos_emb`` pairs dims another way (GLM-4, ERNIE 4.5 interleave them): probed on random
      queries against ``rotate``;
    * its forward changes queries or keys after rotating them (HunYuan applies its q/k norm after RoPE): read off
      the forward's source, a ``query_states``/``key_states`` assignment from a module call after the rotation;
    * it rotates the last dims of each head (DeepSeek's multi-head latent attention: ``cat((q_pass, q_rot))``).
    """
    import sys

    import torch

    from rope_ext.methods.frequency import default_inv_freq
    from rope_ext.methods.rope import rope_cos_sin, rotate

    modeling = sys.modules.get(cls.__module__)
    apply = getattr(modeling, "apply_rotary_pos_emb", None)
    if not callable(apply):  # (Llama 4's apply_rotary_emb multiplies complex tables)
        return ("its attention applies rotary positions with a function of its own (no apply_rotary_pos_emb), which "
                "rope_ext's attention-time rotation does not reproduce")
    if callable(apply):
        generator = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, 5, 8, generator=generator)
        inv_freq = default_inv_freq(10000.0, 8)
        positions = torch.arange(5)
        cos, sin = rope_cos_sin(positions[None], inv_freq, 1.0)
        try:
            rotated, _ = apply(q, q, cos, sin)
        except Exception:  # noqa: BLE001  (one tensor a call: Gemma 4's apply(x, cos, sin, unsqueeze_dim))
            try:
                rotated = apply(q, cos, sin)
            except Exception:  # noqa: BLE001  (a signature of its own: not the standard layout)
                rotated = None
        expected = rotate(q, positions, inv_freq, 1.0)
        same = torch.is_tensor(rotated) and rotated.shape == q.shape and torch.allclose(rotated, expected, atol=1e-6)
        if not same:
            return (
                "its attention applies rotary positions in a pair layout of its own (not HF's rotate_half), which "
                "rope_ext's attention-time rotation does not reproduce"
            )
    source = source_of(cls.forward)
    if source is None:
        return None
    if any(_changed_after_rotation(source, name) for name in ("query", "key")):
        return (
            "its attention transforms queries and keys after rotating them (a norm after RoPE), so they cannot be "
            "rotated at attention time instead"
        )
    if re.search(r"torch\.cat\(\s*\(\s*\w*pass\w*\s*,\s*\w*rot", source):
        return (
            "its attention rotates the last dims of each head (the rope part after the position-free part, as "
            "multi-head latent attention splits them), where rope_ext's attention-time rotation rotates the first"
        )
    return None


def _changed_after_rotation(source: str, name: str) -> bool:
    """Whether ``forward``'s source assigns ``{name}_states`` from a module call after rotating it: after the call of
    ``apply_rotary_pos_emb`` that returns it (Gemma 4 rotates queries and keys in two calls, its key norm between
    them), else after the first call."""
    rotation = re.search(rf"{name}_states\s*(,\s*\w+\s*)?=\s*apply_rotary_pos_emb\("
                         rf"|\w+\s*,\s*{name}_states\s*=\s*apply_rotary_pos_emb\(", source)
    after = source[rotation.end():] if rotation else _after(source, "apply_rotary_pos_emb(")
    return bool(re.search(rf"{name}_states\s*=\s*self\.\w+\({name}_states", after))


#: the conditions under which a forward rotates that are read off each layer: ``applies_rope`` (SmolLM3, EXAONE 4),
#: a layer type without rope parameters (Beam's NoPE layers get no position embeddings), a model-wide switch (Zamba2's:
#: off, the model holds no rotary module to patch)
KNOWN_CONDITIONS = ("if self.use_rope:", "if self.sliding_window is None or self.is_sliding:",
                    "if position_embeddings is not None:", "if self.config.use_mem_rope:")


def _rotation_condition(source: str) -> str | None:
    """The ``if`` line that governs a forward's ``apply_rotary_pos_emb`` call (``None``: it runs on every call)."""
    lines = source.splitlines()
    at = next((i for i, line in enumerate(lines) if "apply_rotary_pos_emb(" in line), None)
    if at is None:
        return None
    indent = len(lines[at]) - len(lines[at].lstrip())
    for line in reversed(lines[:at]):
        stripped = line.strip()
        if stripped and len(line) - len(line.lstrip()) < indent:
            # (an else chooses between rotations, DeepSeek's interleaved one or not: every layer rotates)
            return " ".join(stripped.split()) if stripped.startswith(("if ", "elif ")) else None
    return None


def source_of(function) -> str | None:
    """The source of a function, a class's ``forward`` or ``__init__`` (``None``: not readable)."""
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return None


def _after(source: str, marker: str) -> str:
    """What ``source`` says after its first ``marker`` (nothing where it has none)."""
    return source.split(marker, 1)[1] if marker in source else ""


@functools.cache
def program_refused(cls: type) -> str | None:
    """Why no attention program may run in this attention class (``None``: one may), read off its code: it holds a
    rotary module per layer (Moshi), rotates under a condition ``applies_rope`` does not read (AFMoE and Flint rotate
    their sliding layers only: a bias or query scale would land on layers without positions), or its forward passes
    the attention function learned sinks (``s_aux``: gpt-oss, Granite SWA), a sparse indexer's keys (``indices``:
    DeepSeek-V3.2) or a mask of its own instead of the one it was given (Doge's dynamic mask), none of which
    rope_ext's attention takes."""
    if "RotaryEmbedding(" in (source_of(cls.__init__) or ""):
        return (f"each of its attention layers holds a rotary module of its own ({cls.__name__} builds one), where "
                "rope_ext's attention rewrites take the one module the model shares; methods that rewrite attention "
                "are refused for it")
    source = source_of(cls.forward)
    if source is None:
        return None
    condition = _rotation_condition(source)
    if condition is not None and condition not in KNOWN_CONDITIONS:  # (every program term depends on which layers
        return (  # have positions: a bias or a query scale would land on layers without them)
            f"its attention rotates queries and keys only under a condition of its own ({condition.rstrip(':')}: "
            "layers without positions), so rope_ext cannot tell which layers have positions; methods that rewrite "
            "attention are refused for it"
        )
    call = _after(source, "attention_interface(")
    if re.search(r"\bs_aux\s*=", call):
        return ("its attention adds learned sinks to the softmax (s_aux), which rope_ext's attention does not "
                "implement; methods that rewrite attention are refused for it")
    if re.search(r"\bindices\s*=", call):
        return ("its attention attends to the keys a sparse indexer selects (DeepSeek Sparse Attention: the indexer's "
                "top-k keys, as indices or a mask of its own), which rope_ext's attention does not implement; methods "
                "that rewrite attention are refused for it")
    if re.search(r"\battention_mask\s*=\s*(?!attention_mask\b)\w", call):
        return ("its attention passes the attention function a mask of its own making (not the padding and causal "
                "mask it was given), which rope_ext's attention does not take; methods that rewrite attention are "
                "refused for it")
    return None


def softcapping(config_class: type | None) -> float | None:
    """The attention-logit softcapping a config class sets by default (Gemma 2's 50; a composite config's text
    config's), ``None`` where it sets none: a class-level fact, as every checkpoint of Gemma 2 caps its logits."""
    value = getattr(config_class, "attn_logit_softcapping", None)
    text = (getattr(config_class, "sub_configs", None) or {}).get("text_config")
    if value is None and isinstance(text, type):
        value = getattr(text, "attn_logit_softcapping", None)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def chunking(config_class: type | None) -> int | None:
    """The chunk size a config class's attention is limited to by default (Llama 4's local layers attend within
    chunks of ``attention_chunk_size``), ``None`` where it sets none."""
    value = getattr(config_class, "attention_chunk_size", None)
    text = (getattr(config_class, "sub_configs", None) or {}).get("text_config")
    if value is None and isinstance(text, type):
        value = getattr(text, "attention_chunk_size", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def chunking_refused(value: int) -> str:
    """Why no attention program runs where attention is chunked."""
    return (
        f"its attention is chunked (attention_chunk_size={value}: Llama 4's local layers attend within chunks), which "
        "rope_ext's attention does not implement; methods that rewrite attention are refused for it"
    )


def softcapping_refused(value: float) -> str:
    """Why no attention program runs where attention logits are capped at ``value``."""
    return (
        f"its attention caps logits (attn_logit_softcapping={value}), which rope_ext's attention does not implement; "
        "methods that rewrite attention are refused for it"
    )
