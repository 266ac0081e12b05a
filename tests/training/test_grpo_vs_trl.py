"""ftune's GRPO objective is TRL 1.16's: training.objectives.grpo.loss against GRPOTrainer's own code on a
tiny Llama in float64 (trl is a test-only dependency, pinned in pyproject.toml).

The loss and the model's gradient: TRL's `_compute_loss(model, inputs)` on fixed inputs (prompts,
completions, advantages, old and reference log-probs, num_items_in_batch) against per_token_logps +
grpo_token_loss on the same model's logits, for all 64 combinations of loss type, beta, clip range,
importance-sampling level and old log-probs absent / given: equal to 1e-12. TRL 1.16 scores tokens with
a fused LM head (trl.kernels.chunked_logprob) that works in fp32 whatever the model's dtype, so an fp64
comparison there stops at fp32's ~1e-7; for the loss it is swapped for TRL's selective_log_softmax on
the model's fp64 logits (the rest of `_compute_loss` is TRL's own), and the fused head is checked
separately to fp32 precision. Advantages: TRL's `_generate_and_score_completions` run for real (the
tiny model generates; a reward function reads each row's reward from the dataset, None for
unscorable) against group_advantages. Accumulation: micro-batches normalised by the step's totals add
up to the whole batch's loss and gradient.
"""

from __future__ import annotations

import math
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from training.objectives.grpo import loss as grpo_loss
from training.objectives.grpo.loss import StepTotals, grpo_token_loss, per_token_logps

trl = pytest.importorskip("trl")

TOL = 1e-12
TEMPERATURE = 0.7
MAX_COMPLETION_LENGTH = 9  # above the batch's completion width: dr_grpo divides by the configured length
NUM_GENERATIONS = 3
B, P, C = 6, 4, 7  # sequences, prompt width, completion width
COMPLETION_LENGTHS = [7, 5, 2, 7, 1, 0]
PROMPT_LENGTHS = [4, 3, 4, 2, 4, 1]


def dataset_reward(completions: list[Any], reward: list[float | None], **kwargs: Any) -> list[float | None]:
    """The row's own reward column: the test chooses every reward, None included."""
    return list(reward)


def trl_logps_fp64(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
    """Stand-in for GRPOTrainer._get_per_token_logps_and_entropies on the model's fp64 logits:
    TRL's selective_log_softmax (its fused head would round to fp32)."""
    from trl.trainer.utils import selective_log_softmax

    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, -logits_to_keep - 1 : -1]
    logps = selective_log_softmax(logits, input_ids[:, -logits_to_keep:], self.temperature)
    return logps, torch.zeros_like(logps), None


@pytest.fixture(scope="module")
def trainer(tiny_model: Path, tokenizer, tmp_path_factory: pytest.TempPathFactory):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    out_dir = str(tmp_path_factory.mktemp("grpo_trl"))
    # GRPOConfig's mapping of the legacy scale_rewards; first: a config resets accelerate's state
    legacy = {
        b: trl.GRPOConfig(output_dir=out_dir, scale_rewards=b, use_cpu=True).scale_rewards
        for b in (True, False)
    }
    args = trl.GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=B,
        num_generations=NUM_GENERATIONS, max_completion_length=MAX_COMPLETION_LENGTH,
        temperature=TEMPERATURE, beta=0.0, use_cpu=True, bf16=False, fp16=False, report_to=[], seed=0,
    )  # fmt: skip
    net = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    rows = [{"prompt": f"Question {i}:", "reward": 1.0} for i in range(B)]
    out = trl.GRPOTrainer(
        model=net, reward_funcs=[dataset_reward], args=args, train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )  # fmt: skip
    out.fused_logps = out._get_per_token_logps_and_entropies
    out._get_per_token_logps_and_entropies = types.MethodType(trl_logps_fp64, out)
    out.current_gradient_accumulation_steps = 1
    out.legacy_scale = legacy
    out.model.train()
    return out


@pytest.fixture(scope="module")
def inputs(trainer) -> dict[str, torch.Tensor]:
    """Fixed inputs as _generate_and_score_completions hands them to _compute_loss: left-padded prompts,
    right-padded completions (one empty), and old / reference log-probs away from the policy's so that
    both clip bounds and the KL are active."""
    g = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    prompt_mask = (torch.arange(P) >= P - torch.tensor(PROMPT_LENGTHS)[:, None]).long()
    completion_mask = (torch.arange(C) < torch.tensor(COMPLETION_LENGTHS)[:, None]).long()
    pad = trainer.processing_class.pad_token_id
    prompt_ids = torch.randint(0, vocab, (B, P), generator=g).masked_fill(prompt_mask == 0, pad)
    completion_ids = torch.randint(0, vocab, (B, C), generator=g).masked_fill(completion_mask == 0, pad)
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
             "completion_mask": completion_mask}  # fmt: skip
    with torch.no_grad():
        logps = ftune_logps(trainer.model, batch)
    noise = lambda scale: scale * torch.randn(B, C, generator=g, dtype=torch.float64)  # noqa: E731
    # per sequence, old - logp: a ratio above 1 + eps_high where the advantage is positive, one below
    # 1 - eps_low where it is negative, so that sequence-level ratios clip both ways too
    offsets = torch.tensor([[-0.45], [0.45], [-0.1], [-0.4], [0.3], [0.0]], dtype=torch.float64)
    return {
        **batch,
        "advantages": torch.tensor([1.0, -0.5, 0.8, -1.2, 0.3, -0.7], dtype=torch.float64),
        "old_per_token_logps": logps + offsets + noise(0.3),
        "ref_per_token_logps": logps + noise(0.3),
        "num_items_in_batch": completion_mask.sum(),
    }


