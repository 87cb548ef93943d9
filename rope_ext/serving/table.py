"""The export table of docs/serving.md: every registered method, per target, as ``target_plan`` plans it on the default
model's rotary (SmolLM2-135M: head_dim 64, theta 1e5, L 8192; DCA on a Qwen2 config, where vLLM and SGLang read it).
Generated from the code (``scripts/export_table.py --write``; tests/test_serving.py checks the committed one)."""

from __future__ import annotations

import re

from rope_ext.methods import FrequencyConfig, get_method_class, list_methods, make_configs
from rope_ext.serving import TARGETS
from rope_ext.serving.plan import APPROXIMATE, EXACT, MAPPED, target_plan

#: the default model's rotary, as its config.json states it
SMOL = {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "head_dim": 64,
        "max_position_embeddings": 8192, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}
#: variants shown beside each frequency method's plain ``factor=4``
VARIANTS = ("yarn:factor=4:attention_factor=1.0", "yarn:factor=4:truncate=false",
            "yarn:factor=4:mscale=1.0:mscale_all_dim=1.0")
START, END = "<!-- export-table:start -->", "<!-- export-table:end -->"
LABELS = {"transformers": "transformers", "vllm": "vLLM", "sglang": "SGLang", "llama.cpp": "llama.cpp"}


def specs() -> list[str]:
    out = []
    for name in list_methods():
        if issubclass(get_method_class(name), FrequencyConfig):
            if name == "longrope":  # (its searched factors: any list of 32; these grow from 1 to 4)
                out.append("longrope:factor=4:long_factor=[" + ",".join(f"{1 + 3 * i / 31:.4g}" for i in range(32)) + "]")
            else:
                out.append(f"{name}:factor=4")
            out += [variant for variant in VARIANTS if variant.startswith(f"{name}:")]
        else:
            for spec in (name, f"{name}:factor=4", f"{name}:clamp_len=512"):  # (options some methods require)
                try:
                    make_configs(spec)
                except ValueError:
                    continue
                out.append(spec)
                break
            else:
                raise ValueError(f"{name}: no spec for the export table; add the options it requires")
    return out


def cell(plan) -> str:
    if plan.status == APPROXIMATE:
        return f"approximate ({plan.difference:.2g})"
    return {EXACT: "exact", MAPPED: "mapped"}.get(plan.status, "no")


def export_table() -> str:
    """The markdown table, and why each cell that is not exact is not (one line per reason, its methods named)."""
    lines = ["| method | " + " | ".join(LABELS[target] for target in TARGETS) + " |",
             "|---|" + "---|" * len(TARGETS)]
    reasons: dict[tuple[str, str | None, tuple[str, ...]], list[str]] = {}
    for spec in specs():
        config = {**SMOL, "model_type": "qwen2"} if spec == "dca" else SMOL
        methods = make_configs(spec)
        plans = [target_plan(config, methods, target) for target in TARGETS]
        shown = re.sub(r"long_factor=\[[^\]]*\]", "long_factor=[...]", spec)
        lines.append(f"| `{shown}` | " + " | ".join(cell(plan) for plan in plans) + " |")
        mine: dict[tuple[str, str | None], list[str]] = {}
        for plan in plans:
            if plan.status != EXACT:
                why = plan.reason.removeprefix("+".join(method.method for method in methods) + ": ")
                engine = "plain transformers" if plan.target == "transformers" else plan.target
                mine.setdefault((why.replace(engine, "{engine}"), plan.alternative), []).append(LABELS[plan.target])
        for (why, alternative), targets in mine.items():
            reasons.setdefault((why, alternative, tuple(targets)), []).append(shown)
    out = []
    for (why, alternative, targets), named in reasons.items():
        engine = targets[0] if len(targets) == 1 else "the engine"
        instead = f" Instead: {alternative}." if alternative else ""
        out.append(f"- {', '.join(f'`{n}`' for n in named)} ({', '.join(targets)}): {why.format(engine=engine)}."
                   f"{instead}")
    return "\n".join(lines) + "\n\n" + "\n".join(out) + "\n"


def with_export_table(text: str, table: str) -> str:
    """``text`` with the block between the markers replaced by ``table``."""
    start, end = text.index(START) + len(START), text.index(END)
    return text[:start] + "\n" + table + text[end:]
