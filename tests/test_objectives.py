"""The objectives of T5 (span corruption) and DeBERTa (masked LM) in the evaluation and in `rope-ext train`: T5's
span mask and sentinel format pinned by hand, the scores equal to the models' own losses, the same targets at every
length, the protocol chosen by the model, and small models trained with each objective."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from test_deberta import tiny_deberta
from test_t5 import tiny_t5

import rope_ext
from rope_ext.cli import main
from rope_ext.eval.data import Document
from rope_ext.eval.objectives import (
    corrupt_spans,
    document_generator,
    absolute_table_rows,
    check_target_tokens,
    evaluation_mask,
    mask_collator,
    mask_tokens,
    most_span_tokens,
    model_protocols,
    objective_nll,
    random_spans,
    sentinel_ids,
    span_starts,
    with_objective_tokens,
)
from rope_ext.eval.perplexity import evaluate_document
from rope_ext.runs.models import load_default_tokenizer
from rope_ext.train.data import ObjectiveCollator


@pytest.fixture(scope="module")
def tokenizer():
    """The default tokenizer with a mask token and T5's 100 sentinels (what `rope-ext train` gives a T5 or DeBERTa)."""
    return with_objective_tokens(with_objective_tokens(load_default_tokenizer(), "masked-lm"), "span-corruption")


def _t5(tokenizer, seed=0):
    return tiny_t5(seed=seed, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                   eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)


def _deberta(tokenizer, seed=0):
    return tiny_deberta(seed=seed, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)


