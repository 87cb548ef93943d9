"""Additive attention biases: ALiBi, KERPLE, Sandwich and FIRE.

Each method is a function of the query and key positions, ``bias(q_pos, k_pos) -> [heads, n, m]``, added to the
scaled attention scores before the softmax (x-transformers' ``forward(i, j)`` shape). They *replace* a model's
position encoding: on a RoPE family the rotary embedding becomes the identity, on GPT-2 the learned table adds
nothing (``rope_ext.installers.bias``). Distances are ``|i - j|`` (causal attention sees ``j <= i`` only, so that is
``i - j``; an encoder would see both sides).

* ``alibi`` (Press et al. 2022, arXiv:2108.12409; ofirpress/attention_with_linear_biases, fairseq ``get_slopes``):
  ``-m_h |i - j|`` with the geometric slopes ``m_h`` of ``alibi_slopes`` (BLOOM's, for any head count);
  ``factor > 1`` divides the slopes by it: the slope interpolation of Al-Khateeb et al. 2023 (arXiv:2310.13017,
  ``m' = m L_train / L``) fixed at a target ``L = factor L_train``.
* ``kerple`` (Chi et al. 2022, arXiv:2205.09921; chijames/KERPLE ``megatron/model/positional_embeddings.py``):
  learnable per head and layer, ``log``: ``-r1 log(1 + r2 |i - j|)``; ``power``: ``-r1 |i - j|^r2``, ``r2 <= 2``.
* ``sandwich`` (Chi et al. 2023, arXiv:2212.10356): the inner product of two sinusoidal embeddings of dimension
  ``d'``, ``sum_{k=1..d'/2} cos(|i - j| / 10000^(2k/d')) - d'/2``, divided by ``8 h / H`` for head ``h`` (NeMo's).
* ``fire`` (Li et al. 2023, arXiv:2310.04418; mcleish7/arithmetic ``cramming/architectures/embeddings.py``): a
  learnable MLP of ``psi(i - j) / psi(max(i, L))``, ``psi(x) = log(|c x| + 1)``.

Every bias is added to the scores after the ``1/sqrt(d)`` scaling, unscaled (as each reference does).

Pure math: imports torch, never transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from rope_ext.methods.base import HOOK_BIAS, MethodConfig, register_method
from rope_ext.methods.options import any_integer, factor_range, integer, interval, number_list, one_of, option


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's per-head slopes: for ``n`` a power of two the geometric sequence starting at ``2^(-8/n)`` with that
    ratio; otherwise those of the closest smaller power of two ``c``, then every other slope of ``2c`` heads."""
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"alibi: the number of heads must be an int >= 1, got {heads!r}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (k + 1) for k in range(n)]

    closest = 2 ** int(math.floor(math.log2(heads)))
    slopes = power_of_two(closest)
    if closest < heads:
        slopes += power_of_two(2 * closest)[0::2][: heads - closest]
    return slopes


