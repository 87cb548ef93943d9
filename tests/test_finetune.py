"""``rope-ext finetune`` / ``rope-ext merge`` on a tiny Llama (seconds each): training, saving and reloading, exact
resume, merging, PoSE batches, two processes against one, the launch configurations, and every bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import rope_ext
from rope_ext.cli import main
from rope_ext.train.config import FinetuneConfig, read_yaml
from rope_ext.train.data import Collator, WindowDataset, training_windows
from rope_ext.runs.models import load_finetune_base
from rope_ext.train.finetune import finetune
from tiny import tiny_model

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["alpha", "beta", "gamma", "delta", "the", "pass", "key", "is", "."] + [str(d) for d in range(10)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama (native context 64) with a word-level tokenizer, and three text files of 600 words."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    root = tmp_path_factory.mktemp("finetune")
    torch.manual_seed(0)
    tiny_model("llama").save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    rng = random.Random(0)
    files = []
    for i in range(3):  # a repetitive grammar the model can learn in a few steps
        path = root / f"doc{i}.txt"
        path.write_text(" ".join(" ".join(WORDS[(j + rng.randrange(2)) % 8] for j in range(4)) for _ in range(150)))
        files.append(str(path))
    return root / "model", files


def _config(checkpoint, out, **options) -> FinetuneConfig:
    model, files = checkpoint
    values = dict(model=str(model), text_files=files[:2], methods="yarn:factor=4", sequence_length=32, target_length=128,
                  max_steps=6, save_every=0, micro_batch=2, lora_dropout=0.0, lr=1e-3, warmup_steps=0, out=str(out))
    values.update(options)
    config = FinetuneConfig(**values)
    config.check()
    return config


def _ids(n=96, batch=1):
    return torch.randint(4, 4 + len(WORDS), (batch, n), generator=torch.Generator().manual_seed(1))


def _training_on_pose_batch(methods: str, n: int):
    """A tiny Llama patched with ``methods`` in training mode, and a PoSE batch of two ``n``-token windows."""
    model = tiny_model("llama")
    batch = Collator(target=256, pose=True, seed=0)([{"input_ids": row, "index": i} for i, row in enumerate(_ids(n, 2))])
    rope_ext.patch(model, methods)
    return model.train(), batch


def _loss_and_grads(model, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


# --- the loop ----------------------------------------------------------------------------------------------


def test_loss_decreases_and_the_folder_loads_with_plain_peft(checkpoint, tmp_path):
    from peft import PeftModel

    config = _config(checkpoint, tmp_path / "run", max_steps=12, lr=3e-3, pose=True, trainable=["embeddings", "norms"],
                     save_every=12)
    run = finetune(config)
    losses = [row["loss"] for row in json.loads((tmp_path / "run" / "loss.json").read_text())["log"]]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3]) - 0.3
    names = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "config.json", "finetune.json", "finetune_config.json",
            "loss.json", "loss.csv", "loss.png", "tokenizer.json"} <= names
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["checkpoint_12"]  # (the last step's)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["rope_ext"]["methods"][0]["method"] == "yarn"
    assert saved["rope_parameters"]["rope_type"] == "yarn"  # native where transformers has the method
    adapter = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert set(adapter["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert set(adapter["modules_to_save"]) == {"embed_tokens", "input_layernorm", "post_attention_layernorm", "norm"}
    record = run.record
    assert record["steps"] == 12 and record["pose"] and record["parameters"]["trainable"] > 0

    ids = _ids()
    trained = run.model.eval().cpu()  # (trained on an accelerator where there is one; the reload is on the CPU)
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        base = load_finetune_base(tmp_path / "run")
        assert isinstance(rope_ext.get_patch(base), rope_ext.methods.YarnConfig)
        reloaded = PeftModel.from_pretrained(base, str(tmp_path / "run")).eval()
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=0, atol=1e-6)


def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(checkpoint, tmp_path):
    options = dict(max_steps=7, save_every=2, accumulation=2, micro_batch=1, pose=True, lora_dropout=0.1,
                   schedule="cosine", warmup_steps=2)
    finetune(_config(checkpoint, tmp_path / "whole", **options))

    def kill_after_five(progress):
        if progress.step == 5:  # checkpoint 4 is on disk; step 5's work is lost, as in a killed process
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        finetune(_config(checkpoint, tmp_path / "cut", **options), on_step=kill_after_five)
    assert (tmp_path / "cut" / "checkpoints").is_dir() and not (tmp_path / "cut" / "adapter_model.safetensors").exists()
    (tmp_path / "cut" / "checkpoints" / "checkpoint_6").mkdir()  # killed while writing the next checkpoint
    finetune(_config(checkpoint, tmp_path / "cut", **options))  # the same command again
    whole = load_file(tmp_path / "whole" / "adapter_model.safetensors")
    resumed = load_file(tmp_path / "cut" / "adapter_model.safetensors")
    assert whole.keys() == resumed.keys()
    for key in whole:
        assert torch.equal(whole[key], resumed[key]), key
    logs = [json.loads((tmp_path / f / "loss.json").read_text())["log"] for f in ("whole", "cut")]
    assert [(r["step"], r["loss"], r["lr"]) for r in logs[0]] == [(r["step"], r["loss"], r["lr"]) for r in logs[1]]


def test_a_larger_max_steps_continues_a_complete_run_to_the_weights_of_a_longer_one(checkpoint, tmp_path, capsys):
    options = dict(save_every=3, lora_dropout=0.1, pose=True, warmup_steps=2)
    finetune(_config(checkpoint, tmp_path / "long", max_steps=6, **options))
    finetune(_config(checkpoint, tmp_path / "grown", max_steps=4, **options))
    again = finetune(_config(checkpoint, tmp_path / "grown", max_steps=4, **options))  # complete: nothing to do
    assert again.model is None and again.record["steps"] == 4 and "this run is complete" in capsys.readouterr().out
    finetune(_config(checkpoint, tmp_path / "grown", max_steps=6, **options))
    long, grown = (load_file(tmp_path / f / "adapter_model.safetensors") for f in ("long", "grown"))
    for key in long:
        assert torch.equal(long[key], grown[key]), key
    with pytest.raises(ValueError, match=r"is at step 6 already; give a larger --max-steps"):
        finetune(_config(checkpoint, tmp_path / "grown", max_steps=5, **options))
    finetune(_config(checkpoint, tmp_path / "none", max_steps=2, save_every=0))
    with pytest.raises(ValueError, match=r"finished at step 2 and kept no checkpoint \(--save-every 0"):
        finetune(_config(checkpoint, tmp_path / "none", max_steps=3, save_every=0))


def test_merge_with_a_target_writes_the_engine_s_folder_of_the_trained_model(checkpoint, tmp_path, capsys):
    """``rope-ext merge FT OUT --target vllm``: the adapter merged and vLLM's keys written in one go; plain
    transformers loads OUT as the adapter-applied model. A plain merge of a patch that plain transformers cannot serve
    (yarn+dca) says so."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    finetune(_config(checkpoint, tmp_path / "run", max_steps=3))
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "run"), str(tmp_path / "served"), "--target", "vllm"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("vllm: exact:") and f"vllm serve {tmp_path / 'served'} --max-model-len 256" in out
    assert json.loads((tmp_path / "served" / "export.json").read_text())["target"] == "vllm"
    ids = _ids()
    with torch.no_grad():
        adapter = PeftModel.from_pretrained(load_finetune_base(tmp_path / "run"), str(tmp_path / "run")).eval()
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "served").eval()
        torch.testing.assert_close(plain(input_ids=ids).logits, adapter(input_ids=ids).logits, rtol=0, atol=2e-5)
    finetune(_config(checkpoint, tmp_path / "both", methods="yarn:factor=4+dca", max_steps=1))
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "both"), str(tmp_path / "merged")]) == 0
    assert "note: plain transformers loads it unextended (yarn+dca: plain transformers has no such attention" in \
        capsys.readouterr().out


