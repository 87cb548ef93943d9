"""A fine-tuning run's configuration: one dataclass, read from a YAML file and/or command-line flags.

One override style (``rope-ext finetune --config run.yaml --lr 1e-4``): the YAML file's keys are the field names
(``lora_r``; ``lora-r`` is accepted too), a flag given on the command line replaces the file's value, and what
neither gives keeps its default. ``check()`` refuses a bad value with one line naming the valid ones.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from rope_ext.eval.objectives import check_target_tokens
from rope_ext.methods import MethodConfig
from rope_ext.methods.wrappers import s2_group_size
from rope_ext.runs.specs import one_spec
from rope_ext.runs.values import field_kinds, named_as_in_file, option_flag, read_yaml

PACKING = ("packed", "document")
TRAINABLE = ("embeddings", "norms")
OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("constant_with_warmup", "linear", "cosine", "constant")
PRECISIONS = ("no", "bf16", "fp16")
#: the most torch threads a command takes
MAX_THREADS = 1024


def _help(text: str, **metadata: Any) -> dict[str, Any]:
    return {"help": text, **metadata}


@dataclass
class LoopConfig:
    """What every training command shares: the data, the optimisation, evaluation, checkpoints and the output folder
    (``rope_ext.train.loop.run_training`` reads these). ``check()`` refuses a bad value in one line."""

    # data
    dataset: str | None = field(default=None, metadata=_help("a folder saved with Dataset.save_to_disk, or a hub name"))
    text_files: list[str] | None = field(default=None, metadata=_help("plain-text files, one document each"))
    split: str | None = field(default=None, metadata=_help("--dataset's split (default: train)"))
    text_column: str = field(default="text", metadata=_help("--dataset's text column"))
    exclude: list[str] = field(default_factory=list, metadata=_help(
        "document titles kept out of training (e.g. the books an evaluation scores)"))
    packing: str = field(default="packed", metadata=_help(
        "packed: documents joined (EOS between) and cut into sequences; document: sequences within each document",
        choices=PACKING))
    sequence_length: int = field(default=2048, metadata=_help(
        "tokens per training sequence (--window before 0.2)", aliases=["--window"]))
    # optimisation
    lr: float = field(default=1e-4, metadata=_help("peak learning rate"))
    warmup_steps: int = field(default=10, metadata=_help("linear warm-up steps"))
    schedule: str = field(default="constant_with_warmup", metadata=_help("learning-rate schedule", choices=SCHEDULES))
    optimizer: str = field(default="adamw", metadata=_help("optimizer", choices=OPTIMIZERS))
    weight_decay: float = field(default=0.0, metadata=_help("weight decay"))
    adam_beta2: float = field(default=0.95, metadata=_help("Adam's beta2 (beta1 is 0.9)"))
    max_grad_norm: float = field(default=1.0, metadata=_help("gradient clipping norm (0: none)"))
    micro_batch: int = field(default=1, metadata=_help("sequences per process per forward"))
    accumulation: int = field(default=1, metadata=_help("micro-batches per optimizer step"))
    max_steps: int = field(default=100, metadata=_help("optimizer steps"))
    seed: int = field(default=0, metadata=_help(
        "seeds the data order, dropout and initialisations (a fine-tune's PoSE positions and LoRA)"))
    mixed_precision: str | None = field(default=None, metadata=_help(
        "no, bf16 or fp16 (default: accelerate's: the launch configuration's, else no)", choices=PRECISIONS))
    # evaluation, checkpoints, output
    eval_every: int = field(default=0, metadata=_help("evaluate every N steps (0: at the end only if --eval-document)"))
    eval_document: str | None = field(default=None, metadata=_help(
        "title of the held-out document evaluated (kept out of training)"))
    eval_target_tokens: int = field(default=1024, metadata=_help(
        "fixed-target perplexity: the last N tokens of the evaluated length (a fine-tune's --target-length, else the "
        "sequence length) of the held-out document"))
    save_every: int = field(default=50, metadata=_help("checkpoint every N steps (0: none)"))
    keep_checkpoints: int = field(default=2, metadata=_help("checkpoints kept (the newest)"))
    log_every: int = field(default=1, metadata=_help("write the loss log every N steps"))
    threads: int = field(default=0, metadata=_help("torch threads (0: torch's choice)"))
    out: str = field(default="results/finetune", metadata=_help("output folder"))

    #: integer options and their lowest values
    AT_LEAST: ClassVar[dict[str, int]] = {
        "sequence_length": 2, "micro_batch": 1, "accumulation": 1, "max_steps": 1, "warmup_steps": 0, "eval_every": 0,
        "eval_target_tokens": 1, "save_every": 0, "keep_checkpoints": 1, "log_every": 1, "threads": 0,
    }
    #: a flag -> the file's options it replaces (``--text-files`` over a file's ``dataset`` and the documents it
    #: names; ``--full`` over its LoRA options), unless flags give them too
    REPLACES: ClassVar[dict[str, tuple[str, ...]]] = {
        "text_files": ("dataset", "split", "text_column", "exclude", "eval_document"),
        "dataset": ("text_files", "exclude", "eval_document"),
        "full": ("trainable", "lora_targets", "lora_r", "lora_alpha", "lora_dropout"),
    }
    #: number options and their ranges: (name, low, low included, high, high included)
    RANGES: ClassVar[tuple[tuple[str, float, bool, float | None, bool], ...]] = (
        ("lr", 0, False, None, False), ("weight_decay", 0, True, None, False), ("adam_beta2", 0, True, 1, False),
        ("max_grad_norm", 0, True, None, False),
    )

    #: options renamed, by their old names: a YAML file's old key, the old flag and a folder's saved options still work
    RENAMED: ClassVar[dict[str, str]] = {"window": "sequence_length"}
    #: where ``from_sources`` read the options: the YAML file, the options it gave, those flags gave
    sources: ClassVar[tuple[str | Path | None, tuple[str, ...], tuple[str, ...]]] = (None, (), ())

    def options(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def target(self) -> int:
        """The length evaluations run at (the sequence length; a fine-tune's target length)."""
        return self.sequence_length

    @classmethod
    def from_sources(cls, file: str | Path | None = None, flags: dict[str, Any] | None = None) -> LoopConfig:
        """The configuration of ``file`` (YAML) with ``flags`` (given flags only) on top; checked."""
        values: dict[str, Any] = {}
        given = {k: v for k, v in (flags or {}).items() if v is not None}
        if file is not None:
            values.update(read_yaml(file, cls))
            # (a flag replaces what the file says of the same thing: the data source, LoRA under --full)
            for flag, replaced in cls.REPLACES.items():
                if flag in given and given[flag] not in (False, None):
                    for name in replaced:
                        if name not in given:
                            values.pop(name, None)
        sources = (file, tuple(name for name in values if name not in given), tuple(given))
        values.update(given)
        with named_as_in_file(*sources):  # (a bad value of the file's named as its key, not as a flag)
            config = cls(**values)
            config.sources = sources
            config.check()
            # (a run's saved options hold every default: Adam's beta2 refused with SGD only where it is another value)
            if values.get("adam_beta2") not in (None, cls.adam_beta2) and config.optimizer == "sgd":
                raise ValueError("--adam-beta2: only for --optimizer adamw or adam (SGD has no beta2)")
            if values.get("warmup_steps") not in (None, 0, cls.warmup_steps) and config.schedule == "constant":
                raise ValueError(
                    "--warmup-steps: the 'constant' schedule has no warm-up; give --schedule constant_with_warmup, "
                    "linear or cosine, or leave --warmup-steps out"
                )
        return config

    def check(self) -> None:
        """Raise ``ValueError`` (one line, naming the valid values) on a bad value."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        kinds = field_kinds(type(self))
        for name, f in fields.items():
            value = getattr(self, name)
            kind, optional = kinds[name]
            if value is None:
                if not optional:
                    raise ValueError(f"{option_flag(name)}: give a value")
                continue
            if kind == "list":
                if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
                    raise ValueError(f"{option_flag(name)}: give a list of names, got {value!r}")
                value = [v.strip() for v in value]
                setattr(self, name, value)
            elif kind == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"{option_flag(name)}: give true or false, got {value!r}")
            elif kind == "int":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"{option_flag(name)}: give an integer, got {value!r}")
            elif kind == "float":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"{option_flag(name)}: give a number, got {value!r}")
                setattr(self, name, float(value))
            elif kind == "str":
                if not isinstance(value, str) or not value.strip():
                    raise ValueError(f"{option_flag(name)}: give a non-empty text, got {value!r}")
            choices = f.metadata.get("choices")
            if choices:
                bad = [v for v in (value if isinstance(value, list) else [value]) if v not in choices]
                if bad:
                    raise ValueError(f"{option_flag(name)}: {bad[0]!r} is not one of {', '.join(choices)}")
        for name, low in self.AT_LEAST.items():
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise ValueError(f"{option_flag(name)}: must be an integer >= {low}, got {getattr(self, name)}")
        if self.threads > MAX_THREADS:
            raise ValueError(f"--threads: must be an integer in [0, {MAX_THREADS}] (0: torch's choice), got {self.threads}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"--seed: must be an integer in [0, 2**32 - 1], got {self.seed}")
        if self.text_files == []:
            raise ValueError(f"{option_flag('text_files')}: an empty list; give at least one name, or leave the option out")
        for name, low, low_in, high, high_in in self.RANGES:
            value = getattr(self, name)
            below = value < low or (value == low and not low_in)
            above = high is not None and (value > high or (value == high and not high_in))
            if below or above:
                bounds = f"{'[' if low_in else '('}{low}, {'inf' if high is None else high}{']' if high_in else ')'}"
                raise ValueError(f"{option_flag(name)}: must be in {bounds}, got {value}")
        if self.dataset and self.text_files:
            raise ValueError("give --dataset or --text-files, not both")
        if self.split and not self.dataset:
            raise ValueError("--split: only with --dataset")
        if self.eval_every and not self.eval_document:
            raise ValueError("--eval-every: give --eval-document (the held-out document evaluated)")
        if self.eval_document and self.eval_target_tokens >= self.target:
            raise ValueError(
                f"--eval-target-tokens {self.eval_target_tokens} must be below the evaluated length ({self.target_source()}: "
                f"{self.target})"
            )

    def target_source(self) -> str:
        """Where ``target`` comes from, as the options name it."""
        return "the sequence length"


@dataclass
class FinetuneConfig(LoopConfig):
    """Everything a ``rope-ext finetune`` run depends on (saved with the run as ``finetune_config.json``)."""

    # what is trained
    model: str = field(default="default", metadata=_help(
        "'default' (embedded SmolLM2-135M), a folder or a hub id (default: default)"))
    methods: str = field(default="none", metadata=_help(
        "the patch to train under, in the evaluation's spec syntax (yarn:factor=4, yarn:factor=4+dca); 'none': the "
        "unpatched model (plain LoRA, the baseline)"))
    s2_attn: bool = field(default=False, metadata=_help(
        "shifted sparse attention while training (LongLoRA: groups of 1/4 of the sequence, half the heads shifted); "
        "inference keeps full attention"))
    s2_group_ratio: float = field(default=0.25, metadata=_help("S2-Attn's group size as a fraction of the sequence length"))
    target_length: int | None = field(default=None, metadata=_help(
        "the context the run extends to (PoSE positions reach it; evaluation runs at it); default: the sequence length"))
    pose: bool = field(default=False, metadata=_help(
        "PoSE: position ids that skip ahead within each sequence, below --target-length"))
    # what is trainable
    full: bool = field(default=False, metadata=_help("full fine-tuning instead of LoRA"))
    lora_r: int = field(default=8, metadata=_help("LoRA rank"))
    lora_alpha: float = field(default=16.0, metadata=_help("LoRA alpha"))
    lora_dropout: float = field(default=0.05, metadata=_help("LoRA dropout"))
    lora_targets: list[str] | None = field(default=None, metadata=_help(
        "module names LoRA adapts (default: the linear layers of the family's attention modules)"))
    trainable: list[str] = field(default_factory=list, metadata=_help(
        "also train these in full (LongLoRA's LoRA+): embeddings, norms", choices=TRAINABLE))
    gradient_checkpointing: bool = field(default=False, metadata=_help("recompute activations in the backward pass"))

    AT_LEAST: ClassVar[dict[str, int]] = {**LoopConfig.AT_LEAST, "lora_r": 1}
    RANGES: ClassVar[tuple[tuple[str, float, bool, float | None, bool], ...]] = (
        *LoopConfig.RANGES, ("lora_alpha", 0, False, None, False), ("lora_dropout", 0, True, 1, False),
        ("s2_group_ratio", 0, False, 1, True),
    )

    @property
    def target(self) -> int:
        return self.target_length if self.target_length is not None else self.sequence_length

    def target_source(self) -> str:
        return "--target-length, default the sequence length"

    def check(self) -> None:
        if isinstance(self.target_length, int) and not isinstance(self.target_length, bool) and self.target_length < 2:
            raise ValueError(f"--target-length: must be an integer >= 2, got {self.target_length}")
        super().check()
        if self.lora_targets == []:
            raise ValueError(f"{option_flag('lora_targets')}: an empty list; give at least one name, or leave the option out")
        if self.target_length is not None and self.target_length < self.sequence_length:
            raise ValueError(
                f"--sequence-length {self.sequence_length} is above --target-length {self.target_length}: a sequence "
                "is trained at positions below the target; give a sequence length up to the target length, or a longer "
                "target"
            )
        if self.full:
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            given = [name for name in ("trainable", "lora_targets") if getattr(self, name)]
            given += [name for name in ("lora_r", "lora_alpha", "lora_dropout") if getattr(self, name) != defaults[name]]
            if given:
                raise ValueError(f"{option_flag(given[0])}: a LoRA option, but --full trains every parameter; leave one out")
        if self.pose and self.target <= self.sequence_length:
            raise ValueError(
                f"--pose: PoSE's positions skip ahead up to --target-length, which is the sequence length "
                f"({self.sequence_length}) here; give a --target-length above it, or leave --pose out"
            )
        if not self.s2_attn and self.s2_group_ratio != type(self).s2_group_ratio:
            raise ValueError("--s2-group-ratio: an S2-Attn option; give --s2-attn too, or leave it out")
        if self.s2_attn:
            try:
                s2_group_size(self.sequence_length, self.s2_group_ratio)
            except ValueError as error:
                raise ValueError(f"--s2-attn with --sequence-length {self.sequence_length}: {error}") from None
        if any(config.method == "s2_attn" for config in one_spec(self.methods)):
            raise ValueError(
                f"--methods {self.methods}: S2-Attn is given with --s2-attn (and --s2-group-ratio), which trains with it "
                "and leaves it out of the saved patch; take s2_attn out of --methods"
            )


ARCHITECTURES = ("gpt2", "llama", "t5", "deberta")
#: architecture -> the objective it trains with (``rope_ext.eval.objectives``; "fixed": next-token)
OBJECTIVES = {"gpt2": "fixed", "llama": "fixed", "t5": "span-corruption", "deberta": "masked-lm"}


@dataclass
class TrainConfig(LoopConfig):
    """Everything a ``rope-ext train`` run depends on (saved with the run as ``train_config.json``): a small causal
    model built from a config (with ``tokenizer``'s vocabulary), trained from scratch under a position method."""

    architecture: str = field(default="gpt2", metadata=_help(
        "gpt2 (a learned position table of --sequence-length rows), llama (RoPE), t5 (relative buckets; span corruption) or "
        "deberta (DeBERTa-v3's disentangled log buckets; masked LM)", choices=ARCHITECTURES))
    methods: str = field(default="none", metadata=_help(
        "the position method trained with, in the evaluation's spec syntax (alibi, kerple, fire, sandwich, xpos...); "
        "'none': the architecture's own positions"))
    tokenizer: str = field(default="default", metadata=_help(
        "a tokenizer folder or hub id: its vocabulary and special tokens make the model's; 'default': the default "
        "model's (SmolLM2, 49,152 tokens) (default: default)"))
    layers: int = field(default=4, metadata=_help("transformer layers"))
    heads: int = field(default=4, metadata=_help("attention heads"))
    kv_heads: int | None = field(default=None, metadata=_help("key/value heads (llama; default: --heads)"))
    hidden: int = field(default=256, metadata=_help("hidden size"))
    intermediate: int | None = field(default=None, metadata=_help(
        "MLP size (default: 8/3 x hidden rounded up to 64 for llama, else 4 x hidden)"))
    rope_theta: float = field(default=10000.0, metadata=_help("RoPE base (llama)"))
    dropout: float = field(default=0.0, metadata=_help("dropout (attention, residual and embeddings)"))
    sequence_length: int = field(default=256, metadata=_help(
        "tokens per training sequence (GPT-2's table rows; --window before 0.2)", aliases=["--window"]))
    lr: float = field(default=1e-3, metadata=_help("peak learning rate"))
    schedule: str = field(default="cosine", metadata=_help("learning-rate schedule", choices=SCHEDULES))
    weight_decay: float = field(default=0.1, metadata=_help("weight decay"))
    micro_batch: int = field(default=8, metadata=_help("sequences per process per forward"))
    max_steps: int = field(default=1000, metadata=_help("optimizer steps"))
    save_every: int = field(default=100, metadata=_help("checkpoint every N steps (0: none)"))
    out: str = field(default="results/train", metadata=_help("output folder"))

    AT_LEAST: ClassVar[dict[str, int]] = {**LoopConfig.AT_LEAST, "layers": 1, "heads": 1, "kv_heads": 1, "hidden": 2,
                                          "intermediate": 1}
    RANGES: ClassVar[tuple[tuple[str, float, bool, float | None, bool], ...]] = (
        *LoopConfig.RANGES, ("rope_theta", 1, False, None, False), ("dropout", 0, True, 1, False),
    )

    def check(self) -> None:
        super().check()
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be a multiple of --heads {self.heads}")
        if self.architecture == "llama" and (self.hidden // self.heads) % 2:
            raise ValueError(f"--hidden / --heads = {self.hidden // self.heads}: RoPE needs an even head dimension")
        if self.architecture != "llama" and self.rope_theta != 10000.0:
            raise ValueError(f"--rope-theta: only for --architecture llama ({self.architecture} has no RoPE)")
        if self.kv_heads is not None:
            if self.architecture != "llama":
                raise ValueError(f"--kv-heads: only for --architecture llama ({self.architecture} has one key/value "
                                 "head per head)")
            if self.heads % self.kv_heads:
                raise ValueError(f"--kv-heads {self.kv_heads} must divide --heads {self.heads}")
        if self.architecture == "deberta" and self.sequence_length < 4:
            raise ValueError(f"--sequence-length {self.sequence_length}: DeBERTa's log buckets (sequence length / 2 of "
                             "them) need a sequence length of at least 4")
        if self.objective != "fixed":
            check_target_tokens(self.objective, self.sequence_length, "--sequence-length")
            if self.eval_document:
                check_target_tokens(self.objective, self.eval_target_tokens, "--eval-target-tokens")
        one_spec(self.methods)  # (unknown methods and bad options: refused before anything loads)

    @property
    def mlp_size(self) -> int:
        if self.intermediate is not None:
            return self.intermediate
        return -(-8 * self.hidden // 3 // 64) * 64 if self.architecture == "llama" else 4 * self.hidden

    @property
    def objective(self) -> str:
        """The evaluation protocol of the architecture's objective ("fixed": next-token)."""
        return OBJECTIVES[self.architecture]


def methods_of(config: LoopConfig) -> list[MethodConfig]:
    """The configs of a run's ``--methods`` (one spec)."""
    return one_spec(config.methods)
