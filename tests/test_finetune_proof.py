"""scripts/finetune_proof.py, the held-out fine-tuning proof: its stages' commands on a device and in bf16, the chains
``--parallel`` runs at once, a folder's protocol, and the report's paired ratios and retrieval cells."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def proof():
    spec = importlib.util.spec_from_file_location("finetune_proof", ROOT / "scripts" / "finetune_proof.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_evaluations_take_the_device_and_dtype_and_training_bf16_mixed_precision(proof, tmp_path):
    plan = dict(proof.stages(str(tmp_path), "cuda", "bfloat16"))
    for name, command in plan.items():
        if command[1] == "eval":
            assert command[-4:] == ["--device", "cuda", "--dtype", "bfloat16"], name
        elif command[1] == "finetune":
            assert command[-2:] == ["--mixed-precision", "bf16"], name
    cpu = dict(proof.stages(str(tmp_path)))
    assert cpu["ppl_none"][-4:] == ["--device", "cpu", "--dtype", "float32"]
    assert "--mixed-precision" not in cpu["train_seed0"]


def test_the_plain_lora_baseline_is_evaluated_unpatched(proof, tmp_path):
    """Its folder was saved without a patch: 'saved' is refused there (what the first GPU run hit)."""
    plan = dict(proof.stages(str(tmp_path)))
    for name in ("ppl_lora_none", "short_lora_none"):
        command = plan[name]
        assert command[command.index("--methods") + 1] == "none"
    assert plan["ppl_lora_none"][plan["ppl_lora_none"].index("--lengths") + 1] == "8k"


def test_chains_keep_each_model_after_its_training_and_the_base_stages_apart(proof, tmp_path):
    names = [name for name, _ in proof.stages(str(tmp_path))]
    chains: dict[str, list[str]] = {}
    for name in names:
        chains.setdefault(proof.chain(name), []).append(name)
    for seed in proof.SEEDS:
        assert chains[f"seed{seed}"] == [f"train_seed{seed}", f"ppl_seed{seed}", f"short_seed{seed}",
                                         f"passkey_seed{seed}"]
    assert chains["lora_none"] == ["train_lora_none", "ppl_lora_none", "short_lora_none"]
    for name in ("ppl_none", "ppl_untrained", "short_untrained", "passkey_untrained", "passkey_native", "corpus",
                 *proof.TRAINING_FREE.values(), "passkey_dca_chunk8k"):
        assert chains[name] == [name]


def test_the_training_free_rows_score_the_untrained_rows_targets(proof, tmp_path):
    """The attention rewrites on the base model, the command of untrained YaRN's row but for the method: the same
    texts, windows, lengths and targets, so that the report pairs them with the unpatched model's windows."""
    plan = dict(proof.stages(str(tmp_path)))
    untrained = plan["ppl_untrained"]
    at = untrained.index("--methods")
    for method, stage in proof.TRAINING_FREE.items():
        command = plan[stage]
        assert command[at + 1] == method and command[:at + 1] == untrained[:at + 1]
        assert command[at + 2:] == [a.replace("ppl_untrained", stage) for a in untrained[at + 2:]]
        assert proof.ROWS[f"{method}, training-free"] == stage


def test_a_folder_refuses_another_dtypes_protocol(proof, tmp_path, monkeypatch):
    assert "dtype" not in proof.protocol("float32")  # (folders written before the option read the same)
    assert proof.protocol("bfloat16")["dtype"] == "bfloat16"
    (tmp_path / "protocol.json").write_text(json.dumps(proof.protocol("float32")))
    monkeypatch.setattr(sys, "argv", ["finetune_proof.py", "--out", str(tmp_path), "--dtype", "bfloat16", "--list"])
    with pytest.raises(SystemExit, match="records another protocol"):
        proof.main()


