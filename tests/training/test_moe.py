"""Mixture-of-experts bases in the engine (tiny random-weight Qwen3-MoE and Mixtral, training.demo_moe):
what load_model wraps, the router's load-balancing loss as transformers computes it, a run through
`training.run` whose adapter changes the model's output, and the planner against the measured peak."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.arch import load_architecture
from core.run_protocol import EXIT_OK
from core.spec import JobSpec
from core.storage import ADAPTER_DIR, CHECKPOINTS_DIR, METRICS_FILE
from planner import BatchShape
from planner.feasibility import device_gpu, plan_on
from tests.training.util import qa_rows, read_metrics, write_jsonl
from training import moe
from training.checkpoint import checkpoint_name
from training.data import Tokenized
from training.demo_moe import MoeSize, build_moe_model
from training.loss import TARGET_KEYS
from training.model import load_model
from training.run import run
from training.step import make_batch

CPU = torch.device("cpu")
EXPERTS = ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]


def job(**kw) -> JobSpec:
    return JobSpec(**{"base_model": "moe", "dataset_id": "testdata01", "lora_dropout": 0.0, **kw})


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize(
    ("targets", "method"), [("all-linear", "lora"), (EXPERTS, "lora"), (EXPERTS, "qlora")]
)
def test_load_model_wraps_what_the_planner_counts(moe_models, family: str, targets, method: str) -> None:
    spec = job(lora_target_modules=targets, method=method, lora_r=4)
    net = load_model(spec, moe_models[family], CPU)
    trainable = {n: p.numel() for n, p in net.named_parameters() if p.requires_grad}
    assert sum(trainable.values()) == load_architecture(moe_models[family]).lora_params(targets, 4)
    assert not any(".mlp.gate." in n for n in trainable)  # the router is never trained
    assert any(".mlp.experts." in n for n in trainable) == (targets == EXPERTS)


def test_the_aux_loss_is_transformers_per_example(moe_models) -> None:
    """For one unpadded example the term is transformers' router_aux_loss_coef x aux_loss exactly; for a
    packed micro-batch it is each example's, weighted by its share of the step's tokens."""
    net = load_model(job(), moe_models["qwen3_moe"], CPU)
    base = net.get_base_model()
    assert moe.aux_loss_coef(net) == pytest.approx(0.05) and base.config.output_router_logits
    g = torch.Generator().manual_seed(0)
    examples = [torch.randint(5, 1000, (n,), generator=g) for n in (9, 14, 6)]
    items = [Tokenized(input_ids=e.tolist(), labels=e.tolist()) for e in examples]
    with torch.no_grad():
        alone = [float(base(input_ids=e[None], output_router_logits=True).aux_loss) for e in examples]
        step_tokens = 40  # the step holds more than this micro-batch: weights are shares of the step's
        for packing in (True, False):
            spec = job(packing=packing)
            routes = moe.routes(spec, items, [0, 1, 2], step_tokens)
            batch = make_batch(spec, items, [0, 1, 2], pad_id=0)  # as a training step collates it
            inputs = {k: v for k, v in batch.items() if k not in TARGET_KEYS and k != "labels"}
            with moe.router_logits(net, routes) as router:
                base(**inputs)
            expected = 0.05 * sum(len(e) / step_tokens * a for e, a in zip(examples, alone, strict=True))
            width = batch["input_ids"].shape[-1]  # type: ignore[union-attr]
            assert float(router.loss(width)) == pytest.approx(expected, rel=1e-5), packing


@pytest.mark.parametrize(("family", "targets"), [("qwen3_moe", "all-linear"), ("mixtral", EXPERTS)])
def test_a_tiny_moe_job_trains_an_adapter_that_changes_the_output(
    make_config, moe_models, tmp_path: Path, family: str, targets
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = make_config(
        qa_rows(16), model_dir=moe_models[family], name=family, epochs=3, learning_rate=2e-2,
        lora_target_modules=targets,
    )  # fmt: skip
    assert run(config) == EXIT_OK
    out = Path(config.output_dir)
    steps = [r for r in read_metrics(out / METRICS_FILE) if r["type"] == "step"]
    assert steps[-1]["loss"] < steps[0]["loss"]
    ids = torch.tensor([[3, 17, 99, 250, 7, 64]])
    base = AutoModelForCausalLM.from_pretrained(moe_models[family], local_files_only=True)
    with torch.no_grad():
        before = base(input_ids=ids).logits
        tuned = PeftModel.from_pretrained(base, out / ADAPTER_DIR)
        after = tuned(input_ids=ids).logits
    assert (after - before).abs().max() > 1e-3
    with torch.no_grad(), tuned.disable_adapter():
        assert torch.equal(tuned(input_ids=ids).logits, before)


WIDE = MoeSize(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, expert_intermediate=176,
               num_experts=8, top_k=2, vocab_size=512)  # fmt: skip
SEQ = 128
# family, aux loss, method, checkpointing, micro-batch, LoRA dropout, targets, mixed precision
MEASURED = [
    ("qwen3_moe", None, "lora", False, 4, 0.0, "all-linear", "no"),
    ("qwen3_moe", 0.05, "lora", True, 4, 0.0, "all-linear", "no"),
    ("qwen3_moe", None, "qlora", True, 4, 0.05, "all-linear", "no"),
    ("qwen3_moe", None, "lora", False, 4, 0.0, EXPERTS, "no"),
    ("mixtral", None, "lora", True, 4, 0.0, EXPERTS, "no"),
    ("mixtral", None, "lora", False, 4, 0.05, "all-linear", "bf16"),
]


@pytest.mark.parametrize(("family", "aux", "method", "ckpt", "batch", "dropout", "targets", "amp"), MEASURED)
def test_planner_within_15_percent_of_the_measured_peak(
    models_dir: Path, tmp_path: Path, family, aux, method, ckpt, batch, dropout, targets, amp
) -> None:
    model_dir = build_moe_model(
        models_dir, name=f"wide-{family}-{aux}", family=family, size=WIDE, aux_loss_coef=aux
    )
    lines = (Path(__file__).parents[2] / "training" / "demo_corpus.txt").read_text().splitlines()
    rows = [{"text": " ".join(lines[(7 * i + j) % len(lines)] for j in range(40))} for i in range(12)]
    spec = job(
        method=method, gradient_checkpointing=ckpt, micro_batch_size=batch, lora_dropout=dropout,
        lora_target_modules=targets, mixed_precision=amp, gradient_accumulation_steps=2, lora_r=8,
        lora_alpha=16, max_seq_len=SEQ, max_steps=2, checkpoint_every_steps=0,
    )  # fmt: skip
    from core.run_protocol import RunConfig

    config = RunConfig(job_id="jobmoe", spec=spec, model_dir=str(model_dir),
                       dataset_path=str(write_jsonl(tmp_path / "long.jsonl", rows)),
                       output_dir=str(tmp_path / "out"))  # fmt: skip
    assert run(config) == EXIT_OK
    records = read_metrics(tmp_path / "out" / METRICS_FILE)
    start = next(r for r in records if r["type"] == "start")
    measured = [r for r in records if r["type"] == "step"][-1]["peak_mem_bytes"]
    shape = BatchShape.from_token_stats(start["token_stats"])
    cpu = device_gpu({"kind": "cpu", "name": "cpu", "memory_bytes": 64 * 2**30})
    predicted = start["predicted_peak_bytes"]
    assert predicted == plan_on(spec, load_architecture(model_dir), cpu, shape=shape).allocated_bytes
    error = (predicted - measured) / measured
    what = f"{family} aux={aux} {method} ckpt={ckpt} batch={batch} dropout={dropout} {targets} amp={amp}"
    print(
        f"\n{what}: predicted {predicted / 2**20:.3f} MiB, measured {measured / 2**20:.3f} MiB, {error:+.1%}"
    )
    assert abs(error) <= 0.15


@pytest.mark.parametrize("source", ["checkpoint", "adapter"])
def test_a_moe_job_continues_from_an_earlier_jobs_expert_adapter(
    make_config, moe_models, source: str
) -> None:
    """spec.init_from on a MoE base, from a checkpoint (its spec's names, resolved again as attach_lora
    resolves them) or a final adapter (peft's saved target_parameters): the first step of the continued
    run uses the weights the first run's step 3 used, so it logs the same loss."""
    one_batch = {"max_steps": 3, "checkpoint_every_steps": 1, "micro_batch_size": 2,
                 "gradient_accumulation_steps": 2, "lora_target_modules": EXPERTS}  # fmt: skip
    first = make_config(qa_rows(4), model_dir=moe_models["mixtral"], name=f"first{source}", **one_batch)
    assert run(first) == EXIT_OK
    out = Path(first.output_dir)
    init = out / CHECKPOINTS_DIR / checkpoint_name(2) if source == "checkpoint" else out / ADAPTER_DIR
    again = make_config(qa_rows(4), model_dir=moe_models["mixtral"], name=f"again{source}",
                        init_from="jobfirst", init_from_step=2 if source == "checkpoint" else None,
                        **{**one_batch, "max_steps": 1})  # fmt: skip
    assert run(again.model_copy(update={"init_adapter_dir": str(init)})) == EXIT_OK
    losses, restarted = (
        [r["loss"] for r in read_metrics(Path(c.output_dir) / METRICS_FILE) if r["type"] == "step"]
        for c in (first, again)
    )
    expected = losses[2] if source == "checkpoint" else None
    if expected is not None:
        assert restarted[0] == pytest.approx(expected, rel=1e-5), (restarted, losses)
    else:  # the final adapter holds step 3's update too: a loss below the first run's last
        assert restarted[0] < losses[2]
