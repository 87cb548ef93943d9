"""What ``rope_ext.patch`` checks and installs around the plan, apart from the methods: the refusal of a config
shared with another model (a patch would change both), and the warning once a sequence passes the length the
patch was made for (transformers' own "predefined maximum length" reminder silenced for it)."""

from __future__ import annotations

import gc
import logging
import sys
import weakref
from dataclasses import dataclass
from typing import Any

from torch import nn

from rope_ext.installers.base import ForwardPreHookEdit, PlanBuilder
from rope_ext.methods import HOOK_POSITION_RULE

_logger = logging.getLogger("rope_ext")


#: references to a config held by ``patch`` itself while it counts (``Sites.config``, the mapping iterated,
#: the generators' closure cell, ``sys.getrefcount``'s argument); a test pins this number. Another model
#: built from the same config adds at least three (its model, base model and rotary module).
OWN_TEMPORARY_REFERENCES = 4


def foreign_modules(config: Any, own: list[nn.Module]) -> list[nn.Module]:
    """transformers models outside ``own`` (and not containing it) whose attributes hold ``config``: one scan of
    the garbage collector's objects (and one per attribute dict found, to find the module owning it)."""
    from transformers import PreTrainedModel

    own_ids = {id(m) for m in own} | {id(vars(m)) for m in own}
    foreign = []
    for ref in gc.get_referrers(config):
        if id(ref) in own_ids:
            continue
        owner = ref
        if isinstance(ref, dict) and "_modules" in ref and "_parameters" in ref:  # a module's attribute dict
            owner = next((r for r in gc.get_referrers(ref) if isinstance(r, nn.Module) and vars(r) is ref), None)
        if isinstance(owner, PreTrainedModel) and not any(m is own[0] for m in owner.modules()):
            foreign.append(owner)
    return foreign


def refuse_shared_configs(model: nn.Module, builder: PlanBuilder) -> None:
    """A config object the plan edits must belong to this model alone (two models built from one config
    object would both change, and unpatching one would undo the other's values).

    Scanning every object for referrers costs ~0.2 s in a large process, so it runs only when the config has
    more references than this model's modules, the plan and this function account for.
    """
    edits = builder.plan.edits
    own = [*model.modules(), *(e.new for e in edits if isinstance(getattr(e, "new", None), nn.Module))]
    configs = {id(e.obj): e.obj for e in builder.config_edits}
    for config in configs.values():
        known = sum(1 for m in own for value in vars(m).values() if value is config)
        known += sum(1 for e in edits if getattr(e, "obj", None) is config)
        known += sum(1 for e in edits for c in getattr(e, "configs", ()) if c is config)
        if sys.getrefcount(config) - known <= OWN_TEMPORARY_REFERENCES:
            continue
        foreign = foreign_modules(config, own)
        if foreign:
            gc.collect()  # a model that is gone but not yet collected does not count
            foreign = foreign_modules(config, own)
        if foreign:
            raise ValueError(
                "this model's config object is shared with another model (built from the same config object, "
                "not part of this one); patching would change both. Give each model its own config, e.g. build "
                "the other from copy.deepcopy(config)"
            )


#: transformers' generation reminder, which quotes ``config.max_position_embeddings`` (``MaxLengthCriteria``)
REMINDER = "This is a friendly reminder - the current text generation call has exceeded the model's predefined maximum length ({})"


@dataclass(eq=False)
class RangeWarning:
    """Forward pre-hook of the patched model: warns once when a forward's sequence (input plus cache, or the
    largest position id of a forward without a cache) passes the longest one its methods were made for."""

    method: str
    limit: int
    warned: bool = False

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if self.warned:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if not hasattr(ids, "shape") or ids.dim() < 2:
            return
        cache = kwargs.get("past_key_values")
        cached = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
        length = int(ids.shape[1]) + int(cached)
        positions = kwargs.get("position_ids")
        if positions is not None and not cached and positions.numel():  # (PoSE ids reach past the tokens; read
            length = max(length, int(positions.max()) + 1)  # once per prompt, not at every cached step)
        if length > self.limit:
            self.warned = True
            _logger.warning(
                f"rope_ext: a sequence of {length} tokens is beyond what {self.method} was made for ({self.limit} "
                "tokens: past it, remapped distances exceed the trained ones, or the frequency scaling ends); "
                "expect degraded outputs. (Warned once per patch.)"
            )


class ReminderFilter(logging.Filter):
    """Drops transformers' "exceeded the model's predefined maximum length" reminder for a length a live patched
    model extends past (the patch warns by its own range instead). One filter for the process; the models are
    weakly held, so a model dropped without ``unpatch`` silences nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.lengths: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.lengths:
            return True
        message = record.getMessage()
        return not any(message.startswith(REMINDER.format(length)) for length in set(self.lengths.values()))


REMINDERS = ReminderFilter()


@dataclass
class SilenceReminder:
    """While patched, ``REMINDERS`` drops the reminder at ``length`` for ``model``."""

    model: nn.Module
    length: int

    def apply(self) -> None:
        target = logging.getLogger("transformers.generation.stopping_criteria")
        if REMINDERS not in target.filters:
            target.addFilter(REMINDERS)
        REMINDERS.lengths[self.model] = self.length

    def changed(self) -> None:
        return None

    def revert(self) -> None:
        REMINDERS.lengths.pop(self.model, None)


def warn_beyond_range(builder: PlanBuilder, anchor: nn.Module) -> None:
    """Install the range warning of the plan's methods (an attention method's range when there is one, else a
    frequency method's), and silence transformers' reminder where the patch reaches past it."""
    ranges = builder.memo.get("ranges", {})
    if not ranges:
        return
    method, limit = ranges.get(HOOK_POSITION_RULE) or next(iter(ranges.values()))
    if limit is not None:
        builder.plan.edits.append(ForwardPreHookEdit(anchor, RangeWarning(method, limit)))
    config = getattr(anchor, "config", None)
    claimed = getattr(config, "max_position_embeddings", None)
    for edit in builder.config_edits:
        if edit.obj is config and edit.name == "max_position_embeddings":
            claimed = edit.new
    if isinstance(claimed, int) and (limit is None or limit > claimed):
        builder.plan.edits.append(SilenceReminder(anchor, claimed))

