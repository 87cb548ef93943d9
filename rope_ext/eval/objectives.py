"""The objectives of the models that are not causal LMs, for evaluation and training: masked LM (DeBERTa, BERT-style
encoders) and span corruption (T5, mT5, UMT5).

* ``masked-lm`` -- a fraction ``MASK_PROBABILITY`` of the tokens is chosen and predicted from both sides: in
  training each token with that probability, 80% of them ``[MASK]``, 10% a random token, 10% kept (transformers'
  ``DataCollatorForLanguageModeling``); in evaluation that fraction exactly, every one ``[MASK]``, the sequence framed
  by ``[CLS]`` / ``[SEP]`` where the tokenizer has them.
* ``span-corruption`` -- T5's objective (Raffel et al. 2020, ``random_spans_noise_mask`` of the T5 code): a fraction
  ``NOISE_DENSITY`` of the tokens, in spans of mean length ``MEAN_SPAN``, each span replaced by one sentinel
  (``<extra_id_k>``) in the encoder input; the decoder predicts ``<extra_id_0> span_0 <extra_id_1> span_1 ... </s>``.

The evaluation protocols of the same names are the fixed-target protocol of ``rope_ext.eval.perplexity`` for these
objectives: the same tokens corrupted (the same masked positions, the same spans) in the last ``target_tokens`` tokens
before the longest length, drawn once per document from its fingerprint, and scored with more and more uncorrupted
context in front of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: the next-token protocols of a causal LM
CAUSAL_PROTOCOLS = ("fixed", "curve", "sliding")
#: the protocols of the objectives that are not next-token prediction: masked tokens, T5's corrupted spans
OBJECTIVE_PROTOCOLS = ("masked-lm", "span-corruption")
#: protocols that score the same targets at every length (the last ``target_tokens`` before the longest length)
FIXED_TARGET_PROTOCOLS = ("fixed", *OBJECTIVE_PROTOCOLS)
#: the encoder-decoders trained with span corruption
T5_TYPES = ("t5", "mt5", "umt5")
#: BERT's and DeBERTa's masking rate
MASK_PROBABILITY = 0.15
#: T5's span corruption: the fraction of tokens corrupted and the mean span length
NOISE_DENSITY = 0.15
MEAN_SPAN = 3.0
#: how many sentinels T5's tokenizers have (``<extra_id_0>`` .. ``<extra_id_99>``)
SENTINELS = 100


def model_protocols(model: nn.Module) -> tuple[str, ...]:
    """The evaluation protocols a model's objective gives: an encoder-decoder (T5) ``span-corruption``, a masked-LM
    head ``masked-lm``, a causal LM the next-token protocols. Anything else (XLNet's permutation LM, a classifier) is
    refused by name."""
    config = model.config
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        if getattr(config, "model_type", None) not in T5_TYPES:
            raise ValueError(f"a {name} is an encoder-decoder whose objective is not T5's span corruption (the "
                             f"one rope-ext eval scores for encoder-decoders: {', '.join(T5_TYPES)})")
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise ValueError(f"a {name} has no language-model head: span corruption needs one (load it with "
                             "AutoModelForSeq2SeqLM)")
        return ("span-corruption",)
    if name.endswith("ForMaskedLM"):
        return ("masked-lm",)
    from rope_ext.families import find_family

    try:
        causal = find_family(model).causal
    except ValueError:  # (no family of rope_ext's: evaluated unpatched, as a causal LM if it is one)
        causal = True
    if causal and getattr(model, "can_generate", lambda: True)():
        return CAUSAL_PROTOCOLS
    raise ValueError(
        f"a {name} is neither a causal LM, a masked LM nor an encoder-decoder with a language-model head: rope-ext "
        "eval scores next tokens (causal LMs), masked tokens (...ForMaskedLM) or T5's corrupted spans "
        "(...ForConditionalGeneration); XLNet's permutation objective is not among them"
    )


def document_generator(fingerprint: str) -> torch.Generator:
    """The generator that draws a document's corruption: seeded by its fingerprint, so every run, length and method
    corrupts the same tokens."""
    return torch.Generator().manual_seed(int(fingerprint[:15], 16))


# -- span corruption


def _segmentation(items: int, segments: int, generator: torch.Generator) -> torch.Tensor:
    """``segments`` positive lengths summing to ``items``, uniformly over the ways to cut (T5's
    ``_random_segmentation``)."""
    first = torch.zeros(items, dtype=torch.long)
    cuts = torch.randperm(items - 1, generator=generator)[: segments - 1] + 1
    first[cuts] = 1
    first[0] = 1
    return torch.bincount(torch.cumsum(first, 0) - 1, minlength=segments)


def span_counts(length: int, density: float = NOISE_DENSITY, mean_span: float = MEAN_SPAN) -> tuple[int, int]:
    """``(noise tokens, spans)`` of T5's span corruption of ``length`` tokens: ``round(length x density)`` (at least
    one, at most ``length - 1``) in ``round(noise / mean_span)`` spans (at least one, at most the kept tokens)."""
    noise = min(max(round(length * density), 1), length - 1)
    return noise, min(max(round(noise / mean_span), 1), length - noise)


def most_span_tokens(sentinels: int = SENTINELS) -> int:
    """The longest sequence whose span corruption needs at most ``sentinels`` sentinels."""
    low, high = 2, 2
    while span_counts(high * 2)[1] <= sentinels:
        high *= 2
    high *= 2  # span_counts(high)[1] > sentinels >= span_counts(low)[1]
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if span_counts(middle)[1] <= sentinels else (low, middle)
    return low


def check_target_tokens(protocol: str, tokens: int, option: str = "--target-tokens") -> None:
    """Refuse a number of target tokens ``protocol`` cannot corrupt: span corruption needs at least 2, and at most
    as many as T5's 100 sentinels can mark (``most_span_tokens``); masked LM masks at least one of any."""
    if protocol != "span-corruption":
        return
    if tokens < 2:
        raise ValueError(f"{option} {tokens}: span corruption needs at least 2 tokens (a kept one and a span)")
    most = most_span_tokens()
    if tokens > most:
        raise ValueError(
            f"{option} {tokens}: span corruption of {tokens} tokens makes {span_counts(tokens)[1]} spans, and T5 "
            f"marks each with one of its {SENTINELS} sentinels; give at most {most}"
        )