def _text_ids(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(100, 20000, (1, count), generator=torch.Generator().manual_seed(seed))


# -- T5's span mask and format


@pytest.mark.parametrize(("length", "noise", "spans"), [(1024, 154, 51), (256, 38, 13), (10, 2, 1), (100, 15, 5)])
def test_random_spans_count_as_t5_rounds(length, noise, spans):
    """round(length x 0.15) noise tokens (banker's rounding, as tf.round), round(noise / 3) spans, computed by hand."""
    for seed in range(5):
        mask = random_spans(length, torch.Generator().manual_seed(seed))
        assert mask.shape == (length,) and int(mask.sum()) == noise
        assert int(span_starts(mask).sum()) == spans
        assert not mask[0] and mask[-1]  # kept tokens first, a span last


def test_random_spans_are_uniform_segmentations():
    """Span lengths average noise / spans (154 / 51); the same generator seed gives the same mask."""
    lengths = []
    for seed in range(200):
        mask = random_spans(1024, torch.Generator().manual_seed(seed))
        starts = span_starts(mask).nonzero()[:, 0]
        ends = (mask & ~torch.cat([mask[1:], mask.new_zeros(1)])).nonzero()[:, 0]
        lengths += (ends - starts + 1).tolist()
    assert min(lengths) >= 1 and abs(sum(lengths) / len(lengths) - 154 / 51) < 1e-9
    assert max(lengths) > 10  # (uniform cuts, not equal spans)
    a, b = (random_spans(300, torch.Generator().manual_seed(3)) for _ in range(2))
    assert torch.equal(a, b)


def test_span_corruption_format_by_hand():
    ids = torch.arange(10, 20)
    noise = torch.tensor([0, 0, 1, 1, 0, 0, 0, 1, 0, 1], dtype=torch.bool)
    encoder, labels = corrupt_spans(ids, noise, [100, 101, 102], eos_token_id=1)
    assert encoder.tolist() == [10, 11, 100, 14, 15, 16, 101, 18, 102, 1]
    assert labels.tolist() == [100, 12, 13, 101, 17, 102, 19, 1]
    with pytest.raises(ValueError, match="3 corrupted spans need 3 sentinel tokens; there are 2"):
        corrupt_spans(ids, noise, [100, 101], eos_token_id=1)


def test_sentinels_by_name_and_a_tokenizer_without_them(tokenizer):
    names = ["<extra_id_0>", "<extra_id_1>", "<extra_id_2>"]
    assert sentinel_ids(tokenizer, 3) == tokenizer.convert_tokens_to_ids(names)
    with pytest.raises(ValueError, match="the tokenizer lacks <extra_id_0>"):
        sentinel_ids(load_default_tokenizer(), 2)
    with pytest.raises(ValueError, match="span corruption needs at least 2 tokens"):
        random_spans(1, torch.Generator())


# -- scores equal to the models' own losses


def test_span_corruption_score_is_t5s_own_loss(tokenizer):
    model = _t5(tokenizer)
    ids = _text_ids(200)
    nll = objective_nll(model, "span-corruption", tokenizer, ids, 64, document_generator("0123456789abcdef"))
    generator = document_generator("0123456789abcdef")
    noise = random_spans(64, generator)
    encoder, labels = corrupt_spans(ids[0, -64:], noise, sentinel_ids(tokenizer, 100), tokenizer.eos_token_id)
    with torch.no_grad():
        loss = model(input_ids=torch.cat([ids[0, :-64], encoder])[None], labels=labels[None]).loss
    assert nll.numel() == labels.numel() == 10 + 3 + 1  # 10 tokens in 3 spans, 3 sentinels, EOS
    torch.testing.assert_close(nll.mean(), loss, rtol=1e-6, atol=1e-6)


def test_masked_lm_score_is_debertas_own_loss_and_masks_only_the_targets(tokenizer):
    model = _deberta(tokenizer)
    ids = _text_ids(300)
    nll = objective_nll(model, "masked-lm", tokenizer, ids, 200, document_generator("00000000000000ff"))
    masked, labels = evaluation_mask(ids[0, 100:], tokenizer, document_generator("00000000000000ff"))
    masked, labels = torch.cat([ids[0, :100], masked]), torch.cat([torch.full((100,), -100), labels])
    chosen = labels != -100
    assert not chosen[:100].any() and chosen.sum() == nll.numel() == 30  # round(0.15 x 200)
    assert (masked[chosen] == tokenizer.mask_token_id).all() and torch.equal(masked[~chosen], ids[0, ~chosen])
    with torch.no_grad():
        out = model(input_ids=masked[None], labels=labels[None])
    torch.testing.assert_close(nll.mean(), out.loss, rtol=1e-6, atol=1e-6)
    # (the head applied to the masked positions only gives what the whole logits give there)
    whole = torch.nn.functional.cross_entropy(out.logits[0, chosen], ids[0, chosen], reduction="none")
    torch.testing.assert_close(nll, whole, rtol=1e-5, atol=1e-5)


def test_the_evaluation_masks_a_fixed_count_never_a_special_token(tokenizer):
    ids = _text_ids(40)[0]
    ids[::2] = tokenizer.eos_token_id  # (20 special tokens: never masked)
    for seed in range(20):
        masked, labels = evaluation_mask(ids, tokenizer, torch.Generator().manual_seed(seed))
        chosen = labels != -100
        assert chosen.sum() == 3 and not chosen[::2].any()  # round(0.15 x 20)
    one = evaluation_mask(_text_ids(2)[0], tokenizer, torch.Generator())[1]
    assert (one != -100).sum() == 1  # (at least one)


def test_training_masks_fifteen_percent_with_berts_split():
    """BERT's rate: of 4,096 tokens, 614 expected (sd 23; 0.2 would give 819), 80% of them [MASK]."""
    tokenizer = with_objective_tokens(load_default_tokenizer(), "masked-lm")
    ids = _text_ids(4096)[0]
    for seed in range(4):
        masked, labels = mask_tokens(mask_collator(tokenizer), ids, torch.Generator().manual_seed(seed))
        chosen = labels != -100
        assert 614 - 80 < int(chosen.sum()) < 614 + 80
        share = float((masked[chosen] == tokenizer.mask_token_id).float().mean())
        assert 0.72 < share < 0.88, share


@pytest.mark.parametrize(("options", "message"), [
    ({"architecture": "deberta", "sequence_length": 3}, "--sequence-length 3: DeBERTa's log buckets"),
    ({"architecture": "t5", "sequence_length": 2010}, "--sequence-length 2010: span corruption of 2010 tokens makes 101 spans"),
    ({"architecture": "t5", "eval_document": "x", "eval_target_tokens": 1, "sequence_length": 64},
     "--eval-target-tokens 1: span corruption needs at least 2 tokens"),
])
def test_a_run_its_objective_cannot_train_or_evaluate_is_refused_before_it_starts(options, message):
    from rope_ext.train.config import TrainConfig

    with pytest.raises(ValueError, match=message):
        TrainConfig(**options).check()


def test_target_sizes_the_objectives_cannot_corrupt_are_refused():
    assert most_span_tokens() == 2009  # 2,009 tokens: 301 noise tokens in 100 spans; 2,010: 302 in 101
    check_target_tokens("span-corruption", 2009)
    with pytest.raises(ValueError, match="--target-tokens 2010: span corruption of 2010 tokens makes 101 spans, and T5 "
                                         "marks each with one of its 100 sentinels; give at most 2009"):
        check_target_tokens("span-corruption", 2010)
    with pytest.raises(ValueError, match="--window 1: span corruption needs at least 2 tokens"):
        check_target_tokens("span-corruption", 1, "--window")
    check_target_tokens("masked-lm", 1)


# -- the fixed-target protocols


def test_t5_targets_are_the_same_at_every_length_and_an_unused_extension_changes_nothing(tokenizer):
    model = _t5(tokenizer)
    document = Document("doc", _text_ids(400, seed=4))
    lengths = [96, 192, 384]

    def records():
        return list(evaluate_document(model, document, lengths, protocol="span-corruption", target_tokens=64,
                                      tokenizer=tokenizer))

    plain = records()
    assert {(r.start, r.end, r.tokens_scored) for r in plain} == {(320, 384, plain[0].tokens_scored)}
    assert len({r.mean_nll for r in plain}) == 3  # (more context: another score)
    with rope_ext.patched(model, "t5_bucket_extend", factor=4):  # new rows copy the last: bit-identical
        assert [r.mean_nll for r in records()] == [r.mean_nll for r in plain]
    with rope_ext.patched(model, "t5_bucket_scale", factor=4):
        scaled = records()
    assert scaled[-1].mean_nll != plain[-1].mean_nll
    assert records()[-1].mean_nll == plain[-1].mean_nll  # (unpatched again)


def test_deberta_targets_are_the_same_at_every_length(tokenizer):
    model = _deberta(tokenizer)
    document = Document("doc", _text_ids(300, seed=5))
    plain = list(evaluate_document(model, document, [80, 160, 240], protocol="masked-lm", target_tokens=64,
                                   tokenizer=tokenizer))
    assert {(r.start, r.end, r.tokens_scored) for r in plain} == {(176, 240, plain[0].tokens_scored)}
    with rope_ext.patched(model, "deberta_bucket_stretch", factor=4):
        stretched = list(evaluate_document(model, document, [80, 160, 240], protocol="masked-lm", target_tokens=64,
                                           tokenizer=tokenizer))
    assert stretched[-1].mean_nll != plain[-1].mean_nll


def test_the_protocol_follows_the_model():
    from test_xlnet import tiny_xlnet
    from tiny import tiny_model

    assert model_protocols(tiny_t5()) == ("span-corruption",)
    assert model_protocols(tiny_deberta()) == ("masked-lm",)
    assert model_protocols(tiny_model("llama")) == ("fixed", "curve", "sliding")
    with pytest.raises(ValueError, match="XLNet's permutation objective is not among them"):
        model_protocols(tiny_xlnet())
    from transformers import BartConfig, BartForConditionalGeneration

    bart = BartForConditionalGeneration(BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                                   encoder_attention_heads=2, decoder_attention_heads=2,
                                                   encoder_ffn_dim=16, decoder_ffn_dim=16))
    with pytest.raises(ValueError, match="a BartForConditionalGeneration is an encoder-decoder whose objective is not "
                                         "T5's span corruption"):
        model_protocols(bart)


