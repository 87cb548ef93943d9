"""The attention program: what every hook kind that touches attention contributes, and how one call runs it.

Each patched attention module holds an ``AttentionProgram``: its layer's facts (layer type, sliding window) and
a list of *terms*, one or more per hook kind that applies to the layer:

* ``PositionRule`` -- RoPE evaluated at remapped positions on unrotated queries and keys (ReRoPE, Self-Extend,
  DCA...; or plain RoPE rotated at attention time, as the cache-consistent dynamic methods need);
* ``QueryScale`` -- a multiplier per query position (log-n, DCA's scale_queries);
* ``Bias`` -- an additive ``bias(q_pos, k_pos) -> [heads, q, k]`` (ALiBi-like terms);
* ``PairScale`` -- queries and keys scaled per rotary pair on top of plain RoPE rotated in attention (xPos);
* ``Wrapper`` -- a function around the whole call (shifted sparse attention).

``run(call)`` folds the wrappers around a *kernel* chosen through a table keyed by term type
(``register_kernel``): a new term type registers its kernel (or relies on one that handles it) instead of
editing a dispatch chain. Every kernel applies the query scales and the biases; ``kernel_override`` runs every
program through another kernel (the plain reference, a benchmark's baseline) without touching the programs.

Positions: per row, the queries' positions come from ``position_ids`` when given (increasing, with jumps
allowed: PoSE), else from the keys (``0..m-1`` after padding is removed). ``Call.row_groups`` resolves them once
per call, compacting padded rows to their own tokens. Pure torch: nothing here imports transformers."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.utils.weak import WeakIdKeyDictionary

from rope_ext.attention.key_cache import NOWHERE, CacheLink, Keep, version
from rope_ext.methods.biases import KeyOnlyBias


class Term:
    """One contribution to a layer's attention program."""

    #: a short name for summaries (``"dca"``, ``"logn"``...)
    name: str = "term"

    def describe(self) -> str:
        return self.name


@dataclass(eq=False)
class PositionRule(Term):
    """RoPE on unrotated queries and keys at positions the rule maps (``config``: a position-rule config with
    ``regions()``, and ``relative(i, j)`` for the reference; ``None``: plain RoPE), with the frequencies
    ``source.frequencies(position_ids, layer_type, device)`` gives for the call (a dynamic method follows the
    current length). ``original`` is the rule's ``L``; ``native`` the model config's."""

    config: Any
    source: Any
    layer_type: str | None
    original: int
    native: int | None = None

    @property
    def name(self) -> str:  # type: ignore[override]
        return "rope" if self.config is None else self.config.method

    def describe(self) -> str:
        if self.config is None:
            return "rope (rotated in attention)"
        options = ", ".join(f"{k}={v}" for k, v in self.config.to_dict().items() if k != "method")
        return f"{self.config.method}({options})"

    def frequencies(self, position_ids: torch.Tensor | None, m: int, device) -> tuple[torch.Tensor, Any]:
        length_ids = position_ids if position_ids is not None else torch.full((1, 1), m - 1, device=device)
        return self.source.frequencies(length_ids, self.layer_type, device)


@dataclass(eq=False)
class QueryScale(Term):
    """Queries at positions ``i`` times ``method.query_multiplier(i, original)`` (float64 ``[n]``)."""

    method: Any
    original: int

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.method.method} scale"

    def multiplier(self, i: torch.Tensor) -> torch.Tensor:
        return self.method.query_multiplier(i, self.original)


class Bias(Term):
    """An additive attention bias computed from positions, block by block.

    A bias with a key-only form subclasses ``KeyOnlyBias`` as well (``key_bias(c, k_pos) -> [heads, 1, m]``): the
    kernels add that one row for every query of a block; a term holding a module says so through ``has_key_bias``."""

    name = "bias"

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """``q_pos [n]``, ``k_pos [m]`` (float32 positions) -> ``[heads, n, m]`` (or ``[1, n, m]``), added to the
        scaled scores."""
        raise NotImplementedError

    @property
    def has_key_bias(self) -> bool:
        """Whether this bias gives its key-only form (``key_bias``): declared by subclassing ``KeyOnlyBias``."""
        return isinstance(self, KeyOnlyBias)

    @property
    def of_distance(self) -> bool:
        """Whether the bias depends on the distance ``i - j`` alone (a term that does says so)."""
        return False

    def distance_form(self, device: torch.device) -> tuple[str, torch.Tensor, torch.Tensor | None] | None:
        return None  # (where the bias is a closed form of the distance a fused kernel computes: flex.FORMS)