def test_merge_equals_the_adapter_applied_model_and_saves_native_rope_parameters(checkpoint, tmp_path):
    from peft import PeftModel

    finetune(_config(checkpoint, tmp_path / "run", methods="yarn:factor=4+dca", trainable=["norms"], max_steps=3))
    assert main(["merge", str(tmp_path / "run"), str(tmp_path / "merged")]) == 0
    ids = _ids()
    with torch.no_grad():
        adapter = PeftModel.from_pretrained(load_finetune_base(tmp_path / "run"), str(tmp_path / "run")).eval()
        merged = rope_ext.from_pretrained(tmp_path / "merged").eval()
        assert [c.method for c in rope_ext.get_patch(merged)] == ["yarn", "dca"]
        torch.testing.assert_close(merged(input_ids=ids).logits, adapter(input_ids=ids).logits, rtol=0, atol=2e-5)
    saved = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert saved["rope_parameters"]["rope_type"] == "yarn" and "rope_ext" in saved
    assert main(["merge", str(tmp_path / "run"), str(tmp_path / "merged")]) == 2  # not empty: refused
    for inside in (tmp_path / "run", tmp_path / "run" / "merged"):
        assert main(["merge", str(tmp_path / "run"), str(inside), "--overwrite"]) == 2


def test_eval_takes_a_finetune_folder(checkpoint, tmp_path, capsys):
    _, files = checkpoint
    finetune(_config(checkpoint, tmp_path / "run", max_steps=2))
    status = main(["eval", "ppl", "--model", str(tmp_path / "run"), "--text-files", files[2], "--lengths", "64,128",
                   "--target-tokens", "16", "--methods", "yarn:factor=4", "--out", str(tmp_path / "ppl"), "--no-plot"])
    assert status == 0
    assert "saved with rope_ext patch" in capsys.readouterr().out
    summary = json.loads((tmp_path / "ppl" / "ppl.json").read_text())["summary"]
    assert {row["length"] for row in summary} == {64, 128}