def test_the_library_refuses_a_protocol_the_model_does_not_have(tokenizer):
    document = Document("doc", _text_ids(200))
    deberta, t5 = _deberta(tokenizer), _t5(tokenizer)
    for model, protocol in ((deberta, "curve"), (deberta, "fixed"), (t5, "masked-lm")):
        with pytest.raises(ValueError, match=rf"a {type(model).__name__} is evaluated with protocol"):
            list(evaluate_document(model, document, [64, 128], protocol=protocol, target_tokens=32,
                                   tokenizer=tokenizer))
    with pytest.raises(ValueError, match=r"give the ids of one sequence, \[1, L\]; got shape \(2, 100\)"):
        objective_nll(_t5(tokenizer), "span-corruption", tokenizer, _text_ids(200).view(2, 100), 32, torch.Generator())


def test_a_masked_lm_with_an_absolute_table_is_refused_past_it(tmp_path, capsys):
    from transformers import BertConfig, BertForMaskedLM

    tokenizer = with_objective_tokens(load_default_tokenizer(), "masked-lm")
    bert = BertForMaskedLM(BertConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=16, max_position_embeddings=64))
    assert absolute_table_rows(bert) == 64 and absolute_table_rows(tiny_deberta()) is None
    bert.save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    text = tmp_path / "a.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 60)
    code = main(["eval", "ppl", "--model", str(tmp_path / "bert"), "--methods", "none", "--text-files", str(text),
                 "--lengths", "64", "--target-tokens", "16", "--out", str(tmp_path / "ok"), "--no-plot"])
    assert code == 0, capsys.readouterr().err
    code = main(["eval", "ppl", "--model", str(tmp_path / "bert"), "--methods", "none", "--text-files", str(text),
                 "--lengths", "65", "--target-tokens", "16", "--out", str(tmp_path / "bad"), "--no-plot"])
    assert code == 2
    assert ("--lengths 65: this BertForMaskedLM adds an absolute position table of 64 rows, which ends there; "
            "evaluate lengths up to 64") in capsys.readouterr().err
    tokenizer.add_special_tokens({"cls_token": "[CLS]", "sep_token": "[SEP]"})  # (framed: two rows fewer)
    tokenizer.save_pretrained(tmp_path / "bert")
    code = main(["eval", "ppl", "--model", str(tmp_path / "bert"), "--methods", "none", "--text-files", str(text),
                 "--lengths", "63", "--target-tokens", "16", "--out", str(tmp_path / "bad2"), "--no-plot"])
    assert code == 2
    assert "table of 64 rows, which ends there ([CLS] and [SEP] included); evaluate lengths up to 62" in (
        capsys.readouterr().err)


