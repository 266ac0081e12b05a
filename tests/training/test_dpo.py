"""Preference tuning in the engine: pairs tokenized as SFT renders a reply, the truncation policy, pairs
kept whole in micro-batches, split invariance (accumulation, FSDP over 2 gloo processes), resume after a
kill -9, QLoRA on the CPU, and continuing from an SFT adapter (init_from) whose frozen copy is the reference.
(Exactness against TRL: test_dpo_vs_trl.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.data.examples import Example, Message, PreferenceExample, to_preference
from core.run_protocol import EXIT_OK
from core.storage import ADAPTER_DIR, CHECKPOINTS_DIR, METRICS_FILE
from tests.training.util import (
    elementwise,
    pair_rows,
    qa_rows,
    read_metrics,
    relative_difference,
)
from training import batches
from training.data import IGNORE, tokenize_example
from training.objectives.dpo.pairs import Whole, fit_pair, load_for_training, sequence_indices, tokenize_pair
from training.run import run
from training.step import make_batch
from worker.runner import training_command

REPO = Path(__file__).resolve().parents[2]
DPO = {"objective": "dpo", "beta": 0.1, "learning_rate": 5e-3}


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / ADAPTER_DIR / "adapter_model.safetensors")


def steps(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / METRICS_FILE) if r["type"] == "step"]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in steps(out)}


# ---- tokenization


@pytest.mark.parametrize("fmt", ["preference", "messages", "implicit"])
def test_each_side_is_tokenized_as_sft_tokenizes_the_reply(tokenizer, fmt: str) -> None:
    """Conversational pairs: prompt + reply as the chat example [prompt..., reply] tokenizes in SFT,
    labels on the reply (its end-of-turn marker included) only."""
    row = pair_rows(1, start=3, fmt=fmt)[0]
    ex = to_preference(row, "preference" if fmt == "preference" else "chosen_rejected")
    assert ex.conversational and [m.role for m in ex.prompt] == ["user"]
    pair = fit_pair(tokenize_pair(ex, tokenizer), 512, "truncate")
    assert pair is not None
    for side, reply in ((pair.chosen, ex.chosen), (pair.rejected, ex.rejected)):
        sft = tokenize_example(Example("chat", (*ex.prompt, reply)), tokenizer, None)
        assert side.input_ids == sft.input_ids and side.labels == sft.labels
        assert side.labels[: pair.prompt_len] == [IGNORE] * pair.prompt_len
        assert all(x != IGNORE for x in side.labels[pair.prompt_len :])
    assert pair.chosen.input_ids[: pair.prompt_len] == pair.rejected.input_ids[: pair.prompt_len]


def test_text_pairs_are_tokenized_as_prompt_completion(tokenizer) -> None:
    row = pair_rows(1, fmt="text")[0]
    ex = to_preference(row, "chosen_rejected")
    assert not ex.conversational
    pair = fit_pair(tokenize_pair(ex, tokenizer), 512, "truncate")
    assert pair is not None
    sft = tokenize_example(
        Example(
            "prompt_completion", (Message("user", row["prompt"], 0), Message("assistant", row["chosen"], 1))
        ),
        tokenizer,
        None,
    )
    assert pair.chosen.input_ids == sft.input_ids and pair.chosen.labels == sft.labels
    assert (
        pair.chosen.input_ids[0] == tokenizer.bos_token_id
        and pair.chosen.input_ids[-1] == tokenizer.eos_token_id
    )


def test_implicit_text_prompt_is_the_common_prefix() -> None:
    ex = to_preference({"chosen": "The sky is blue.", "rejected": "The sky is green."}, "chosen_rejected")
    assert (ex.prompt[0].content, ex.chosen.content, ex.rejected.content) == (
        "The sky is",
        " blue.",
        " green.",
    )
    assert isinstance(ex, PreferenceExample)


def test_truncation_cuts_the_prompt_first_then_the_replies() -> None:
    whole = Whole(list(range(100, 140)), list(range(10)), list(range(20, 26)))  # prompt 40, replies 10 and 6
    fits = fit_pair(whole, 64, "truncate")
    assert fits is not None and fits.prompt_len == 40 and len(fits.chosen.input_ids) == 50
    # 40 + 10 > 45: the prompt keeps its last 45 - 10 = 35 tokens, the replies stay whole
    p = fit_pair(whole, 45, "truncate")
    assert p is not None and p.prompt_len == 35
    assert p.chosen.input_ids == list(range(105, 140)) + list(range(10))
    assert p.rejected.input_ids == list(range(105, 140)) + list(range(20, 26))
    # a reply of 40 in 48: the prompt keeps half (24, its last), the replies their first 24
    long = Whole(list(range(100, 140)), list(range(40)), list(range(3)))
    q = fit_pair(long, 48, "truncate")
    assert q is not None and q.prompt_len == 24
    assert q.chosen.input_ids == list(range(116, 140)) + list(range(24))
    assert q.rejected.labels == [IGNORE] * 24 + list(range(3))
    assert fit_pair(whole, 45, "drop") is None
    assert fit_pair(whole, 50, "drop") is not None


def test_pair_statistics_and_dropped_pairs(tokenizer, tmp_path: Path) -> None:
    from core.spec import JobSpec
    from tests.training.util import write_jsonl

    path = write_jsonl(tmp_path / "p.jsonl", pair_rows(10))
    spec = JobSpec(
        base_model="tiny", dataset_id="testdata01", objective="dpo", max_seq_len=61, over_length="drop"
    )
    pairs, dropped, stats = load_for_training(path, tokenizer, spec)
    assert stats["kind"] == "preference" and stats["count"] == 10
    assert dropped == stats["over_max_seq_len"] == 10 - len(pairs) and dropped > 0
    assert stats["truncated"] == 0 and stats["prompt_max"] <= stats["max"]
    assert stats["completion_p50"] <= stats["completion_max"]
    truncating = spec.model_copy(update={"over_length": "truncate"})
    pairs, dropped, stats = load_for_training(path, tokenizer, truncating)
    assert len(pairs) == 10 and dropped == 0 and stats["truncated"] == stats["over_max_seq_len"] > 0
    assert max(len(p.chosen.input_ids) for p in pairs) <= 61


@pytest.mark.parametrize("packing", [False, True])
def test_a_pair_is_never_split_across_micro_batches(tokenizer, tmp_path: Path, packing: bool) -> None:
    from core.spec import JobSpec
    from tests.training.util import write_jsonl
    from training.objectives.dpo.pairs import Sequences

    path = write_jsonl(tmp_path / "p.jsonl", pair_rows(21))
    spec = JobSpec(base_model="tiny", dataset_id="testdata01", objective="dpo", max_seq_len=64,
                   micro_batch_size=2, gradient_accumulation_steps=2, packing=packing)  # fmt: skip
    pairs, _, _ = load_for_training(path, tokenizer, spec)
    lengths = [p.length for p in pairs]
    seen = []
    for step in batches.epoch_steps(spec, lengths, 0):
        assert sum(len(row) for row in step) <= (4 if not packing else 99)
        for micro in batches.split_step(spec, dict(enumerate(lengths)), step):
            seen += micro
            batch = make_batch(spec, Sequences(pairs), sequence_indices(micro), 0)
            rows = batch["input_ids"].shape[0]  # type: ignore[union-attr]
            assert rows == (1 if packing else 2 * len(micro))
            if packing:
                assert batch["input_ids"].shape[1] <= 2 * spec.max_seq_len * spec.micro_batch_size  # type: ignore[union-attr]
    assert sorted(seen) == list(range(len(pairs)))


# ---- training


def test_dpo_trains_and_its_reward_accuracy_rises(make_config) -> None:
    config = make_config(pair_rows(16), name="dpo", max_steps=12, **DPO)
    assert run(config) == EXIT_OK
    recs = steps(Path(config.output_dir))
    assert recs[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # a fresh adapter is the reference
    assert recs[0]["rewards_margin"] == pytest.approx(0.0, abs=1e-6)
    last = recs[-4:]
    assert sum(r["rewards_accuracy"] for r in last) / 4 > 0.5
    assert sum(r["loss"] for r in last) / 4 < 0.69
    assert all(r["target_tokens"] > 0 and r["tokens"] > r["target_tokens"] for r in recs)
    for key in ("rewards_chosen", "rewards_rejected", "logps_chosen", "logps_rejected"):
        assert all(isinstance(r[key], float) for r in recs), key
    start = next(r for r in read_metrics(Path(config.output_dir) / METRICS_FILE) if r["type"] == "start")
    assert start["num_examples"] == 16 and start["token_stats"]["kind"] == "preference"


@pytest.mark.parametrize("loss_type", ["ipo", "simpo"])
def test_other_losses_train(make_config, loss_type: str) -> None:
    config = make_config(pair_rows(12), name=loss_type, max_steps=8, loss_type=loss_type, rpo_alpha=0.2,
                         validation_fraction=0.2, eval_every_steps=4, **DPO)  # fmt: skip
    assert run(config) == EXIT_OK
    recs = read_metrics(Path(config.output_dir) / METRICS_FILE)
    evals = [r for r in recs if r["type"] == "eval"]
    assert [e["step"] for e in evals] == [4, 8]
    assert all(e["eval_loss"] is not None and e["rewards_accuracy"] is not None for e in evals)
    assert (Path(config.output_dir) / ADAPTER_DIR / "adapter_model.safetensors").is_file()


def test_qlora_dpo_trains_on_the_cpu(make_config) -> None:
    config = make_config(pair_rows(12), name="qlora", max_steps=6, method="qlora", lora_dropout=0.05, **DPO)
    assert run(config) == EXIT_OK
    recs = steps(Path(config.output_dir))
    assert len(recs) == 6 and recs[-1]["loss"] < recs[0]["loss"]


def test_sft_then_dpo_from_its_adapter(make_config, tiny_model: Path) -> None:
    """init_from: the DPO job starts from the SFT adapter, which is also its frozen reference (so its
    first step's loss is log 2 although the adapter is not zero); the result loads with peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    sft = make_config(qa_rows(12), name="sft", max_steps=6)
    assert run(sft) == EXIT_OK
    sft_adapter = Path(sft.output_dir) / ADAPTER_DIR
    dpo_config = make_config(pair_rows(16), name="dpo2", max_steps=8, init_from="jobsft0001", **DPO)
    dpo_config = dpo_config.model_copy(update={"init_adapter_dir": str(sft_adapter)})
    assert run(dpo_config) == EXIT_OK
    recs = steps(Path(dpo_config.output_dir))
    assert recs[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # policy = reference at the start
    out = Path(dpo_config.output_dir) / ADAPTER_DIR
    assert not (out / "ref").exists()  # only the trained adapter is exported
    trained, start = (
        adapter(Path(dpo_config.output_dir)),
        load_file(sft_adapter / "adapter_model.safetensors"),
    )
    assert trained.keys() == start.keys()
    assert max(float((trained[k] - start[k]).abs().max()) for k in start) > 0
    net = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), out)
    assert list(net.peft_config) == ["default"]
    with torch.no_grad():
        net(input_ids=torch.tensor([[1, 2, 3]]))