def distances(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``|i - j|`` for query positions ``q_pos [n]`` and key positions ``k_pos [m]`` (float32) -> ``[n, m]``."""
    return (q_pos.float()[:, None] - k_pos.float()[None, :]).abs()


class BiasConfig(MethodConfig):
    """Base of the additive-bias configs: ``module(heads)`` is the bias as a module, ``forward(q_pos, k_pos) ->
    [heads, n, m]`` (float32); its parameters, if ``learnable``, are the patch's own (``rope_ext.installers.params``)."""

    hook: ClassVar[str] = HOOK_BIAS
    #: whether the bias has parameters that train (one set per attention layer)
    learnable: ClassVar[bool] = False
    #: whether the bias is a function of the distance ``|i - j|`` alone (what T5's attention takes)
    of_distance: ClassVar[bool] = True

    def module(self, heads: int, index: int = 0, head_dim: int | None = None) -> nn.Module:
        """The bias of layer ``index`` for ``heads`` heads of ``head_dim`` dims (learnable methods initialise each
        layer's from a seed and the index)."""
        raise NotImplementedError


class KeyOnlyBias:
    """Declares a bias's key-only form: ``key_bias(c, k_pos) -> [heads, 1, m]`` with ``bias(i, j) = key_bias(c, j)
    + g(i)`` for every causal pair ``j <= i``, taken relative to a position ``c`` (a query block's first, keeping the
    values small). A per-query ``g(i)`` does not change the softmax, so attention kernels may add the key part alone,
    one row for every query, instead of a ``[heads, n, m]`` block (ALiBi: ``-m (i - j) = m (j - c) - m (i - c)``).

    A bias module (``nn.Module``) or an attention-program bias term (``rope_ext.attention.program.Bias``) declares the
    form by subclassing this class and defining ``key_bias``; the kernels check ``isinstance``, never an attribute. A
    subclass without its own ``key_bias`` is refused when it is defined."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.key_bias is KeyOnlyBias.key_bias:
            raise TypeError(f"{cls.__name__} declares a key-only bias (KeyOnlyBias) but defines no key_bias(c, k_pos)")

    def key_bias(self, c: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """``[heads, 1, m]``: the key part at positions ``k_pos [m]`` relative to ``c`` (a 0-d float32 position)."""
        raise NotImplementedError


# --- ALiBi -------------------------------------------------------------------------------------------------


class AlibiBias(nn.Module, KeyOnlyBias):
    """``-slope_h |i - j|``, the slopes fixed (a buffer that stays out of the state dict)."""

    def __init__(self, slopes: list[float]) -> None:
        super().__init__()
        self.register_buffer("slopes", torch.tensor(slopes, dtype=torch.float32), persistent=False)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        slopes = self.slopes.to(device=q_pos.device, dtype=torch.float32)
        return -slopes[:, None, None] * distances(q_pos, k_pos)[None]  # [h, n, m]

    def distance_form(self) -> tuple[str, torch.Tensor, None]:
        """The bias is ``-slopes[h] |i - j|`` exactly: ``("linear", slopes [h], None)``, what a fused kernel computes
        from the distance instead of reading a table (``rope_ext.attention.flex``)."""
        return "linear", self.slopes, None

    def key_bias(self, c: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """For causal pairs ``-m (i - j) = m (j - c) - m (i - c)``: the key part ``m (j - c)`` -> ``[h, 1, m]``."""
        slopes = self.slopes.to(device=k_pos.device, dtype=torch.float32)
        return slopes[:, None, None] * (k_pos.float() - c.float())[None, None]


@register_method
@dataclass(frozen=True)
class AlibiConfig(BiasConfig):
    """ALiBi: ``-m_h |i - j|``, the paper's slopes (``alibi_slopes``; any head count), or ``slopes`` given one per
    head; ``factor`` divides them (slope interpolation for a context ``factor`` times the trained one, arXiv
    2310.13017; ``1``: the trained slopes)."""

    method: ClassVar[str] = "alibi"
    summary: ClassVar[str] = (
        "ALiBi (Press et al. 2022, arXiv:2108.12409): a bias ``-m_h |i - j|`` with a fixed slope ``m_h`` per head in "
        "place of a position encoding; factor divides the slopes (slope interpolation, Al-Khateeb et al. 2023, "
        "arXiv:2310.13017)."
    )

    factor: float = option(1.0, factor_range(
        "the slopes are divided by it, for a context factor times the trained one", "steepen the slopes",
        required=False),
        meaning="the slopes are divided by it, for a context factor times the trained one (1: the trained slopes)")
    slopes: tuple[float, ...] | None = option(None, number_list(
        interval(0.0), phrase="a list of numbers > 0, one per head", optional=True, entries="every slope"),
        meaning="one slope per attention head; None: the paper's geometric slopes (``alibi_slopes``, any head count)")

    def head_slopes(self, heads: int) -> list[float]:
        if self.slopes is not None and len(self.slopes) != heads:
            raise ValueError(f"{self.method}: {len(self.slopes)} slopes given for a model with {heads} attention heads")
        slopes = list(self.slopes) if self.slopes is not None else alibi_slopes(heads)
        return [s / self.factor for s in slopes]

    def module(self, heads: int, index: int = 0, head_dim: int | None = None) -> nn.Module:
        return AlibiBias(self.head_slopes(heads))


# --- learnable biases ----------------------------------------------------------------------------------------


def _at_least(value: torch.Tensor, low: float, high: float | None = None) -> torch.Tensor:
    """``value`` clamped to ``[low, high]`` in the forward pass, its gradient passed through unchanged (the
    references clamp the parameter's data before each forward; a plain clamp would stop the gradient there)."""
    clamped = value.clamp(min=low, max=high)
    return value + (clamped - value).detach()


def _uniform(heads: int, scale: float, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(heads, generator=generator, dtype=torch.float32) * scale


class KerpleBias(nn.Module):
    """KERPLE per head: ``log``: ``-r1 log(1 + r2 d)``; ``power``: ``-r1 d^r2`` (``d = |i - j|``); ``r1, r2 >= eps``
    and ``r2 <= 2`` for ``power``."""

    def __init__(self, form: str, r1: torch.Tensor, r2: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.form = form
        self.eps = eps
        self.r1 = nn.Parameter(r1)  # [h]
        self.r2 = nn.Parameter(r2)  # [h]

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        d = distances(q_pos, k_pos)[None]  # [1, n, m]
        r1 = _at_least(self.r1.float(), self.eps)[:, None, None]
        if self.form == "log":
            r2 = _at_least(self.r2.float(), self.eps)[:, None, None]
            return -r1 * torch.log1p(r2 * d)  # [h, n, m]
        r2 = _at_least(self.r2.float(), self.eps, 2.0)[:, None, None]
        return -r1 * d.pow(r2)


@register_method
@dataclass(frozen=True)
class KerpleConfig(BiasConfig):
    """KERPLE's learnable kernels, per head and layer: ``form="log"``: ``-r1 log(1 + r2 |i - j|)`` (the paper's
    best); ``"power"``: ``-r1 |i - j|^r2``, ``0 < r2 <= 2``. Initialised as chijames/KERPLE does, from a generator
    seeded by ``seed`` (then the layer's index): log ``r1 ~ U(0, 2)``, ``r2 ~ U(0, 1)``; power ``r1 ~ U(0, 1)``,
    ``r2 ~ U(0, 2)``; both kept ``>= eps``."""

    method: ClassVar[str] = "kerple"
    summary: ClassVar[str] = (
        "KERPLE (Chi et al. 2022, arXiv:2205.09921): a learnable kernel bias per head and layer, "
        "``-r1 log(1 + r2 |i - j|)`` or ``-r1 |i - j|^r2``, in place of a position encoding."
    )
    learnable: ClassVar[bool] = True

    FORMS: ClassVar[tuple[str, ...]] = ("log", "power")

    form: str = option(
        "log", one_of(*FORMS),
        meaning="the kernel: log, ``-r1 log(1 + r2 |i - j|)`` (the paper's best), or power, ``-r1 |i - j|^r2`` with "
                "``r2 <= 2``")
    eps: float = option(
        1e-2, interval(0.0, 1.0), meaning="the floor ``r1`` and ``r2`` are held at in the forward pass")
    seed: int = option(
        0, any_integer(), meaning="seeds the initial ``r1``, ``r2`` of each layer (with the layer's index)")

    def module(self, heads: int, index: int = 0, head_dim: int | None = None) -> nn.Module:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + index)
        scales = (2.0, 1.0) if self.form == "log" else (1.0, 2.0)
        r1, r2 = (_uniform(heads, s, generator).clamp(min=self.eps) for s in scales)
        return KerpleBias(self.form, r1, r2, self.eps)


class FireBias(nn.Module):
    """FIRE: ``f(psi(i - j) / psi(max(i, L)))`` with ``psi(x) = log(|c x| + 1)`` and ``f`` an MLP ``1 -> width ->
    heads`` (ReLU); ``c`` and the threshold's multiplier learnable, ``L`` its initial value."""

    def __init__(self, heads: int, width: int, c: float, threshold: float, eps: float, generator: torch.Generator) -> None:
        super().__init__()
        self.eps = eps
        self.mlp = nn.Sequential(nn.Linear(1, width), nn.ReLU(), nn.Linear(width, heads))
        with torch.no_grad():  # (seeded: the same patch gives the same initial bias)
            for layer in (self.mlp[0], self.mlp[2]):
                bound = 1 / math.sqrt(layer.in_features)
                layer.weight.copy_(torch.rand(layer.weight.shape, generator=generator) * 2 * bound - bound)
                layer.bias.copy_(torch.rand(layer.bias.shape, generator=generator) * 2 * bound - bound)
        self.c = nn.Parameter(torch.tensor(float(c)))
        self.register_buffer("threshold", torch.tensor(float(threshold)))  # (fixed; saved with the model)
        self.threshold_multiplier = nn.Parameter(torch.tensor(1.0))

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        c = self.c.float().abs()
        rel = (q_pos.float()[:, None] - k_pos.float()[None, :]).abs()  # [n, m]
        threshold = (self.threshold_multiplier.float() * self.threshold.float()).abs()
        normaliser = torch.maximum(q_pos.float(), threshold)[:, None]  # [n, 1]
        x = torch.log1p(c * rel) / (torch.log1p(c * normaliser) + self.eps)  # [n, m]
        out = self.mlp[2](self.mlp[1](self.mlp[0](x[..., None].to(self.mlp[0].weight.dtype))))  # [n, m, h]
        return out.float().permute(2, 0, 1)  # [h, n, m]


@register_method
@dataclass(frozen=True)
class FireConfig(BiasConfig):
    """FIRE (arXiv:2310.04418): a learnable MLP (``1 -> width -> heads``, ReLU) of
    ``psi(i - j) / psi(max(i, L))``, ``psi(x) = log(|c x| + 1)``; ``c`` starts at ``c``, ``L`` at ``threshold``
    (the paper's 512; learnable through a multiplier). One per layer, initialised from a generator seeded by
    ``seed`` and the layer's index."""

    method: ClassVar[str] = "fire"
    summary: ClassVar[str] = (
        "FIRE (Li et al. 2023, arXiv:2310.04418): a learnable MLP bias of the normalised distance "
        "``psi(i - j) / psi(max(i, L))``, ``psi(x) = log(|c x| + 1)``, one per layer, in place of a position encoding."
    )
    learnable: ClassVar[bool] = True
    of_distance: ClassVar[bool] = False  # (``psi(max(i, L))``: the query's position too)

    width: int = option(32, integer(1), meaning="the hidden width of the MLP ``1 -> width -> heads`` (ReLU)")
    c: float = option(
        0.1, interval(0.0), meaning="the initial value of the learnable ``c`` in ``psi(x) = log(|c x| + 1)``")
    threshold: float = option(
        512.0, interval(0.0),
        meaning="the initial ``L`` of ``psi(max(i, L))``, the normaliser's floor (the paper's 512; learnable through a "
                "multiplier)")
    eps: float = option(
        1e-6, interval(0.0, 1.0), meaning="added to the normaliser ``psi(max(i, L))``, so the ratio never divides by 0")
    seed: int = option(0, any_integer(), meaning="seeds each layer's initial MLP weights (with the layer's index)")

    def module(self, heads: int, index: int = 0, head_dim: int | None = None) -> nn.Module:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + index)
        return FireBias(heads, self.width, self.c, self.threshold, self.eps, generator)


# --- Sandwich ----------------------------------------------------------------------------------------------------


class SandwichBias(nn.Module):
    """``(sum_{k=1..d'/2} cos(|i - j| / 10000^(2k/d')) - d'/2) / (8 h / H)`` for head ``h = 1..H``; the distance
    term read from a table of integer distances, grown as longer ones come (positions are integers)."""

    def __init__(self, heads: int, dim: int, base: float) -> None:
        super().__init__()
        self.dim = dim
        self.base = base
        compression = torch.tensor([8.0 * h / heads for h in range(1, heads + 1)], dtype=torch.float32)
        self.register_buffer("compression", compression, persistent=False)  # [h]
        self.register_buffer("table", torch.zeros(0), persistent=False)  # [distances]

    def _table(self, longest: int, device) -> torch.Tensor:
        if self.table.shape[0] <= longest or self.table.device != device:
            size = max(2 * self.table.shape[0], longest + 1, 1024)
            inv_freq = 1.0 / self.base ** (2 * torch.arange(1, self.dim // 2 + 1, dtype=torch.float64) / self.dim)
            d = torch.arange(size, dtype=torch.float64)
            table = torch.cos(d[:, None] * inv_freq[None]).sum(-1) - self.dim / 2  # [size]
            self.table = table.to(device=device, dtype=torch.float32)
        return self.table

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        d = distances(q_pos, k_pos).round().long()  # [n, m]
        table = self._table(int(d.max()) if d.numel() else 0, q_pos.device)
        compression = self.compression.to(q_pos.device)
        return table[d][None] / compression[:, None, None]  # [h, n, m]


@register_method
@dataclass(frozen=True)
class SandwichConfig(BiasConfig):
    """Sandwich (arXiv:2212.10356): the inner product of two sinusoidal embeddings of dimension ``d'`` as a bias,
    ``sum_{k=1..d'/2} cos(|i - j| / 10000^(2k/d')) - d'/2`` (0 at distance 0, below it further away), divided by
    ``8 h / H`` for head ``h = 1..H`` as NVIDIA NeMo's ``SandwichRelativePositionEmbedding`` does (the authors'
    code is not public); ``dim`` is ``d'`` (``None``: the head dimension, NeMo's choice). No parameters."""

    method: ClassVar[str] = "sandwich"
    summary: ClassVar[str] = (
        "Sandwich (Chi et al. 2023, arXiv:2212.10356): the inner product of two sinusoidal embeddings of the "
        "distance as a bias, ``sum_k cos(|i - j| / base^(2k/d')) - d'/2`` divided by ``8 h / H`` for head ``h``; no "
        "parameters."
    )

    dim: int | None = option(
        None, integer(2, optional=True, even=True, hint="or null: the head dimension"),
        meaning="``d'``, the dimension of the sinusoidal embeddings (even); None: the head dimension (NeMo's choice)")
    base: float = option(
        10000.0, interval(1.0), meaning="the sinusoids' base in ``cos(|i - j| / base^(2k/d'))`` (the paper's 10000)")

    def module(self, heads: int, index: int = 0, head_dim: int | None = None) -> nn.Module:
        dim = self.dim or head_dim
        if not dim or dim % 2:
            raise ValueError(f"{self.method}: give dim (an even int); the model's head dimension is {head_dim!r}")
        return SandwichBias(heads, dim, self.base)