def test_full_fine_tuning_saves_a_standalone_patched_model(checkpoint, tmp_path):
    run = finetune(_config(checkpoint, tmp_path / "run", full=True, max_steps=2, lr=1e-4,
                           lora_dropout=FinetuneConfig.lora_dropout))  # (LoRA options left at their defaults)
    assert run.record["parameters"]["trainable"] == run.record["parameters"]["total"]
    reloaded = rope_ext.from_pretrained(tmp_path / "run").eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, run.model(input_ids=ids).logits, rtol=0, atol=1e-6)


def test_evaluation_every_n_steps_uses_the_fixed_target_protocol(checkpoint, tmp_path):
    from rope_ext.eval.data import load_documents, tokenize_documents
    from rope_ext.eval.perplexity import token_nll

    model, files = checkpoint
    config = _config(checkpoint, tmp_path / "run", text_files=files, eval_document="doc2.txt", eval_every=2,
                     eval_target_tokens=16, max_steps=4)
    run = finetune(config)
    evals = run.record["evals"]
    assert [e["step"] for e in evals] == [2, 4] and "doc2.txt" not in run.record["documents"]
    from transformers import AutoTokenizer

    doc = tokenize_documents(load_documents(text_files=[files[2]]), AutoTokenizer.from_pretrained(model))[0]
    nll = token_nll(run.model.eval(), doc.input_ids[:, :128], start=128 - 16)
    assert evals[-1]["perplexity"] == pytest.approx(float(torch.exp(nll.double().mean())), rel=1e-5)


def test_s2_attn_trains_and_is_left_out_of_the_saved_patch(checkpoint, tmp_path):
    run = finetune(_config(checkpoint, tmp_path / "run", s2_attn=True, max_steps=2))
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert [m["method"] for m in saved["rope_ext"]["methods"]] == ["yarn"]
    assert run.record["s2_attn"] and [m["method"] for m in run.record["patch"]] == ["yarn"]


# --- PoSE batches ---------------------------------------------------------------------------------------------


def test_pose_batches_increase_stay_below_the_target_and_do_not_depend_on_the_batching():
    windows = torch.arange(40 * 16).view(40, 16)
    collate = Collator(target=200, pose=True, seed=3)
    dataset = WindowDataset(windows)
    batch = collate([dataset[i] for i in range(40)])
    ids = batch["position_ids"]
    assert ids.shape == (40, 16) and ids.dtype == torch.long
    assert bool((ids[:, 1:] > ids[:, :-1]).all()) and int(ids.max()) < 200 and bool((ids[:, 0] == 0).all())
    assert len({tuple(row.tolist()) for row in ids}) > 30  # drawn per window
    assert bool((batch["attention_mask"] == 1).all()) and torch.equal(batch["labels"], batch["input_ids"])
    one_by_one = torch.cat([collate([dataset[i]])["position_ids"] for i in range(40)])
    assert torch.equal(one_by_one, ids)  # the same window gets the same ids in any micro-batch
    collate.set_epoch(1)
    assert not torch.equal(collate([dataset[i] for i in range(40)])["position_ids"], ids)  # new draws each epoch