SPLITS = {
    "micro 4 x accum 1": {"micro_batch_size": 4, "gradient_accumulation_steps": 1},
    "micro 1 x accum 4": {"micro_batch_size": 1, "gradient_accumulation_steps": 4},
    "2 ranks x micro 2": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "num_gpus": 2},
}
CONTROL = {"micro_batch_size": 2, "gradient_accumulation_steps": 1}  # a global batch of 2 pairs, not 4
SPLIT_SPEC = {"epochs": 2, "lora_dropout": 0.1, "lr_scheduler": "cosine", "warmup_steps": 1,
              "max_seq_len": 64, "rpo_alpha": 0.3, **DPO}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_every_split_of_the_global_batch_trains_the_same_adapter(
    make_config, tmp_path: Path, packing: bool
) -> None:
    """Pairs: micro 4 x accumulation 1, micro 1 x accumulation 4 and 2 FSDP ranks (torchrun, gloo) x micro 2
    give the same losses and adapter within 1e-4 relative; a global batch of 2 pairs does not."""
    rows = pair_rows(22)  # the last step of an epoch is short
    configs = {
        name: make_config(rows, name=f"split{i}", packing=packing, **SPLIT_SPEC, **split)
        for i, (name, split) in enumerate({**SPLITS, "control": CONTROL}.items())
    }
    path = tmp_path / "fsdp.json"
    path.write_text(configs["2 ranks x micro 2"].model_dump_json())
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    proc = subprocess.Popen(training_command(path), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    for name in ("micro 4 x accum 1", "micro 1 x accum 4", "control"):  # while the two ranks train
        assert run(configs[name]) == EXIT_OK, name
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log
    assert "FSDP over 2 processes" in log

    outs = {name: Path(c.output_dir) for name, c in configs.items()}
    ref = outs["micro 4 x accum 1"]
    assert len(losses(ref)) >= 10
    for name in SPLITS:
        assert losses(outs[name]) == pytest.approx(losses(ref), rel=1e-5), name
        for key in ("rewards_accuracy", "logps_chosen", "logps_rejected"):
            got = [r[key] for r in steps(outs[name])]
            assert got == pytest.approx([r[key] for r in steps(ref)], rel=1e-4, abs=1e-6), (name, key)
        # a reward is beta x (policy - reference log-prob), a margin the difference of two: near the start
        # both are far smaller than the log-probs, so fp32 leaves them an absolute precision of about
        # beta x |log-prob| x 1e-6, not a relative one
        for key in ("rewards_chosen", "rewards_rejected", "rewards_margin"):
            for got, want in zip(steps(outs[name]), steps(ref), strict=True):
                scale = DPO["beta"] * max(abs(want["logps_chosen"]), abs(want["logps_rejected"]))
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6 * scale), (name, key)
    diffs = {name: relative_difference(adapter(ref), adapter(outs[name])) for name in SPLITS}
    worst = {name: elementwise(adapter(ref), adapter(outs[name])) for name in SPLITS}
    control = relative_difference(adapter(ref), adapter(outs["control"]))
    kind = "packed" if packing else "padded"
    print(f"\n{kind} dpo: relative difference to micro 4 x accum 1 (elementwise): "
          + ", ".join(f"{k} {v:.1e} ({worst[k]:.1e})" for k, v in diffs.items() if v)
          + f"; control (global batch 2) {control:.2f}")  # fmt: skip
    assert all(d < 1e-4 for d in diffs.values()), diffs
    assert control > 1e-2