def ftune_logps(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The completion tokens' log-probs: logits of prompt + completion, shifted by one."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=mask).logits
    width = batch["completion_ids"].shape[1]
    return per_token_logps(logits[:, -width - 1 : -1], batch["completion_ids"], TEMPERATURE)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a and a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def ftune_loss(model, batch: dict[str, torch.Tensor], cfg: dict[str, Any], normalizer=None):
    return grpo_token_loss(
        ftune_logps(model, batch), batch["completion_mask"], batch["advantages"],
        old_per_token_logps=batch.get("old_per_token_logps"),
        ref_per_token_logps=batch["ref_per_token_logps"] if cfg["beta"] else None,
        max_completion_length=MAX_COMPLETION_LENGTH, normalizer=normalizer, **cfg,
    )  # fmt: skip


@pytest.mark.parametrize("old", [False, True], ids=["on-policy", "old-logps"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.2, 0.28)], ids=["eps0.2", "eps0.2-0.28"])
@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["beta0", "beta0.04"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_gradient_and_metrics_equal_trl(
    trainer, inputs, loss_type: str, beta: float, eps: tuple[float, float], level: str, old: bool
) -> None:
    cfg = {"loss_type": loss_type, "beta": beta, "epsilon_low": eps[0], "epsilon_high": eps[1],
           "importance_sampling_level": level}  # fmt: skip
    for k, v in cfg.items():
        setattr(trainer, k, v)
    batch = dict(inputs) if old else {k: v for k, v in inputs.items() if k != "old_per_token_logps"}
    if not beta:
        batch.pop("ref_per_token_logps")
    net = trainer.model
    trainer._metrics["train"].clear()
    net.zero_grad(set_to_none=True)
    theirs = trainer._compute_loss(net, batch)
    theirs.backward()
    theirs = theirs.detach()
    their_grads = grads(net)
    their_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    net.zero_grad(set_to_none=True)
    ours, stats = ftune_loss(net, {**batch, "ref_per_token_logps": inputs["ref_per_token_logps"]}, cfg)
    ours.backward()
    ours = ours.detach()
    our_grads = grads(net)

    assert abs(float(ours) - float(theirs)) <= TOL, (float(ours), float(theirs))
    assert max(float(g.abs().max()) for g in their_grads.values()) > 1e-3  # a real gradient
    assert max_diff(our_grads, their_grads) <= TOL
    our_metrics = grpo_loss.metrics(stats.tolist())
    assert our_metrics.keys() <= their_metrics.keys()
    assert ("kl" in our_metrics) == bool(beta)
    for name, value in our_metrics.items():  # TRL's are fp32 (a float mask of the clipped tokens)
        assert value == pytest.approx(their_metrics[name], rel=1e-6, abs=1e-9), name
    if old:  # the fixture's old log-probs are far enough away for both bounds to clip
        assert our_metrics["clip_ratio/low_mean"] > 0 and our_metrics["clip_ratio/high_mean"] > 0


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_micro_batches_add_up_to_the_step(trainer, inputs, loss_type: str, level: str) -> None:
    """Micro-batches of 2, 1 and 3 sequences (12, 2 and 8 completion tokens), each normalised by the
    step's totals, sum to the whole batch's loss, gradient and metric sums: the rule that TRL's own bnpo
    (a mean of micro-batch token means) breaks under accumulation."""
    cfg = {"loss_type": loss_type, "beta": 0.04, "epsilon_low": 0.2, "epsilon_high": 0.28,
           "importance_sampling_level": level}  # fmt: skip
    net = trainer.model
    net.zero_grad(set_to_none=True)
    whole, whole_stats = ftune_loss(net, inputs, cfg)
    whole.backward()
    whole = whole.detach()
    whole_grads = grads(net)

    totals = StepTotals(sequences=B, completion_tokens=sum(COMPLETION_LENGTHS))
    net.zero_grad(set_to_none=True)
    total, stats = (
        torch.zeros((), dtype=torch.float64),
        torch.zeros(len(grpo_loss.STAT_NAMES), dtype=torch.float64),
    )
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        part = {k: (v[rows] if v.dim() else v) for k, v in inputs.items()}
        loss, s = ftune_loss(net, part, cfg, normalizer=totals)
        loss.backward()
        total, stats = total + loss.detach(), stats + s
    assert abs(float(total) - float(whole)) <= TOL
    assert max_diff(grads(net), whole_grads) <= TOL
    assert torch.allclose(stats, whole_stats, rtol=0, atol=TOL)


REWARDS: list[float | None] = [1.0, 0.5, None, 2.0, 2.0, 2.0, None, None, None, -1.0, 3.0, 0.25]


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none", True, False])
def test_advantages_equal_trl(trainer, scale_rewards: grpo_loss.ScaleRewards | bool) -> None:
    """Groups: one unscorable completion; equal rewards (std 0); all unscorable; an ordinary one. The
    legacy True / False go through GRPOConfig's own mapping."""
    trainer.scale_rewards = trainer.legacy_scale.get(scale_rewards, scale_rewards)
    trainer.beta = 0.0  # the loss tests leave theirs; no reference forward here
    rows = [{"prompt": f"Question {i // NUM_GENERATIONS}:", "reward": r} for i, r in enumerate(REWARDS)]
    with torch.no_grad():
        theirs = trainer._generate_and_score_completions(rows)["advantages"]
    rewards = torch.tensor([math.nan if r is None else r for r in REWARDS], dtype=torch.float32)
    ours = grpo_loss.group_advantages(rewards, NUM_GENERATIONS, scale_rewards)
    assert ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs), (ours, theirs)
    assert not ours.isnan().any() and (ours[6:9] == 0).all()
    if scale_rewards in ("group", True):
        assert (ours[2] == 0) and (ours[3:6] == 0).all()