def test_training_windows_pack_or_keep_documents_apart():
    from rope_ext.eval.data import Document

    docs = [Document("a", torch.arange(10)[None] + 100), Document("b", torch.arange(7)[None] + 200)]
    packed = training_windows(docs, 4, "packed", eos_token_id=2)
    assert packed.tolist() == [[100, 101, 102, 103], [104, 105, 106, 107], [108, 109, 2, 200], [201, 202, 203, 204]]
    apart = training_windows(docs, 4, "document", eos_token_id=2)
    assert apart.tolist() == [[100, 101, 102, 103], [104, 105, 106, 107], [200, 201, 202, 203]]
    with pytest.raises(ValueError, match=r"no window of 12 tokens .* the longest document 10 with --packing document"):
        training_windows(docs, 12, "document", eos_token_id=2)


@pytest.mark.parametrize("method", ["rerope", "leaky_rerope", "self_extend:G=4", "string", "dca", "yarn:factor=4+dca"])
def test_attention_methods_train_on_pose_batches_with_the_fast_path_equal_to_the_reference(method):
    from rope_ext.attention.program import kernel_override
    from rope_ext.attention.reference import program_reference

    model, batch = _training_on_pose_batch(method, 80)
    fast_loss, fast_grads = _loss_and_grads(model, batch)
    with kernel_override(program_reference):
        ref_loss, ref_grads = _loss_and_grads(model, batch)
    torch.testing.assert_close(fast_loss, ref_loss, rtol=0, atol=2e-5)
    for a, b in zip(fast_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


# --- two processes ----------------------------------------------------------------------------------------------


def test_two_processes_give_the_weights_of_one_with_the_same_global_batch(checkpoint, tmp_path, capsys):
    model, files = checkpoint
    common = ["--model", str(model), "--text-files", *files[:2], "--methods", "yarn:factor=4", "--window", "32",
              "--target-length", "128", "--pose", "--max-steps", "3", "--lora-dropout", "0", "--lr", "1e-3",
              "--warmup-steps", "1", "--threads", "1"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(ROOT / "examples/accelerate/ddp.yaml"), "--num_processes", "2", "--mixed_precision", "no",
                "--main_process_port", "0"]
    two = subprocess.run([*launcher, str(ROOT / "scripts/finetune.py"), *common, "--micro-batch", "1",
                          "--out", str(tmp_path / "two")], env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert main(["finetune", *common, "--micro-batch", "2", "--out", str(tmp_path / "one")]) == 0
    assert json.loads((tmp_path / "two" / "finetune.json").read_text())["processes"] == 2
    one, both = (load_file(tmp_path / f / "adapter_model.safetensors") for f in ("one", "two"))
    assert one.keys() == both.keys()
    moved = max(float(v.abs().max()) for k, v in one.items() if "lora_B" in k)
    assert moved > 1e-4  # (lora_B starts at zero: the runs trained)
    for key in one:
        torch.testing.assert_close(both[key], one[key], rtol=0, atol=1e-6)
    # its data position is counted per process: continuing it in one process is refused
    assert main(["finetune", *common, "--micro-batch", "1", "--max-steps", "4", "--out", str(tmp_path / "two")]) == 2
    assert "was written by a run on 2 process(es); this one has 1" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "kind"), [("ddp", "MULTI_GPU"), ("fsdp", "FSDP"), ("deepspeed_zero2", "DEEPSPEED"),
                                            ("deepspeed_zero3", "DEEPSPEED")])
def test_launch_configs_load_with_accelerates_loader(name, kind):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ROOT / "examples" / "accelerate" / f"{name}.yaml"))
    assert config.distributed_type.name == kind and config.num_processes == 2
    if kind == "DEEPSPEED":
        assert config.deepspeed_config["zero_stage"] == int(name[-1])
        assert config.deepspeed_config["gradient_accumulation_steps"] == "auto"
    if kind == "FSDP":
        assert config.fsdp_config["fsdp_use_orig_params"] is True


# --- configuration ------------------------------------------------------------------------------------------------


def test_yaml_and_flags_override_in_one_style(checkpoint, tmp_path):
    model, files = checkpoint
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {model}\nmethods: [yarn:factor=4+dca]\nwindow: 1k\nlora-r: 4\ntext_files: {files[0]}\n")
    # (window: the old name of sequence_length, still read)
    assert read_yaml(path, FinetuneConfig) == {"model": str(model), "methods": "yarn:factor=4+dca",
                                               "sequence_length": 1024, "lora_r": 4, "text_files": [files[0]]}
    config = FinetuneConfig.from_sources(path, {"lora_r": 16, "lr": None})
    assert (config.lora_r, config.sequence_length, config.lr) == (16, 1024, FinetuneConfig.lr)