def random_spans(
    length: int, generator: torch.Generator, density: float = NOISE_DENSITY, mean_span: float = MEAN_SPAN
) -> torch.Tensor:
    """T5's ``random_spans_noise_mask``: a ``[length]`` bool mask, ``round(length * density)`` tokens (at least one,
    at most ``length - 1``) in ``round(noise / mean_span)`` spans (at least one); the sequence starts with kept tokens
    and ends in a span, spans and kept runs alternating, their lengths uniform random segmentations."""
    if length < 2:
        raise ValueError(f"span corruption needs at least 2 tokens, got {length}")
    if not 0 < density < 1:
        raise ValueError(f"noise density must be in (0, 1), got {density}")
    if mean_span < 1:
        raise ValueError(f"mean span length must be at least 1, got {mean_span}")
    noise, spans = span_counts(length, density, mean_span)
    kept = length - noise
    noise_lengths = _segmentation(noise, spans, generator)
    kept_lengths = _segmentation(kept, spans, generator)
    runs = torch.stack([kept_lengths, noise_lengths], 1).reshape(-1)
    is_noise = torch.arange(2 * spans) % 2 == 1
    return torch.repeat_interleave(is_noise, runs)


def sentinel_ids(tokenizer: Any, count: int) -> list[int]:
    """The ids of ``<extra_id_0>`` .. ``<extra_id_{count-1}>`` (T5's sentinels), refused when the tokenizer lacks
    them."""
    ids = tokenizer.convert_tokens_to_ids([f"<extra_id_{k}>" for k in range(count)])
    unknown = tokenizer.unk_token_id
    missing = [k for k, i in enumerate(ids) if i is None or (unknown is not None and i == unknown)]
    if missing:
        raise ValueError(
            f"span corruption needs {count} sentinel tokens <extra_id_0> .. <extra_id_{count - 1}>; the tokenizer "
            f"lacks <extra_id_{missing[0]}> (T5's tokenizers have 100; add them with tokenizer.add_special_tokens)"
        )
    return ids