@pytest.mark.slow
def test_kill_9_mid_run_resumes_to_the_uninterrupted_adapter(make_config, tmp_path: Path) -> None:
    """`python -m training.run` killed with SIGKILL after its step-3 checkpoint (no chance to save
    anything more) resumes from it to the adapter and losses of a run that was never interrupted."""
    kw = {"epochs": 3, "lora_dropout": 0.1, "lr_scheduler": "cosine", "checkpoint_every_steps": 1, **DPO}
    full = make_config(pair_rows(12), name="full", **kw)
    parted = make_config(pair_rows(12), name="parted", **kw)
    out_full, out_parted = Path(full.output_dir), Path(parted.output_dir)
    assert run(full) == EXIT_OK

    path = tmp_path / "parted.json"
    path.write_text(parted.model_dump_json())
    proc = subprocess.Popen([sys.executable, "-m", "training.run", str(path)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (out_parted / CHECKPOINTS_DIR / "step-00000003").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out_parted / ADAPTER_DIR).exists()
    assert run(parted) == EXIT_OK

    starts = [r for r in read_metrics(out_parted / METRICS_FILE) if r["type"] == "start"]
    resumed = starts[-1]["resumed_from_step"]
    assert len(starts) == 2 and 3 <= resumed < len(losses(out_full))
    assert losses(out_parted) == pytest.approx(losses(out_full), abs=1e-5)
    a, b = adapter(out_full), adapter(out_parted)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0)
    rewards = [r["rewards_accuracy"] for r in steps(out_parted)]
    assert rewards == pytest.approx([r["rewards_accuracy"] for r in steps(out_full)])
    json.dumps(rewards)


