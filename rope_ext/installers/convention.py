"""What a family's rotary module computes, measured: its ``(cos, sin)`` at a few positions against standard RoPE with
the frequencies its rope type gives, in each table layout rope_ext knows (``RotarySite.spec`` keeps the one found).

Multimodal RoPE (M-RoPE: Qwen3.5's, ``mrope_section``) splits the frequencies among three position streams (time,
height, width); on text the three are the same position and its tables are ``cat(freqs, freqs)``. A frequency method
patches it through the module itself (layout ``MROPE``): the module called with the method's ``inv_freq`` and
attention factor in place of its own (``called_with``), measured to read them, so that an image's grid positions
keep their streams. Methods that rotate in attention, or replace the rotation, are refused for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from rope_ext.methods import RotarySpec
from rope_ext.methods.rope import LAYOUTS, rope_cos_sin


def frequency_placement(module: nn.Module) -> tuple[torch.device | None, torch.dtype]:
    """Device and dtype in which ``module`` keeps its frequencies (its first floating-point buffer)."""
    buffer = next((b for b in module.buffers() if b.is_floating_point()), None)
    return (buffer.device, buffer.dtype) if buffer is not None else (None, torch.float32)


#: the layout of a multimodal rotary module patched through itself (``called_with``)
MROPE = "mrope"


@contextlib.contextmanager
def called_with(module: nn.Module, inv_freq: torch.Tensor, attention_factor, layer_type: str | None = None
                ) -> Iterator[nn.Module]:
    """``module`` reading ``inv_freq`` and ``attention_factor`` in place of its own ``inv_freq`` buffer and
    ``attention_scaling`` (``{layer_type}_inv_freq`` and ``{layer_type}_attention_scaling`` where it keeps them per
    layer type: Cohere Compass's), its rope type read as ``default`` (so that a dynamic type's update does not
    replace them), put back on leaving."""
    prefix = f"{layer_type}_" if layer_type is not None and f"{layer_type}_inv_freq" in module._buffers else ""
    buffer, scaling = f"{prefix}inv_freq", f"{prefix}attention_scaling"
    kept = module._buffers[buffer], module.__dict__.get(scaling), module.__dict__.get("rope_type")
    module._buffers[buffer] = inv_freq
    module.__dict__[scaling] = attention_factor
    if kept[2] is not None:
        module.__dict__["rope_type"] = {**kept[2], layer_type: "default"} if isinstance(kept[2], dict) else "default"
    try:
        yield module
    finally:
        module._buffers[buffer] = kept[0]
        module.__dict__[scaling] = kept[1]
        if kept[2] is not None:
            module.__dict__["rope_type"] = kept[2]


def call(module: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None) -> Any:
    """``module(x, position_ids)``, with the layer type where one is given."""
    return module(x, position_ids) if layer_type is None else module(x, position_ids, layer_type)


def _mrope_layout(site, layout: str, frequency: bool, layer_type: str | None) -> str:
    """``MROPE`` where a frequency method (``frequency``) can patch the multimodal rotary module through itself:
    the module on text positions is standard RoPE (``layout``, measured with its own frequencies: ``cat``) and
    reads a probe ``inv_freq`` and attention factor given in place of its own. Refused otherwise, and for every
    other kind of method."""
    module = site.module
    section = module.mrope_section
    section = section.get(layer_type) if isinstance(section, dict) else section  # (per layer type: Cohere Compass's)
    words = (f"{site.family}: the model's rotary embedding is multimodal RoPE (M-RoPE, mrope_section="
             f"{list(section or ())}): its frequencies are split among three position streams (time, height, width)")
    if not frequency:
        raise ValueError(f"{words}, which rope_ext's attention methods and biases do not take (they rotate or place "
                         "by one position stream); frequency methods (yarn, pi, ntk, ...) patch it")
    buffer = f"{layer_type}_inv_freq" if f"{layer_type}_inv_freq" in module._buffers else "inv_freq"
    if layout != "cat" or not isinstance(module._buffers.get(buffer), torch.Tensor):
        raise ValueError(f"{words}, and its tables on text are not cat(freqs, freqs) from an inv_freq buffer; "
                         "rope_ext cannot patch this model's RoPE variant")
    device, kept = frequency_placement(module)
    probe = (module._buffers[buffer].float() * 0.5).to(kept)
    positions = torch.arange(0, 64, 4, device=device)[None]
    state = _snapshot(module)
    try:
        with called_with(module, probe, 1.25, layer_type):
            cos, sin = call(module, torch.zeros(1, device=device), positions, layer_type)
    finally:
        _restore(module, state)
    expected_cos, expected_sin = rope_cos_sin(positions, probe.float(), 1.25, "cat")
    if cos.shape != expected_cos.shape or not (torch.allclose(cos.float(), expected_cos, rtol=0, atol=1e-5)
                                               and torch.allclose(sin.float(), expected_sin, rtol=0, atol=1e-5)):
        raise ValueError(f"{words}, and it does not compute its tables from its inv_freq and attention_scaling "
                         "(given other values, it returned others); rope_ext cannot patch this model's RoPE variant")
    return MROPE


def measured_layout(site, layer_type: str | None, params: dict[str, Any], spec: RotarySpec,
                    frequency: bool = False) -> str:
    """Run the original module on a few positions: its ``(cos, sin)`` must be standard RoPE with the frequencies
    its rope type gives (transformers' own init function for that type), in one of the table layouts of
    ``LAYOUTS`` (``rotate_half``'s, adjacent pairs, one entry a pair): the one it returns, which the patched
    module keeps (frequency methods are layout-free; the attention rewrites are refused for another pair layout
    by the family's probes).

    This catches a family (or checkpoint) whose rotary module follows another convention, so it is
    refused instead of silently mis-patched. A multimodal one (``mrope_section``) gives ``MROPE`` for a
    ``frequency`` method (``_mrope_layout``), a refusal for any other. The expected frequencies are rounded to the
    dtype the module keeps them in (a model cast to bf16 after loading holds a bf16 ``inv_freq``), so the comparison is
    exact up to float32 arithmetic, whatever the model's dtype. Positions stay inside the original
    context, and the module's state is put back afterwards (dynamic rope types update it on a call).
    """
    layout = _standard_layout(site, layer_type, params, spec)
    if getattr(site.module, "mrope_section", None) is not None:  # (Qwen2-VL's and Qwen3.5's: 3 position streams)
        return _mrope_layout(site, layout, frequency, layer_type)
    return layout


def _standard_layout(site, layer_type: str | None, params: dict[str, Any], spec: RotarySpec) -> str:
    """The layout in which ``site``'s module returns standard RoPE (``measured_layout``), else refused."""
    module = site.module
    device, kept = frequency_placement(module)
    exact, attention_factor = site._expected_inv_freq(layer_type, params, spec, device)
    inv_freq = exact.to(kept).float()
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    stop = min(4096, spec.original_max_position_embeddings)
    positions = torch.arange(0, stop, max(1, stop // 16), device=device)[None]  # [1, ~16]
    state = _snapshot(module)
    try:
        returned = module(probe, positions) if layer_type is None else module(probe, positions, layer_type)
    except (RuntimeError, ValueError, TypeError, IndexError) as error:  # (another call convention: M-RoPE's ids)
        returned = error
    finally:
        _restore(module, state)
    layouts = LAYOUTS
    if torch.is_tensor(returned) and returned.is_complex():  # (Llama 4's and DeepSeek-V2's freqs_cis)
        returned, layouts = (returned.real, returned.imag), ("complex",)
    if not (isinstance(returned, tuple) and len(returned) == 2 and all(map(torch.is_tensor, returned))):
        what = (f"raised {type(returned).__name__}: {str(returned).splitlines()[0][:120]}"
                if isinstance(returned, Exception) else f"returned a {type(returned).__name__}, not (cos, sin)")
        raise ValueError(
            f"{site.family}: the model's rotary embedding is not standard RoPE: called as transformers' shared "
            f"rotary module is, with (x, position_ids), it {what}; rope_ext cannot patch this model's RoPE variant"
        )
    cos, sin = returned
    tolerance = 1e-5  # exact up to float32 arithmetic: the expected frequencies carry the module's rounding
    found = []
    # (frequencies rounded to the dtype the module keeps them in; or in float32: a module that computes them
    # from its config on every call, Phi-MoE's, gives those whatever its buffer's dtype)
    candidates = [(layout, inv_freq, "") for layout in layouts]
    if kept != torch.float32:
        candidates += [(layout, exact.float(), " in float32") for layout in layouts]
    for layout, inv_freq, held in candidates:
        expected_cos, expected_sin = rope_cos_sin(positions, inv_freq, attention_factor, layout)
        if cos.shape != expected_cos.shape:
            found.append(f"{layout}{held}: shape {tuple(cos.shape)} against {tuple(expected_cos.shape)}")
            continue
        diff = max((cos.float() - expected_cos).abs().max().item(), (sin.float() - expected_sin).abs().max().item())
        if diff <= tolerance:
            return layout
        found.append(f"{layout}{held}: max |diff| {diff:.3g}")
    raise ValueError(
        f"{site.family}: the model's rotary embedding is not standard RoPE with base={spec.base}, "
        f"rotary dim={spec.dim} (rope type {params.get('rope_type', 'default')!r}): its cos/sin at positions "
        f"0..{int(positions.max())} were compared with cat(freqs, freqs), its pairs interleaved and one entry a "
        f"pair, using inv_freq held in {kept} ({'; '.join(found)}; tolerance {tolerance}); rope_ext cannot patch "
        "this checkpoint's RoPE variant"
    )


def _snapshot(module: nn.Module) -> dict[str, Any]:
    """The module's attributes, buffer table and buffer values (some rope types update buffers in place)."""
    buffers = dict(module._buffers)
    values = {k: v.clone() for k, v in buffers.items() if v is not None}
    return {"attributes": dict(vars(module)), "buffers": buffers, "values": values}


def _restore(module: nn.Module, state: dict[str, Any]) -> None:
    module.__dict__.clear()
    module.__dict__.update(state["attributes"])
    module._buffers.clear()
    module._buffers.update(state["buffers"])
    for name, value in state["values"].items():
        if not torch.equal(module._buffers[name], value):
            module._buffers[name].copy_(value)