def _write(folder: Path, stage: str, kind: str, rows: list[dict], done: bool = True) -> None:
    (folder / stage).mkdir(parents=True, exist_ok=True)
    (folder / stage / f"{kind}_records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if done:
        (folder / f"{stage}.done").write_text("{}")


def test_the_report_pairs_windows_and_keeps_a_stopped_retrievals_trials(proof, tmp_path):
    (tmp_path / "protocol.json").write_text(json.dumps(proof.protocol()))

    def window(doc: str, nll: float, length: int = 8192) -> dict:
        return {"method": "x", "document": doc, "length": length, "mean_nll": nll, "tokens_scored": 100}

    _write(tmp_path, "ppl_none", "ppl", [window("a", 2.0), window("b", 3.0)])
    _write(tmp_path, "ppl_seed0", "ppl", [window("a", 2.1), window("b", 3.1), window("a", 2.2, 32768),
                                          window("b", 3.2, 32768)])
    _write(tmp_path, "ppl_lora_none", "ppl", [window("a", 1.9), window("b", 2.9)])
    _write(tmp_path, "ppl_seed1", "ppl", [window("a", 9.0), window("b", 9.0)], done=False)  # (not finished: left out)
    keys = [{"method": "saved", "length": 16384, "depth": 0.9, "correct": trial < 3} for trial in range(4)]
    _write(tmp_path, "passkey_seed0", "passkey", keys, done=False)
    result = proof.report(str(tmp_path))
    cell = result["long"]["seed 0"]["8192"]
    assert cell["windows"] == 2 and math.isclose(cell["ratio"], math.exp(0.1))
    assert math.isclose(result["long"]["seed 0"]["32768"]["ratio"], math.exp(0.2))
    assert result["long"]["seed 1"] == {}
    assert math.isclose(result["against_lora_8k"]["seed 0"]["32768"]["ratio"], math.exp(0.3))
    hits = result["retrieval"]["seed 0"]["saved 16384 0.9"]
    assert (hits["correct"], hits["trials"], hits["stage_finished"]) == (3, 4, False)
    text = (tmp_path / "report.md").read_text()
    assert "| seed 0 (stage stopped before its end) | saved | 16k | 0.9 | 3/4 (" in text
    assert text.startswith("Report texts (no configuration was chosen on them): devils-dictionary, debian-reference,")
    assert "x plain LoRA" in text and "x unpatched at that context" not in text  # (no short check ran: no table)


def _two_runs(proof, tmp_path: Path) -> tuple[Path, Path]:
    """Two folders of the same protocol: this CPU's run and the one the seeds came from (``--seeds-from``)."""
    here, there = tmp_path / "cpu", tmp_path / "gpu"
    for folder in (here, there):
        folder.mkdir()
        (folder / "protocol.json").write_text(json.dumps(proof.protocol()))
    return here, there


def _window(doc: str, nll: float, length: int) -> dict:
    return {"method": "x", "document": doc, "length": length, "mean_nll": nll, "tokens_scored": 100}


def test_the_training_free_rows_pair_with_the_unpatched_8k_and_each_seed_of_another_run(proof, tmp_path):
    """A training-free row against the unpatched model's 8k here, and against each seed's 32k windows of another run
    of the protocol (``--seeds-from``: the seeds ran on a GPU, the training-free rows here)."""
    here, there = _two_runs(proof, tmp_path)
    window = _window
    _write(here, "ppl_none", "ppl", [window("a", 2.0, 8192), window("b", 3.0, 8192)])
    _write(here, "ppl_dca_chunk8k", "ppl", [window("a", 2.0, 8192), window("b", 3.0, 8192), window("a", 2.05, 32768),
                                            window("b", 3.05, 32768)])
    _write(there, "ppl_seed0", "ppl", [window("a", 2.3, 32768), window("b", 3.3, 32768)])
    _write(there, "ppl_seed2", "ppl", [window("a", 2.0, 32768)])
    row = "dca:chunk_size=8192, training-free"
    assert proof.report(str(here))["training_free_against_seeds_32k"] == {}  # (no seeds here)
    result = proof.report(str(here), str(there))
    assert math.isclose(result["long"][row]["32768"]["ratio"], math.exp(0.05))
    assert math.isclose(result["long"][row]["8192"]["ratio"], 1.0)
    against = result["training_free_against_seeds_32k"][row]
    assert set(against) == {"seed 0", "seed 2"}  # (seed 1 ran nowhere)
    assert math.isclose(against["seed 0"]["ratio"], math.exp(-0.25)) and against["seed 0"]["windows"] == 2
    assert math.isclose(against["seed 2"]["ratio"], math.exp(0.05)) and against["seed 2"]["windows"] == 1
    assert f"| {row} / seed 0 | 0.779 (" in (here / "report.md").read_text()


def test_the_short_check_pairs_each_seed_with_the_plain_lora_at_each_context_here_or_where_the_seeds_ran(proof,
                                                                                                        tmp_path):
    """The recipe's tax inside the window against the fine-tune on the same data with no extension: each seed's short
    check (here, else in ``--seeds-from``) paired with the baseline's at the same context."""
    here, there = _two_runs(proof, tmp_path)
    window = _window
    _write(here, "short_lora_none", "ppl", [window(d, 2.0, L) for d in "ab" for L in (1024, 4096)])
    _write(here, "short_seed2", "ppl", [window("a", 2.1, 1024), window("b", 2.1, 1024), window("a", 2.2, 4096)])
    _write(there, "short_seed0", "ppl", [window(d, 1.9, L) for d in "ab" for L in (1024, 4096)])
    _write(there, "short_seed2", "ppl", [window(d, 9.0, L) for d in "ab" for L in (1024, 4096)])  # (here's wins)
    assert proof.report(str(there))["against_lora_short"] == {}  # (no baseline there)
    against = proof.report(str(here), str(there))["against_lora_short"]
    assert math.isclose(against["seed 0"]["1024"]["ratio"], math.exp(-0.1))
    assert math.isclose(against["seed 2"]["1024"]["ratio"], math.exp(0.1)) and against["seed 2"]["1024"]["windows"] == 2
    assert math.isclose(against["seed 2"]["4096"]["ratio"], math.exp(0.2)) and against["seed 2"]["4096"]["windows"] == 1
    assert against["seed 1"] == {}  # (ran nowhere)
    assert "| seed 2 | 4k | 1.221 (" in (here / "report.md").read_text()


def test_only_skips_done_stages_unless_redo_and_redo_needs_only(proof, tmp_path, monkeypatch, capsys):
    (tmp_path / "protocol.json").write_text(json.dumps(proof.protocol()))
    for name in ("corpus", "ppl_none"):
        (tmp_path / f"{name}.done").write_text("{}")
    ran: list[str] = []
    commands: dict[str, list[str]] = {}

    def run_stage(out, name, command, log):
        ran.append(name)
        commands[name] = command
        return 0

    monkeypatch.setattr(proof, "run_stage", run_stage)
    for argv, expected in [(["--only", "ppl_none,ppl_untrained"], ["ppl_untrained"]),
                           (["--only", "ppl_none", "--redo"], ["ppl_none"])]:
        ran.clear()
        monkeypatch.setattr(sys, "argv", ["finetune_proof.py", "--out", str(tmp_path), *argv])
        assert proof.main() == 0 and ran == expected
    assert commands["ppl_none"][-1] == "--overwrite"  # (redone from the start: a finished stage would only resume)
    assert "--overwrite" not in commands["ppl_untrained"]
    monkeypatch.setattr(sys, "argv", ["finetune_proof.py", "--out", str(tmp_path), "--redo"])
    with pytest.raises(SystemExit, match="name them"):
        proof.main()


def test_agreement_is_the_largest_relative_difference_of_a_shared_window(proof, tmp_path):
    here, there = tmp_path / "gpu", tmp_path / "cpu"

    def window(doc: str, nll: float) -> dict:
        return {"method": "none", "document": doc, "length": 8192, "start": 0, "mean_nll": nll}

    _write(here, "ppl_none", "ppl", [window("a", 2.0), window("b", 3.003), window("c", 1.0)])
    _write(there, "ppl_none", "ppl", [window("a", 2.0), window("b", 3.0)])
    _write(there, "ppl_untrained", "ppl", [window("a", 2.0)])
    result = proof.agreement(str(here), str(there))
    assert list(result["stages"]) == ["ppl_none"]
    assert result["stages"]["ppl_none"]["windows"] == 2
    assert math.isclose(result["stages"]["ppl_none"]["max_relative_difference"], 0.001)


def test_a_parallel_run_fails_when_a_chain_is_killed(proof, tmp_path, monkeypatch):
    """A stage killed by a signal returns a negative status: the run must not report success."""
    (tmp_path / "protocol.json").write_text(json.dumps(proof.protocol()))
    (tmp_path / "corpus.done").write_text("{}")
    monkeypatch.setattr(proof, "run_stage", lambda out, name, command, log: -9 if name == "ppl_none" else 0)
    monkeypatch.setattr(sys, "argv", ["finetune_proof.py", "--out", str(tmp_path), "--parallel",
                                      "--only", "ppl_none,ppl_untrained"])
    assert proof.main() == -9


def test_the_report_marks_retrieval_of_the_earlier_prompt(proof, tmp_path):
    (tmp_path / "protocol.json").write_text(json.dumps(proof.protocol()))
    keys = [{"method": "saved", "length": 16384, "depth": 0.5, "correct": True}]
    for stage, run in (("passkey_seed0", {}), ("passkey_seed1", {"answer_within_length": True})):
        _write(tmp_path, stage, "passkey", keys)
        (tmp_path / stage / "passkey_run.json").write_text(json.dumps(run))
    result = proof.report(str(tmp_path))
    assert result["retrieval"]["seed 0"]["saved 16384 0.5"]["earlier_prompt"] is True
    assert result["retrieval"]["seed 1"]["saved 16384 0.5"]["earlier_prompt"] is False
    text = (tmp_path / "report.md").read_text()
    assert "| seed 0 (earlier prompt: L tokens, the answer past L) |" in text and "| seed 1 | saved |" in text