BAD_INPUTS = [
    (["--model", "/no/such/rope-ext-model"], (r"--model '/no/such/rope-ext-model': cannot load it \(no such folder: "
                                              r"nor is it a hub id \(a name, or owner/name\)\); give 'default', a "
                                              r"folder written by save_pretrained, or a hub id")),
    (["--sequence-length", "256", "--target-length", "128"], r"--sequence-length 256 is above --target-length 128"),
    (["--window", "256", "--target-length", "128"], r"--sequence-length 256 is above"),  # (the old flag still works)
    (["--lora-targets", "q_proj,query"], r"no linear layer named 'query'; its linear layers: q_proj, k_proj"),
    (["--trainable", "embeddings,heads"], r"--trainable: 'heads' is not one of embeddings, norms"),
    (["--methods", "yarn:factr=4"], r"unknown option"),
    (["--methods", "yarn:factor=4,dca"], r"--methods 'yarn:factor=4,dca': a run trains under one spec"),
    (["--lr", "0"], r"--lr: must be in \(0, inf\)"),
    (["--lora-dropout", "1"], r"--lora-dropout: must be in \[0, 1\)"),
    (["--max-steps", "0"], r"--max-steps: must be an integer >= 1"),
    (["--eval-every", "5"], r"--eval-every: give --eval-document"),
    (["--eval-document", "nowhere.txt", "--eval-target-tokens", "16"], r"document 'nowhere.txt' .* is not in the data; its documents: doc0.txt"),
    (["--exclude", "doc0.txt,doc1.txt"], r"no document is left to train on"),
    (["--sequence-length", "4k", "--target-length", "8k"], r"holds no window of 4096 tokens"),
    (["--micro-batch", "100"], r"--micro-batch 100: the training text makes 37 window\(s\) of 32 tokens"),
    (["--full", "--trainable", "norms"], r"--trainable: a LoRA option, but --full trains every parameter"),
    (["--full", "--lora-r", "4"], r"--lora-r: a LoRA option, but --full trains every parameter"),
    (["--methods", "yarn:factor=4+s2_attn"], r"S2-Attn is given with --s2-attn .* take s2_attn out of --methods"),
    (["--mixed-precision", "fp16"], r"--mixed-precision fp16: accelerate runs fp16 on GPUs only"),
    (["--target-length", "1"], r"--target-length: must be an integer >= 2, got 1"),
    (["--seed", "-1"], r"--seed: must be an integer in \[0, 2\*\*32 - 1\], got -1"),
    (["--pose", "--target-length", "32"], r"--pose: PoSE's positions skip ahead up to --target-length, which is the sequence length \(32\)"),
    (["--s2-group-ratio", "0.5"], r"--s2-group-ratio: an S2-Attn option; give --s2-attn too"),
    (["--threads", "2000"], r"--threads: must be an integer in \[0, 1024\] \(0: torch's choice\), got 2000"),
    (["--s2-attn", "--sequence-length", "34"], r"--s2-attn with --sequence-length 34: .* every multiple of 4 works; "
                                               r"the nearest lengths that work: 32 and 36"),
]