def test_the_cli_protocol_choices_are_the_evaluations():
    from rope_ext.eval.plan import FIXED_TARGETS as _FIXED_TARGETS, PROTOCOLS as _PROTOCOLS
    from rope_ext.eval.objectives import FIXED_TARGET_PROTOCOLS
    from rope_ext.eval.perplexity import PROTOCOLS

    assert _PROTOCOLS == PROTOCOLS
    assert _FIXED_TARGETS == (None, *FIXED_TARGET_PROTOCOLS)


@pytest.mark.parametrize(
    ("model", "evaluation", "protocol", "message"),
    [
        ("t5", "ppl", "fixed", "--protocol fixed: a T5ForConditionalGeneration is evaluated with --protocol "
                               "span-corruption"),
        ("deberta", "ppl", "span-corruption", "--protocol span-corruption: a DebertaV2ForMaskedLM is evaluated with "
                                              "--protocol masked-lm"),
        ("llama", "ppl", "masked-lm", "--protocol masked-lm: a LlamaForCausalLM is evaluated with --protocol fixed or "
                                      "curve or sliding"),
        ("t5", "passkey", None, "--model 'm' is a T5ForConditionalGeneration, not a causal language model: passkey "
                                "retrieval generates the key; evaluate it with rope-ext eval ppl --protocol "
                                "span-corruption"),
        ("xlnet", "ppl", None, "--model 'm': a XLNetLMHeadModel is neither a causal LM"),
    ],
)
def test_a_protocol_the_model_does_not_have_is_refused(model, evaluation, protocol, message):
    from test_xlnet import tiny_xlnet
    from tiny import tiny_model

    from rope_ext.eval.plan import check_protocol as _check_protocol

    built = {"t5": tiny_t5, "deberta": tiny_deberta, "llama": lambda: tiny_model("llama"), "xlnet": tiny_xlnet}[model]()
    args = argparse.Namespace(model="m", evaluation=evaluation, protocol=protocol)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _check_protocol(args, built, None)


# -- training with the objectives