@pytest.mark.slow
def test_fsdp_continuing_from_an_adapter_equals_one_process(make_config, tmp_path: Path) -> None:
    """init_from under FSDP: both adapters (trained and frozen reference) are sharded with the base; 2 gloo
    ranks x micro 2 train what one process does with micro 4. Without dropout the adapters agree within
    1e-6 relative. With LoRA dropout a few elements whose gradient is rounding noise get an Adam update of
    about lr whose size that noise decides (tests/training/util.relative_difference); the SFT adapter's
    small B makes one such element weigh ~5e-4 of its tensor, so the rest is checked elementwise."""
    sft = make_config(qa_rows(12), name="sftbase", max_steps=4)
    assert run(sft) == EXIT_OK
    init = {"init_adapter_dir": str(Path(sft.output_dir) / ADAPTER_DIR)}
    kw = {"max_steps": 4, "lora_dropout": 0.1, "init_from": "jobsftbase", **DPO}
    one = make_config(pair_rows(16), name="one", micro_batch_size=4, gradient_accumulation_steps=1, **kw)
    two = make_config(pair_rows(16), name="two", micro_batch_size=2, gradient_accumulation_steps=1,
                      num_gpus=2, **kw)  # fmt: skip
    one, two = one.model_copy(update=init), two.model_copy(update=init)
    path = tmp_path / "two.json"
    path.write_text(two.model_dump_json())
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    proc = subprocess.Popen(training_command(path), cwd=REPO, **out)  # type: ignore[call-overload]
    assert run(one) == EXIT_OK
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log
    out_one, out_two = Path(one.output_dir), Path(two.output_dir)
    assert losses(out_one)[1] == pytest.approx(0.6931, abs=0.01)  # near log 2: only dropout differs
    assert losses(out_two) == pytest.approx(losses(out_one), rel=1e-5)
    norms = [[r["grad_norm"] for r in steps(out)] for out in (out_one, out_two)]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)
    a, b = adapter(out_one), adapter(out_two)
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    print(f"\nfsdp + init_from: relative difference {relative_difference(a, b):.1e}; "
          f"{int((diff > 1e-5).sum())} of {diff.numel()} elements differ by more than 1e-5")  # fmt: skip
    # The noise-decided elements: a few in a thousand (34 of 16,384 on this 2-core machine, 16 or fewer on
    # the machine where CI passed it under a bound of 16: the count follows the CPU), each moved by at
    # most Adam's ~lr a step.
    assert int((diff > 1e-5).sum()) <= diff.numel() // 200
    assert float(diff.max()) <= kw["max_steps"] * DPO["learning_rate"]
    assert float(diff.max()) < 2 * 5e-3  # at most about one Adam step of lr apart