def with_objective_tokens(tokenizer: Any, protocol: str) -> Any:
    """``tokenizer`` given what ``protocol`` needs and lacks (for a model trained here on another model's tokenizer):
    a ``<mask>`` token for masked LM, T5's 100 sentinels for span corruption; its new tokens get the next ids."""
    if protocol == "masked-lm" and tokenizer.mask_token is None:
        tokenizer.add_special_tokens({"mask_token": "<mask>"})
    if protocol == "span-corruption":
        wanted = [f"<extra_id_{k}>" for k in range(SENTINELS)]
        missing = [token for token in wanted if token not in tokenizer.get_vocab()]
        if missing:
            tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
    return tokenizer


def corrupt_spans(
    ids: torch.Tensor, noise: torch.Tensor, sentinels: list[int], eos_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(encoder input, labels)`` of one sequence ``ids [n]`` under the span mask ``noise [n]``: each span replaced by
    its sentinel in the input, the labels each sentinel followed by its span; both end with EOS."""
    starts = span_starts(noise)
    count = int(starts.sum())
    if count > len(sentinels):
        raise ValueError(f"{count} corrupted spans need {count} sentinel tokens; there are {len(sentinels)}")
    marks = torch.tensor(sentinels[:count], dtype=ids.dtype)
    encoder = ids.clone()
    encoder[starts] = marks
    encoder = encoder[~noise | starts]
    # the labels in order: each sentinel just before its span's first token (at that position - 1/2)
    where = torch.arange(ids.numel(), dtype=torch.float64)
    order = torch.argsort(torch.cat([where[starts] - 0.5, where[noise]]))
    labels = torch.cat([marks, ids[noise]])[order]
    eos = torch.tensor([eos_token_id], dtype=ids.dtype)
    return torch.cat([encoder, eos]), torch.cat([labels, eos])


def span_starts(noise: torch.Tensor) -> torch.Tensor:
    """Where each span of the mask ``noise [n]`` begins."""
    return noise & ~torch.cat([noise.new_zeros(1), noise[:-1]])


# -- masked LM


def mask_collator(tokenizer: Any, probability: float = MASK_PROBABILITY) -> Any:
    """transformers' masked-LM collator with BERT's 80/10/10 (training)."""
    from transformers import DataCollatorForLanguageModeling

    if tokenizer.mask_token is None:
        raise ValueError("masked-LM needs a tokenizer with a mask token; this one has none")
    return DataCollatorForLanguageModeling(tokenizer, mlm_probability=probability)


def mask_tokens(collator: Any, ids: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input, labels)`` of ``ids [n]`` masked by ``collator`` (``mask_collator``) drawing from ``generator``: any
    token that is not a special token may be chosen; labels -100 where not chosen. The draws depend on ``n``: mask a
    fixed region alone to mask it alike whatever surrounds it."""
    special = torch.tensor(collator.tokenizer.all_special_ids, dtype=ids.dtype)
    never = torch.isin(ids, special)
    collator.generator = generator
    try:
        masked, labels = collator.torch_mask_tokens(ids[None].clone(), special_tokens_mask=never[None])
    finally:
        collator.generator = None
    return masked[0], labels[0]


def evaluation_mask(
    ids: torch.Tensor, tokenizer: Any, generator: torch.Generator, probability: float = MASK_PROBABILITY
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input, labels)`` of ``ids [n]`` for the masked-LM evaluation: ``max(1, round(probability x m))`` of its
    ``m`` tokens that are not special tokens, drawn without replacement, all replaced by the mask token (a fixed
    count, unlike training's per-token draws: every document scores some); labels -100 elsewhere."""
    if tokenizer.mask_token_id is None:
        raise ValueError("masked-LM needs a tokenizer with a mask token; this one has none")
    special = torch.tensor(tokenizer.all_special_ids, dtype=ids.dtype)
    candidates = (~torch.isin(ids, special)).nonzero()[:, 0]
    if candidates.numel() == 0:
        raise ValueError("the tokens to mask are all special tokens")
    count = max(1, round(probability * candidates.numel()))
    chosen = candidates[torch.randperm(candidates.numel(), generator=generator)[:count]]
    masked, labels = ids.clone(), torch.full_like(ids, -100)
    masked[chosen] = tokenizer.mask_token_id
    labels[chosen] = ids[chosen]
    return masked, labels


# -- scoring


@contextlib.contextmanager
def _head_on(model: nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """The masked-LM head applied to ``positions`` only (not ``L x vocab`` logits): a pre-hook on the head module (the
    model's child that is not its base model) that selects them from the hidden states it is given."""
    base = getattr(model, model.base_model_prefix, None)
    heads = [module for module in model.children() if module is not base]
    if len(heads) != 1:
        yield
        return

    def select(module: nn.Module, args: tuple) -> tuple:
        return (args[0][:, positions], *args[1:])

    handle = heads[0].register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def objective_nll(
    model: nn.Module, protocol: str, tokenizer: Any, ids: torch.Tensor, target_tokens: int, generator: torch.Generator
) -> torch.Tensor:
    """Per-token NLL of ``protocol``'s targets in the last ``target_tokens`` tokens of ``ids [1, L]``, corrupted as
    ``generator`` draws (give a fresh generator of the same seed at every length: the same targets), the tokens
    before them the uncorrupted context. Masked LM: the NLL of each masked token; span corruption: of every label
    token (sentinels, span tokens, the final EOS), as T5's loss."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"give the ids of one sequence, [1, L]; got shape {tuple(ids.shape)}")
    length = ids.shape[-1]
    if not 0 < target_tokens < length:
        raise ValueError(f"target_tokens must be in [1, {length - 1}], got {target_tokens}")
    check_target_tokens(protocol, target_tokens, "target_tokens")
    device = next(model.parameters()).device
    row = ids[0]
    context, scored = row[: length - target_tokens], row[length - target_tokens :]
    if protocol == "masked-lm":
        masked, labels = evaluation_mask(scored, tokenizer, generator)
        # (the [CLS] ... [SEP] a BERT-style tokenizer frames every sequence with, where it has them)
        first, last = framing(tokenizer)
        masked = torch.cat([first, context, masked, last])
        labels = torch.cat([torch.full((first.numel() + context.numel(),), -100), labels, torch.full_like(last, -100)])
        positions = (labels != -100).nonzero()[:, 0]
        with _head_on(model, positions.to(device)):
            logits = model(input_ids=masked[None].to(device)).logits[0]
        if logits.shape[0] == masked.numel():  # (a head the pre-hook could not find: every position was computed)
            logits = logits[positions.to(device)]
        return F.cross_entropy(logits.float(), labels[positions].to(device), reduction="none").cpu()
    if protocol == "span-corruption":
        noise = random_spans(target_tokens, generator)
        starts = int(span_starts(noise).sum())
        encoder, labels = corrupt_spans(scored, noise, sentinel_ids(tokenizer, starts), _eos(model, tokenizer))
        encoder = torch.cat([context, encoder])
        logits = model(input_ids=encoder[None].to(device), labels=labels[None].to(device), use_cache=False).logits[0]
        return F.cross_entropy(logits.float(), labels.to(device), reduction="none").cpu()
    raise ValueError(f"unknown objective protocol {protocol!r}; valid: {', '.join(OBJECTIVE_PROTOCOLS)}")


def framing(tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``([CLS], [SEP])`` where the tokenizer has both (a pretrained BERT or DeBERTa saw them around every
    sequence), else empty."""
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    if cls is None or sep is None:
        return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    return torch.tensor([cls]), torch.tensor([sep])


def absolute_table_rows(model: nn.Module) -> int | None:
    """The rows of a masked LM's absolute position table (BERT's, DeBERTa's with ``position_biased_input``): the most
    positions it runs; ``None`` without one."""
    for name, module in model.named_modules():
        if name.endswith("position_embeddings") and isinstance(module, nn.Embedding):
            return module.num_embeddings
    return None


def _eos(model: nn.Module, tokenizer: Any) -> int:
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
    if eos is None:
        raise ValueError("span corruption ends its input and labels with EOS; neither the tokenizer nor the model "
                         "config has one")
    return int(eos)