def test_per_token_logps_equals_trls_fused_head_to_fp32(trainer, inputs) -> None:
    """TRL 1.16's fused LM head (fp32 whatever the model's dtype) against ours on fp64 logits."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        theirs, _, _ = trainer.fused_logps(trainer.model, ids, mask, C, compute_entropy=True)
        ours = ftune_logps(trainer.model, inputs)
    m = inputs["completion_mask"].bool()
    assert theirs.dtype == torch.float32 and ours.dtype == torch.float64  # TRL returns fp32 from fp64
    assert float((ours - theirs.double())[m].abs().max()) < 1e-5
    assert (theirs[~m] == 0).all()  # TRL zeroes padded positions; grpo_token_loss masks them instead


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_elements", [1 << 25, 3 * 50])  # one chunk; 3 rows a chunk
def test_per_token_logps_value_and_gradient(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, chunk_elements: int
) -> None:
    """Against log_softmax(logits / T).gather by autograd in fp64; computed in fp32 from bf16 logits
    (TRL's selective_log_softmax stays in bf16 there; its fused head works in fp32, as here)."""
    monkeypatch.setattr(grpo_loss, "_CHUNK_ELEMENTS", chunk_elements)
    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(2, 5, 50, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    ids = torch.randint(0, 50, (2, 5), generator=g)
    weights = torch.randn(2, 5, generator=g, dtype=torch.float64)
    ours = per_token_logps(logits, ids, TEMPERATURE)
    (ours.double() * weights).sum().backward()
    assert ours.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)

    ref_logits = logits.detach().double().requires_grad_()
    ref = torch.log_softmax(ref_logits / TEMPERATURE, -1).gather(-1, ids[..., None]).squeeze(-1)
    (ref * weights).sum().backward()
    assert logits.grad is not None and ref_logits.grad is not None and logits.grad.dtype == dtype
    tol = {torch.float64: TOL, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    assert float((ours.detach().double() - ref.detach()).abs().max()) <= (
        TOL if dtype == torch.float64 else 1e-5
    )
    assert float((logits.grad.double() - ref_logits.grad).abs().max()) <= tol


def test_grpo_loss_rejects_a_kl_without_reference_log_probs() -> None:
    x = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="ref_per_token_logps"):
        grpo_token_loss(x, torch.ones(2, 3), torch.ones(2), beta=0.1, max_completion_length=3)


def test_defaults_are_trls_and_what_is_left_out_is_off_there() -> None:
    """grpo_loss's defaults are GRPOConfig's, and the features it leaves out are off by default."""
    import dataclasses
    import inspect

    trl_defaults = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    ours = inspect.signature(grpo_token_loss).parameters
    assert ours["loss_type"].default == trl_defaults["loss_type"] == "dapo"
    assert ours["beta"].default == trl_defaults["beta"] == 0.0
    assert ours["epsilon_low"].default == ours["epsilon_high"].default == trl_defaults["epsilon"] == 0.2
    assert trl_defaults["epsilon_high"] is None  # = epsilon
    assert ours["importance_sampling_level"].default == trl_defaults["importance_sampling_level"] == "token"
    assert ours["kl_bias_correction"].default is trl_defaults["use_bias_correction_kl"] is True
    scale = inspect.signature(grpo_loss.group_advantages).parameters["scale_rewards"].default
    assert scale == trl_defaults["scale_rewards"] == "group"
    assert trl_defaults["multi_objective_aggregation"] == "sum_then_normalize"
    off = {"delta": None, "top_entropy_quantile": 1.0, "entropy_coef": 0.0, "off_policy_mask_threshold": None,
           "use_vllm": False, "mask_truncated_completions": False}  # fmt: skip
    assert {k: trl_defaults[k] for k in off} == off