class MethodTerm(Term):
    """A term made from a method config (``method``), named and described by it."""

    method: Any

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.method.method

    def describe(self) -> str:
        options = ", ".join(f"{k}={v}" for k, v in self.method.to_dict().items() if k != "method")
        return f"{self.method.method}({options})"


@dataclass(eq=False)
class PairScale(MethodTerm):
    """Rotary pair ``p`` of the query at ``i`` times ``f_p(i - c)`` and of the key at ``j`` times ``f_p(c - j)``,
    ``f = method.factors(offsets, dim)`` (``zeta^(offset/B)``, xPos): the score's pair ``p`` carries ``f_p(i - j)``
    whatever ``c`` is (the kernel takes each query block's first position). Runs with a plain-RoPE position rule."""

    method: Any
    #: the rotary dimension
    dim: int


class Wrapper(Term):
    """A function around the whole call: ``wrap(call, inner)`` returns the output ``[b, h, n, dv]``; ``inner`` runs
    the rest of the program on a call (the same, or one the wrapper made: regrouped rows, shifted heads...)."""

    name = "wrapper"

    def wrap(self, call: Call, inner: Callable[[Call], torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


@dataclass(eq=False)
class AttentionProgram:
    """One attention module's program: its layer's facts and the terms patched into it."""

    layer_type: str | None = None
    #: the window the layer's own attention is limited to (``None``: full attention)
    sliding_window: int | None = None
    terms: list[Term] = field(default_factory=list)
    #: the cache layer of the forward under way (noted by the attention site before the module runs)
    pending: CacheLink | None = field(default=None, repr=False)
    #: names the patch this program belongs to (the same in every layer of one patch, and in a copy of it)
    patch_id: str = ""

    def add(self, term: Term) -> None:
        """Add ``term``; raises ``ValueError`` when the layer's kernel cannot run it beside the others."""
        if isinstance(term, PositionRule) and self.position_rule is not None:
            raise ValueError(f"a layer takes one position rule; it has {self.position_rule.name}, got {term.name}")
        terms = [*self.terms, term]
        kernel = _kernel_for(terms)
        refused = [t.name for t in terms if not isinstance(t, (Wrapper, QueryScale)) and not isinstance(t, kernel.handles)]
        if refused:
            raise ValueError(f"no attention kernel runs {', '.join(refused)} together with {kernel.name}")
        self.terms.append(term)

    def of_type(self, cls: type) -> list[Any]:
        return [t for t in self.terms if isinstance(t, cls)]

    @property
    def position_rule(self) -> PositionRule | None:
        rules = self.of_type(PositionRule)
        return rules[0] if rules else None

    def describe(self) -> str:
        return " + ".join(t.describe() for t in self.terms) or "plain"

    def run(self, call: Call) -> torch.Tensor:
        """The output ``[b, h, n, dv]`` of ``call``: the wrappers around the kernel."""
        kernel = _OVERRIDE[-1] if _OVERRIDE else _kernel_for(self.terms).run

        def inner_of(wrappers: list[Wrapper]) -> Callable[[Call], torch.Tensor]:
            if not wrappers:
                return kernel
            return lambda c: wrappers[0].wrap(c, inner_of(wrappers[1:]))

        return inner_of(self.of_type(Wrapper))(call)


# --- kernels -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernel:
    """How programs whose highest-ranked term is of ``term_type`` run: ``run(call) -> [b, h, n, dv]``. It also
    runs the terms of ``handles`` (every kernel applies query scales; wrappers are run around it)."""

    name: str
    term_type: type | None
    run: Callable[[Call], torch.Tensor]
    rank: int
    handles: tuple[type, ...] = ()


_KERNELS: list[Kernel] = []
_OVERRIDE: list[Callable[[Call], torch.Tensor]] = []


def register_kernel(kernel: Kernel) -> Kernel:
    """Make ``kernel`` run the programs whose highest-ranked term type is its ``term_type`` (``None``: programs
    with neither; the plain kernel)."""
    if any(k.term_type is kernel.term_type for k in _KERNELS):
        raise ValueError(f"a kernel for {kernel.term_type} is registered already")
    _KERNELS.append(kernel)
    _KERNELS.sort(key=lambda k: -k.rank)
    return kernel


def unregister_kernel(term_type: type | None) -> None:
    _KERNELS[:] = [k for k in _KERNELS if k.term_type is not term_type]


def _kernel_for(terms: list[Term]) -> Kernel:
    for kernel in _KERNELS:
        if kernel.term_type is None or any(isinstance(t, kernel.term_type) for t in terms):
            return kernel
    raise RuntimeError("no attention kernel is registered (import rope_ext.attention)")


@contextlib.contextmanager
def kernel_override(run: Callable[[Call], torch.Tensor]) -> Iterator[None]:
    """Run every program's core through ``run`` instead of its kernel (tests: the plain reference; benchmarks: a
    baseline strategy). Process-wide while the block runs."""
    _OVERRIDE.append(run)
    try:
        yield
    finally:
        _OVERRIDE.remove(run)


# --- one call ------------------------------------------------------------------------------------------


@dataclass(eq=False)
class RowGroup:
    """Rows of a call compacted to their own tokens, with their positions (float32): ``q [b', h, n', d]``,
    ``k, v [b', hk, m', d]``, ``q_pos [n']``, ``k_pos [m']`` (one set shared by the group's rows)."""

    index: int | None  # the row (``None``: every row of the call)
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    #: keys at positions ``0..m'-1`` and the queries the last ``n'`` of them
    contiguous: bool
    keep: Keep
    queries: torch.Tensor | None = None  # the query slots of the row in the call (padded rows)


@dataclass(eq=False)
class Call:
    """One attention call: ``q [b, h, n, d]``, ``k, v [b, hk, m, d]`` (GQA heads as they are), the padding mask
    over the keys (``rows [b, m]`` bool, ``None``: no padding), the queries' ``position_ids [b, n]`` as the model
    gave them (``None``: from the keys), the softmax scale, the dropout probability, the layer's sliding window
    and the cache layer the keys come from; ``position_bias``: what the model passed as one (T5's, through the
    patch: a ``relative.RelativeBias``)."""

    program: AttentionProgram
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    rows: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    dropout: float = 0.0
    sliding_window: int | None = None
    link: CacheLink | None = None
    module: Any = None
    position_bias: Any = None

    def replace(self, **changes: Any) -> Call:
        return dataclasses.replace(self, **changes)

    def custom_positions(self) -> list[torch.Tensor] | None:
        """Per row, the queries' positions where ``position_ids`` differ from the keys' own (``None``: they do
        not, or none were given). Checked once per forward (every layer gets the same tensors)."""
        ids = self.position_ids
        if ids is None:
            return None
        n, m = self.q.shape[2], self.k.shape[2]
        key = (n, m, id(self.rows), None if self.rows is None else version(self.rows), version(ids))
        found = _POSITIONS.get(ids)
        if found is not None and found[0] == key:
            return found[1]
        custom = _custom_positions(ids.expand(self.q.shape[0], -1), self.rows, n, m)
        if version(ids) is not None:
            _POSITIONS[ids] = (key, custom)
        return custom

    def row_groups(self) -> Iterator[RowGroup]:
        """The call as rows compacted to their own tokens: all rows at once where nothing is padded and the
        positions are the keys' own, else row by row."""
        q, k, v, rows = self.q, self.k, self.v, self.rows
        batch, n, m = q.shape[0], q.shape[2], k.shape[2]
        custom = self.custom_positions()
        device = q.device
        if rows is None and custom is None:
            positions = torch.arange(m, device=device, dtype=torch.float32)
            yield RowGroup(None, q, k, v, positions[m - n :], positions, True, Keep(self.link, None, None))
            return
        for r in range(batch):
            keep = rows[r] if rows is not None else None
            if keep is None:
                keys, queries = None, None
                q_r, k_r, v_r = q[r : r + 1], k[r : r + 1], v[r : r + 1]
            else:
                keys = keep.nonzero().squeeze(-1)
                queries = keep[m - n :].nonzero().squeeze(-1)
                if queries.numel() == 0:
                    continue
                q_r, k_r, v_r = q[r : r + 1, :, queries], k[r : r + 1, :, keys], v[r : r + 1, :, keys]
            m_r = k_r.shape[2]
            if custom is None:
                k_pos = torch.arange(m_r, device=device, dtype=torch.float32)
                q_pos, contiguous = k_pos[m_r - q_r.shape[2] :], True
            else:
                q_pos = k_pos = custom[r].to(device=device, dtype=torch.float32)
                contiguous = False
            yield RowGroup(r, q_r, k_r, v_r, q_pos, k_pos, contiguous, Keep(self.link, r, keep), queries)

    def run_rows(self, attend: Callable[[RowGroup], torch.Tensor]) -> torch.Tensor:
        """``attend(group) -> [b', h, n', dv]`` over the row groups, put back as ``[b, h, n, dv]`` (the queries of a
        row that is all padding get zeros)."""
        groups = self.row_groups()
        first = next(groups, None)
        if first is not None and first.index is None:
            return attend(first)
        q, v = self.q, self.v
        rows = [torch.zeros(*q.shape[1:-1], v.shape[-1], dtype=q.dtype, device=q.device) for _ in range(q.shape[0])]
        for group in ([first] if first is not None else []) + list(groups):
            result = attend(group)[0]  # [h, n', dv]
            rows[group.index] = result if group.queries is None else rows[group.index].index_copy(1, group.queries, result)
        return torch.stack(rows)  # (out of place: autograd may keep what it multiplied)


#: position_ids tensors analysed already (per forward every layer gets the same tensor): their analysis key and
#: result (a comparison on an accelerator waits for the device, so it runs once)
_POSITIONS = WeakIdKeyDictionary()


def _custom_positions(ids: torch.Tensor, rows: torch.Tensor | None, n: int, m: int) -> list[torch.Tensor] | None:
    """Per row, the kept queries' positions when ``position_ids`` differ from the keys' own, checked: increasing,
    ``>= 0``, and equal to the keys' own where keys come from a cache (their positions were not seen). In a padded
    row, ids numbered by slot (the pads counted, as transformers makes them) are its own positions too."""
    per_row = []
    differs = False
    for r in range(ids.shape[0]):
        kept = ids[r] if rows is None else ids[r][rows[r][m - n :]]
        count = m if rows is None else int(rows[r].sum())
        own = torch.arange(count - kept.shape[0], count, device=ids.device)
        if rows is not None and not bool(rows[r].all()):
            # padding shifts nothing: transformers numbers the pads too when it makes position_ids itself (by slot),
            # generate numbers the tokens alone; both are the row's own positions
            slots = rows[r][m - n :].nonzero().squeeze(-1) + (m - n)
            if torch.equal(kept, slots.to(kept.dtype)):
                per_row.append(own)
                continue
        if kept.shape == own.shape and torch.equal(kept, own.to(kept.dtype)):
            per_row.append(own)
            continue
        differs = True
        if n != m:
            raise ValueError(
                f"rope_ext attention takes cached keys at their own positions (0..{count - 1} for row {r}), but "
                f"position_ids for the new queries are {_show(kept)}: custom position_ids (offsets, PoSE jumps) are "
                "supported on a forward without a cached prefix, not with a cache (nor a static, preallocated cache)"
            )
        if kept.numel() and (bool((kept[1:] <= kept[:-1]).any()) or int(kept.min()) < 0):
            raise ValueError(
                f"rope_ext attention takes increasing position_ids >= 0 per row (jumps allowed, as PoSE makes them); "
                f"row {r} has {_show(kept)}. Packed sequences (positions starting again at 0) are not supported: "
                "give each sequence its own row"
            )
        per_row.append(kept)
    return per_row if differs else None


def _show(ids: torch.Tensor) -> str:
    values = ids.tolist()
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:4]))}, ..., {', '.join(map(str, values[-3:]))}]"