@pytest.mark.parametrize(("extra", "message"), BAD_INPUTS, ids=[" ".join(e) for e, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_writes_nothing(checkpoint, tmp_path, capsys, extra, message):
    import re

    model, files = checkpoint
    out = tmp_path / "out"
    args = ["finetune", "--model", str(model), "--text-files", *files[:2], "--window", "32", "--target-length", "128",
            "--max-steps", "2", "--out", str(out), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (above it: the loading bars of transformers and datasets)
    assert err.startswith("rope-ext: error: ") and re.search(message, err), err
    assert not out.exists()


def test_missing_data_and_unreadable_config_are_refused(checkpoint, tmp_path, capsys):
    model, _ = checkpoint
    for extra, message in [(["--text-files", str(tmp_path / "none.txt")], "not found"),
                           (["--dataset", str(tmp_path / "nodata")], "--dataset"),
                           (["--config", str(tmp_path / "none.yaml")], "no such file")]:
        assert main(["finetune", "--model", str(model), "--out", str(tmp_path / "out"), *extra]) == 2
        assert message in capsys.readouterr().err
    for text, message in [("lora_rank: 4\n", "unknown option 'lora_rank'; options:"),
                          ("lora_r: 4\nlora-r: 8\n", "'lora_r' is given twice"),
                          (f"model: {model}\ntext_files: []\n", "bad.yaml: text_files: an empty list"),
                          ("- 1\n- 2\n", "give a mapping of options")]:
        (tmp_path / "bad.yaml").write_text(text)
        assert main(["finetune", "--config", str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "out")]) == 2
        assert message in capsys.readouterr().err
    assert main(["finetune", "--config", str(tmp_path)]) == 2
    assert "is a folder; give a YAML file" in capsys.readouterr().err
    assert main(["finetune", "--config", str(tmp_path / "bad.yaml"), "--config", str(tmp_path / "bad.yaml")]) == 2
    assert "argument --config: given twice" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_folder_saved_with_the_old_option_name_resumes(checkpoint, tmp_path, capsys):
    """``window`` was ``sequence_length``'s name before 0.2: a folder whose saved options use it is the same run (a
    re-run finds it complete), and one of another length is refused naming the new name."""
    finetune(_config(checkpoint, tmp_path / "run", max_steps=1))
    saved_path = tmp_path / "run" / "finetune_config.json"
    saved = json.loads(saved_path.read_text())
    saved["window"] = saved.pop("sequence_length")
    saved_path.write_text(json.dumps(saved))
    capsys.readouterr()
    finetune(_config(checkpoint, tmp_path / "run", max_steps=1))
    assert "this run is complete (1 step); nothing to do" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"differs in: sequence_length: 32 before, 16 now"):
        finetune(_config(checkpoint, tmp_path / "run", max_steps=1, sequence_length=16))


def test_a_folder_of_another_configuration_is_refused(checkpoint, tmp_path, capsys):
    finetune(_config(checkpoint, tmp_path / "run", max_steps=2))
    finetune(_config(checkpoint, tmp_path / "run", max_steps=2, methods="yarn:factor=4.0"))  # (the same run: complete)
    with pytest.raises(ValueError, match=r"holds a rope-ext finetune run of another configuration \(differs in: "
                                         r"methods: 'yarn:factor=4' before"):
        finetune(_config(checkpoint, tmp_path / "run", max_steps=2, methods="yarn:factor=4.5"))
    with pytest.raises(ValueError) as refused:
        finetune(_config(checkpoint, tmp_path / "run", max_steps=2, lora_r=4))
    # (an evaluation's folder is refused by the same class, in the same words: tests/test_eval.py)
    assert str(refused.value) == (
        f"--out {tmp_path / 'run'} holds a rope-ext finetune run of another configuration (differs in: lora_r: 8 "
        "before, 4 now); re-run with its options to resume, give another --out, or pass --overwrite to replace them")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds other files \(not a rope-ext finetune run\)"):
        finetune(_config(checkpoint, tmp_path / "other", max_steps=2))
    finetune(_config(checkpoint, tmp_path / "run", max_steps=2, lora_r=4), overwrite=True)
    assert json.loads((tmp_path / "run" / "finetune_config.json").read_text())["lora_r"] == 4


def test_s2_attn_on_a_family_without_the_attention_hook_is_refused(checkpoint, tmp_path, capsys):
    _, files = checkpoint
    torch.manual_seed(0)
    tiny_model("falcon").save_pretrained(tmp_path / "falcon")  # (falcon: frequency methods only)
    (tmp_path / "falcon" / "tokenizer.json").write_bytes((checkpoint[0] / "tokenizer.json").read_bytes())
    (tmp_path / "falcon" / "tokenizer_config.json").write_bytes((checkpoint[0] / "tokenizer_config.json").read_bytes())
    args = ["finetune", "--model", str(tmp_path / "falcon"), "--text-files", *files[:2], "--window", "32",
            "--max-steps", "1", "--out", str(tmp_path / "out")]
    assert main([*args, "--s2-attn"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--methods none with --s2-attn: method 's2_attn' needs a 'wrapper' hook, which family 'falcon' does not " \
           "support; methods for falcon: dynamic_ntk" in err
    assert not (tmp_path / "out").exists()
    assert main([*args, "--methods", "yarn:factor=4"]) == 0  # (its frequency methods train)


def test_merge_refuses_what_is_not_a_finetune_folder(checkpoint, tmp_path, capsys):
    model, _ = checkpoint
    assert main(["merge", str(model), str(tmp_path / "out")]) == 2
    assert "is not a LoRA fine-tune folder" in capsys.readouterr().err
    assert main(["merge", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_paths_are_compared_resolved_and_a_missing_base_is_named(checkpoint, tmp_path, monkeypatch, capsys):
    import shutil

    model, files = checkpoint
    shutil.copytree(model, tmp_path / "base")
    shutil.copy(files[0], tmp_path / "a.txt")
    monkeypatch.chdir(tmp_path)
    relative = _config((Path("base"), ["a.txt"]), "run", max_steps=1)
    finetune(relative)
    again = finetune(_config((tmp_path / "base", [str(tmp_path / "a.txt")]), tmp_path / "run", max_steps=1))
    assert again.model is None  # the same run, given by absolute paths: complete
    shutil.rmtree(tmp_path / "base")
    assert main(["merge", "run", "merged"]) == 2
    assert f"its base model {tmp_path / 'base'} (finetune.json's base_model) is not found" in capsys.readouterr().err


def test_from_pretrained_of_a_finetune_folder_takes_dtype_only(checkpoint, tmp_path):
    finetune(_config(checkpoint, tmp_path / "run", max_steps=1))
    with pytest.raises(ValueError, match=r"takes dtype only, not revision"):
        rope_ext.from_pretrained(tmp_path / "run", revision="main")
    assert next(load_finetune_base(tmp_path / "run", torch.float64).parameters()).dtype == torch.float64
    assert next(rope_ext.from_pretrained(tmp_path / "run", dtype="bfloat16").parameters()).dtype == torch.bfloat16
    assert next(rope_ext.from_pretrained(tmp_path / "run", dtype="auto").parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match=r"dtype='fast': give a torch dtype, its name"):
        rope_ext.from_pretrained(tmp_path / "run", dtype="fast")


@pytest.mark.parametrize("methods", ["dca", "yarn:factor=4+s2_attn", "self_extend:G=4"])
def test_gradient_checkpointing_gives_the_gradients_of_the_plain_backward(methods):
    model, batch = _training_on_pose_batch(methods, 96)
    plain_loss, plain = _loss_and_grads(model, batch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed_loss, checkpointed = _loss_and_grads(model, batch)
    assert torch.equal(plain_loss, checkpointed_loss)
    assert len(plain) == len(checkpointed) == len(list(model.parameters()))  # (every parameter has its gradient)
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_out_may_not_be_the_model_folder(checkpoint, tmp_path, capsys):
    import shutil

    model, files = checkpoint
    shutil.copytree(model, tmp_path / "base")
    before = sorted(p.name for p in (tmp_path / "base").iterdir())
    for out in (tmp_path / "base", tmp_path / "base" / "run", tmp_path):
        args = ["finetune", "--model", str(tmp_path / "base"), "--text-files", *files[:2], "--window", "32",
                "--max-steps", "1", "--out", str(out), "--overwrite"]
        assert main(args) == 2
        assert "the --model folder" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "base").iterdir()) == before


def test_a_length_past_a_learned_table_is_refused_before_anything_is_written(checkpoint, tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    model, files = checkpoint
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "gpt2" / name).write_bytes((model / name).read_bytes())
    args = ["finetune", "--model", str(tmp_path / "gpt2"), "--text-files", *files[:2], "--window", "32",
            "--max-steps", "1", "--out", str(tmp_path / "out")]
    assert main([*args, "--target-length", "128", "--pose"]) == 2
    assert "--target-length 128: GPT2LMHeadModel's position table holds 64 positions;" in capsys.readouterr().err
    assert main([*args, "--target-length", "256", "--methods", "abs_interp:factor=2"]) == 2
    assert "holds 127 positions under --methods abs_interp:factor=2" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert main([*args, "--target-length", "128", "--methods", "abs_interp:factor=2.1"]) == 0


def test_a_patchs_own_parameters_train_with_lora_and_merge(checkpoint, tmp_path):
    """FIRE's MLP lives in the patch's container: LoRA lists it in ``modules_to_save`` (peft freezes it
    otherwise), so it trains, is saved with the adapter and merges."""
    run = finetune(_config(checkpoint, tmp_path / "run", methods="fire", max_steps=3, lr=1e-2))
    adapter = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert "rope_ext" in adapter["modules_to_save"]
    assert adapter["base_model_name_or_path"] == str(checkpoint[0].resolve())  # (absolute: peft resolves it anywhere)
    fresh = rope_ext.patch(tiny_model("llama"), "fire").rope_ext.state_dict()
    trained = rope_ext.core.anchor_of(run.model).rope_ext.modules_to_save["default"].state_dict()
    assert trained.keys() == fresh.keys()
    assert max((trained[k] - fresh[k]).abs().max() for k in fresh) > 1e-4
    assert main(["merge", str(tmp_path / "run"), str(tmp_path / "merged")]) == 0
    merged = rope_ext.from_pretrained(tmp_path / "merged").rope_ext.state_dict()
    for key in fresh:
        torch.testing.assert_close(merged[key], trained[key], rtol=0, atol=0)


def test_merge_refuses_broken_folders_before_writing(checkpoint, tmp_path, capsys):
    import shutil

    finetune(_config(checkpoint, tmp_path / "run", max_steps=1))
    cases = [(lambda f: (f / "adapter_model.safetensors").unlink(), "has no adapter weights"),
             (lambda f: (f / "finetune.json").write_text("{"), "finetune.json is not valid JSON"),
             (lambda f: (f / "finetune.json").write_text("{}"), "finetune.json names no base_model"),
             (lambda f: [(f / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")], "its tokenizer does not load")]
    for i, (breakage, message) in enumerate(cases):
        shutil.copytree(tmp_path / "run", tmp_path / f"broken{i}")
        breakage(tmp_path / f"broken{i}")
        assert main(["merge", str(tmp_path / f"broken{i}"), str(tmp_path / f"merged{i}")]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / f"merged{i}").exists()


def test_yaml_numbers_in_exponent_form_are_numbers(tmp_path):
    (tmp_path / "run.yaml").write_text("lr: 1e-4\nweight_decay: 2E-2\nwindow: 4k\n")
    assert read_yaml(tmp_path / "run.yaml", FinetuneConfig) == {"lr": 1e-4, "weight_decay": 0.02,
                                                                "sequence_length": 4096}
    (tmp_path / "run.yaml").write_text("lr: fast\n")
    with pytest.raises(ValueError, match="lr: must be a number, got 'fast'"):
        read_yaml(tmp_path / "run.yaml", FinetuneConfig)


def test_a_resume_on_changed_data_or_base_weights_is_refused(checkpoint, tmp_path):
    import shutil

    model, files = checkpoint
    shutil.copytree(model, tmp_path / "base")
    shutil.copy(files[0], tmp_path / "a.txt")
    config = _config(checkpoint, tmp_path / "run", model=str(tmp_path / "base"), text_files=[str(tmp_path / "a.txt")],
                     max_steps=2, save_every=1)
    finetune(config)
    saved = json.loads((tmp_path / "run" / "inputs.json").read_text())
    assert set(saved) == {"windows_sha256", "frozen_weights_sha256"}
    longer = _config(checkpoint, tmp_path / "run", model=str(tmp_path / "base"), text_files=[str(tmp_path / "a.txt")],
                     max_steps=3, save_every=1)
    (tmp_path / "a.txt").write_text(Path(files[1]).read_text())
    with pytest.raises(ValueError, match=r"trained on other windows under the same options"):
        finetune(longer)
    shutil.copy(files[0], tmp_path / "a.txt")
    weights = tiny_model("llama", seed=1)
    weights.save_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match=r"trained on other frozen weights under the same options"):
        finetune(longer)
    tiny_model("llama").save_pretrained(tmp_path / "base")
    assert finetune(longer).record["steps"] == 3  # (restored: it resumes)


def test_a_flag_replaces_what_the_file_says_of_the_same_thing(tmp_path):
    (tmp_path / "run.yaml").write_text(
        "dataset: /data/kjv\nexclude: Psalms,Isaiah\neval_document: Psalms\ntrainable: embeddings,norms\nlora_r: 4\n")
    config = FinetuneConfig.from_sources(tmp_path / "run.yaml", {"text_files": ["a.txt"], "full": True})
    assert (config.dataset, config.text_files, config.exclude, config.eval_document) == (None, ["a.txt"], [], None)
    assert config.full and config.trainable == [] and config.lora_r == FinetuneConfig.lora_r
    kept = FinetuneConfig.from_sources(tmp_path / "run.yaml", {"text_files": ["a.txt"], "exclude": ["a.txt"]})
    assert kept.exclude == ["a.txt"] and kept.trainable == ["embeddings", "norms"] and kept.lora_r == 4
    with pytest.raises(ValueError, match="a LoRA option, but --full"):
        FinetuneConfig.from_sources(tmp_path / "run.yaml", {"full": True, "lora_r": 16})


def test_gradient_checkpointing_leaves_the_saved_config_using_the_cache(checkpoint, tmp_path):
    finetune(_config(checkpoint, tmp_path / "run", max_steps=1, gradient_checkpointing=True))
    assert json.loads((tmp_path / "run" / "config.json").read_text())["use_cache"] is True
    finetune(_config(checkpoint, tmp_path / "full", max_steps=1, gradient_checkpointing=True, full=True,
                      lora_dropout=FinetuneConfig.lora_dropout))
    assert json.loads((tmp_path / "full" / "config.json").read_text())["use_cache"] is True