def test_objective_batches_depend_on_the_window_not_the_batch(tokenizer):
    windows = _text_ids(4 * 64).view(4, 64)
    for protocol in ("masked-lm", "span-corruption"):
        collate = ObjectiveCollator(protocol, tokenizer, seed=3)
        whole = collate([{"input_ids": windows[i], "index": i} for i in range(4)])
        alone = collate([{"input_ids": windows[2], "index": 2}])
        assert torch.equal(whole["input_ids"][2], alone["input_ids"][0])
        assert torch.equal(whole["labels"][2], alone["labels"][0])
        collate.set_epoch(1)
        assert not torch.equal(collate([{"input_ids": windows[2], "index": 2}])["labels"][0], alone["labels"][0])
    # span corruption: putting each span back at its sentinel gives the window again
    encoder, labels = alone["input_ids"][0].tolist(), alone["labels"][0].tolist()
    sentinels = set(sentinel_ids(tokenizer, 100))
    spans, current = {}, None
    for token in labels[:-1]:
        if token in sentinels:
            current = token
            spans[current] = []
        else:
            spans[current].append(token)
    rebuilt = [t for token in encoder[:-1] for t in (spans[token] if token in sentinels else [token])]
    assert rebuilt == windows[2].tolist()


@pytest.mark.parametrize(("architecture", "methods", "protocol"),
                         [("t5", "none", "span-corruption"), ("deberta", "none", "masked-lm"),
                          ("t5", "t5_bucket_extend:factor=2", "span-corruption")])
def test_training_with_the_objective_and_evaluating_the_folder(texts, tmp_path, capsys, architecture, methods,
                                                               protocol):
    from rope_ext.train.config import TrainConfig
    from rope_ext.train.pretrain import train

    config = TrainConfig(architecture=architecture, methods=methods, text_files=[str(texts / "one.txt"),
                         str(texts / "two.txt")], eval_document="two.txt", eval_target_tokens=32, sequence_length=64, hidden=32,
                         layers=1, heads=2, micro_batch=4, max_steps=6, lr=3e-3, warmup_steps=1, save_every=3,
                         out=str(tmp_path / "run"))
    config.check()
    run = train(config)
    losses = [row["loss"] for row in json.loads((tmp_path / "run" / "loss.json").read_text())["log"]]
    assert len(losses) == 6 and losses[-1] < losses[0]
    restored = rope_ext.from_pretrained(tmp_path / "run")
    ids = _text_ids(100)
    with torch.no_grad():
        extra = {"decoder_input_ids": _text_ids(9, seed=2)} if architecture == "t5" else {}
        same = restored(input_ids=ids, **extra).logits, run.model(input_ids=ids, **extra).logits
    torch.testing.assert_close(*same, rtol=0, atol=0)
    capsys.readouterr()
    code = main(["eval", "ppl", "--model", str(tmp_path / "run"), "--methods", "none", "--text-files",
                 str(texts / "one.txt"), "--lengths", "64,128", "--target-tokens", "32", "--out", str(tmp_path / "ev"),
                 "--no-plot"])
    assert code == 0, capsys.readouterr().err
    assert f"perplexity ({protocol} protocol" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "ev" / "ppl_records.jsonl").read_text().splitlines()]
    assert {r["protocol"] for r in rows} == {protocol} and len({(r["start"], r["end"]) for r in rows}) == 1
    # (the same held-out value as the run's own evaluation at its window)
    last = json.loads((tmp_path / "run" / "train.json").read_text())["evals"][-1]
    code = main(["eval", "ppl", "--model", str(tmp_path / "run"), "--methods", "saved" if methods != "none" else "none",
                 "--text-files", str(texts / "two.txt"), "--lengths", "64", "--target-tokens", "32", "--out",
                 str(tmp_path / "ev2"), "--no-plot"])
    assert code == 0
    again = json.loads((tmp_path / "ev2" / "ppl_records.jsonl").read_text().splitlines()[0])
    assert again["perplexity"] == pytest.approx(last["perplexity"], rel=1e-12)
    # fine-tuning trains next tokens: refused for these
    code = main(["finetune", "--model", str(tmp_path / "run"), "--methods", "none", "--text-files",
                 str(texts / "one.txt"), "--window", "32", "--target-length", "64", "--max-steps", "1", "--out",
                 str(tmp_path / "ft")])
    assert code == 2
    assert "not a causal language model: rope-ext finetune trains next-token prediction" in capsys.readouterr().err
    assert not (tmp_path / "ft").exists()
