"""ftune's DPO is TRL's DPO: the same tiny Llama, LoRA config, pairs and beta give the same tokens, loss,
metrics and LoRA gradients as TRL's DPOTrainer (trl is a test-only dependency, pinned in pyproject.toml).

TRL's trainer is driven on one batch: its own tokenization (DPOTrainer._prepare_dataset), its own
collator (DataCollatorForPreference) and `trainer.compute_loss` + backward. ftune's side is
training.objectives.dpo.loss.micro_batch_loss on a micro-batch holding the whole step (so the step's
normalisers are the batch's), padded and packed. The adapters start equal and away from zero (LoRA B is 0
at init, where policy = reference and every loss is trivially log 2), and both reference policies are checked:
the adapter disabled (a fresh adapter), and a frozen copy of the starting adapter (a job continuing
from an earlier one: TRL's "ref" adapter, ftune's spec.init_from). SimPO, which TRL's DPOTrainer does
not have, is checked against the paper's formula computed here from one forward per sequence.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from core.data.examples import to_preference
from core.spec import JobSpec
from training import model
from training.objectives.dpo import loss as dpo
from training.objectives.dpo.metrics import metrics
from training.objectives.dpo.pairs import Sequences, fit_pair, sequence_indices, tokenize_pair
from training.step import Parts, make_batch, make_optimizer

trl = pytest.importorskip("trl")

RTOL = 1e-5
BETA = 0.1
Q = ["What is the capital of France?", "Name a prime number.", "Say hello.", "How many legs has a cat?"]
GOOD = ["Paris is the capital.", "Seven.", "Hello there, friend!", "A cat has four legs."]
BAD = ["Berlin, I think.", "Nine is prime.", "No.", "Cats have six legs and a tail."]


def rows() -> list[dict[str, Any]]:
    out = []
    for i, (q, g, b) in enumerate(zip(Q, GOOD, BAD, strict=True)):
        prompt = [{"role": "user", "content": q}]
        if i == 1:  # a system message and an earlier turn in the prompt
            prompt = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi."},
                {"role": "assistant", "content": "Hello."},
                *prompt,
            ]
        out.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": g}],
                    "rejected": [{"role": "assistant", "content": b}]})  # fmt: skip
    return out


def spec_for(loss_type: str = "sigmoid", rpo_alpha: float = 0.0, packing: bool = False, **kw: Any) -> JobSpec:
    extra = {"simpo_gamma": kw.pop("simpo_gamma")} if "simpo_gamma" in kw else {}
    return JobSpec(
        base_model="tiny", dataset_id="testdata01", objective="dpo", beta=BETA, loss_type=loss_type,
        rpo_alpha=rpo_alpha, lora_r=8, lora_alpha=16, lora_dropout=0.0, packing=packing,
        max_seq_len=256, **extra, **kw,
    )  # fmt: skip


def lora_config(spec: JobSpec):
    from peft import LoraConfig

    return LoraConfig(
        r=spec.lora_r, lora_alpha=spec.lora_alpha, lora_dropout=0.0, target_modules="all-linear",
        bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip


def perturb(net: torch.nn.Module, seed: int, adapter: str = "default") -> None:
    """Random LoRA weights (B too), so the policy differs from the base."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if ".lora_" in name and f".{adapter}." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def lora_state(net: torch.nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters() if ".lora_" in n and f".{adapter}." in n}


def load_into(net: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(net.named_parameters())
    with torch.no_grad():
        for n, v in state.items():
            params[n].copy_(v)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def trl_trainer(
    tiny_model: Path, tokenizer, tmp_path: Path, spec: JobSpec, rpo_alpha: float, peft_model=None
):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    loss_type, weights = [spec.loss_type], None
    if rpo_alpha:
        loss_type, weights = [spec.loss_type, "sft"], [1.0, rpo_alpha]
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"), beta=BETA, loss_type=loss_type, loss_weights=weights,
        max_length=None, gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
        report_to=[], per_device_train_batch_size=len(Q), disable_dropout=True, seed=0,
    )  # fmt: skip
    if peft_model is None:
        base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        kwargs: dict[str, Any] = {"model": base, "peft_config": lora_config(spec)}
    else:
        kwargs = {"model": peft_model}
    trainer = trl.DPOTrainer(
        args=args, train_dataset=Dataset.from_list(rows()), processing_class=tokenizer, **kwargs
    )
    return trainer


def trl_loss_and_grads(trainer) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    examples = [trainer.train_dataset[i] for i in range(len(Q))]
    inputs = trainer.data_collator(examples)
    net = trainer.model
    net.train()
    net.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(net, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


def ftune_parts(spec: JobSpec, tiny_model: Path, init_adapter: Path | None = None) -> Parts:
    torch.manual_seed(0)
    net = model.load_model(spec, tiny_model, torch.device("cpu"), init_adapter=init_adapter)
    params = [p for _, p in model.trainable_parameters(net)]
    return Parts(spec, net, make_optimizer(spec, params), params, torch.device("cpu"))


def ftune_loss_and_grads(parts: Parts, tokenizer) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict]:
    spec = parts.spec
    pairs = [fit_pair(tokenize_pair(to_preference(r, "chosen_rejected"), tokenizer), 256, "truncate")
             for r in rows()]  # fmt: skip
    assert all(p is not None for p in pairs)
    totals = dpo.Totals(len(pairs), sum(p.chosen.num_targets for p in pairs))  # type: ignore[union-attr]
    batch = make_batch(spec, Sequences(pairs), sequence_indices(range(len(pairs))), tokenizer.pad_token_id)  # type: ignore[arg-type]
    parts.model.train()
    parts.model.zero_grad(set_to_none=True)
    loss, stats = dpo.micro_batch_loss(parts, batch, len(pairs), totals)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in parts.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, metrics(stats.tolist(), len(pairs))


def test_tokenization_equals_trl(tiny_model: Path, tokenizer, tmp_path: Path) -> None:
    """Prompt, chosen and rejected ids as TRL tokenizes them (chat template; the prompt is what the
    template renders up to the assistant's generation prompt)."""
    trainer = trl_trainer(tiny_model, tokenizer, tmp_path, spec_for(), 0.0)
    for i, row in enumerate(rows()):
        ours = tokenize_pair(to_preference(row, "chosen_rejected"), tokenizer)
        theirs = trainer.train_dataset[i]
        assert ours.prompt == theirs["prompt_ids"]
        assert ours.chosen == theirs["chosen_ids"]
        assert ours.rejected == theirs["rejected_ids"]


def check_equal(ours, theirs, names: dict[str, str]) -> None:
    loss_a, grads_a, metrics_a = ours
    loss_b, grads_b, metrics_b = theirs
    print(f"loss ftune {float(loss_a):.8f} trl {float(loss_b):.8f}")
    assert rel(loss_a, loss_b) < RTOL
    assert grads_b and grads_a.keys() == grads_b.keys()
    worst = max(rel(grads_a[k], grads_b[k]) for k in grads_b)
    print(f"largest relative gradient difference over {len(grads_b)} LoRA tensors: {worst:.2e}")
    assert worst < RTOL
    # A reward is beta x a difference of two log-probs of ~-60 in fp32: it carries their rounding (~1e-6)
    for ours_name, trl_name in names.items():
        assert metrics_a[ours_name] == pytest.approx(metrics_b[trl_name], rel=RTOL, abs=1e-5), ours_name


METRIC_NAMES = {
    "rewards_chosen": "rewards/chosen",
    "rewards_rejected": "rewards/rejected",
    "rewards_margin": "rewards/margins",
    "rewards_accuracy": "rewards/accuracies",
    "logps_chosen": "logps/chosen",
    "logps_rejected": "logps/rejected",
}


@pytest.mark.parametrize(
    ("loss_type", "rpo_alpha", "packing"),
    [("sigmoid", 0.0, False), ("sigmoid", 0.0, True), ("ipo", 0.0, False), ("ipo", 0.0, True),
     ("sigmoid", 0.5, False), ("sigmoid", 0.5, True), ("ipo", 1.0, False)],
)  # fmt: skip
def test_loss_and_lora_gradients_equal_trl(
    tiny_model: Path, tokenizer, tmp_path: Path, loss_type: str, rpo_alpha: float, packing: bool
) -> None:
    """Reference = the adapter disabled (a fresh adapter's start: the base)."""
    spec = spec_for(loss_type, rpo_alpha, packing)
    parts = ftune_parts(spec, tiny_model)
    perturb(parts.model, seed=7)
    trainer = trl_trainer(tiny_model, tokenizer, tmp_path, spec, rpo_alpha)
    load_into(trainer.model, lora_state(parts.model))
    check_equal(ftune_loss_and_grads(parts, tokenizer), trl_loss_and_grads(trainer), METRIC_NAMES)


@pytest.mark.parametrize(("loss_type", "rpo_alpha"), [("sigmoid", 0.0), ("ipo", 0.0), ("sigmoid", 0.5)])
def test_continuing_from_an_adapter_uses_it_frozen_as_the_reference(
    tiny_model: Path, tokenizer, tmp_path: Path, loss_type: str, rpo_alpha: float
) -> None:
    """spec.init_from: the starting adapter, frozen, is the reference (TRL: a PeftModel handed to
    DPOTrainer gets a "ref" copy of its adapter). The trained adapter is then moved away from it."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    spec = spec_for(loss_type, rpo_alpha, init_from="earlierjob01")
    # The earlier job's adapter, saved as ftune saves one.
    start = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), lora_config(spec)
    )
    perturb(start, seed=3)
    init_dir = tmp_path / "earlier" / "adapter"
    start.save_pretrained(init_dir, safe_serialization=True)

    parts = ftune_parts(spec, tiny_model, init_adapter=init_dir)
    assert {n for n, _ in model.trainable_parameters(parts.model)} == set(lora_state(parts.model))
    assert lora_state(parts.model, "ref")  # the frozen copy, on the same base weights
    moved = {k: v + 0.02 * torch.randn_like(v) for k, v in lora_state(parts.model).items()}
    load_into(parts.model, moved)

    trainer = trl_trainer(tiny_model, tokenizer, tmp_path, spec, rpo_alpha, peft_model=start)
    assert "ref" in trainer.model.peft_config
    load_into(trainer.model, moved)
    check_equal(ftune_loss_and_grads(parts, tokenizer), trl_loss_and_grads(trainer), METRIC_NAMES)


@pytest.mark.parametrize("packing", [False, True])
def test_simpo_equals_the_papers_formula(tiny_model: Path, tokenizer, packing: bool) -> None:
    """SimPO (Meng et al. 2024, eq. 6): -log sigmoid(beta/|y_w| log pi(y_w|x) - beta/|y_l| log pi(y_l|x)
    - gamma), averaged over pairs; no reference. log pi(y|x) is summed over the reply's tokens, each
    from its own forward of prompt + reply here."""
    beta, gamma = 2.0, 0.8
    spec = spec_for("simpo", packing=packing, simpo_gamma=gamma).model_copy(update={"beta": beta})
    parts = ftune_parts(spec, tiny_model)
    perturb(parts.model, seed=11)
    ours, _, _ = ftune_loss_and_grads(parts, tokenizer)

    def logp(prompt: list[int], reply: list[int]) -> tuple[float, int]:
        ids = torch.tensor([prompt + reply])
        with torch.no_grad():
            logits = parts.model(input_ids=ids).logits[0].double()
        logprobs = torch.log_softmax(logits, -1)
        total = sum(float(logprobs[len(prompt) + j - 1, t]) for j, t in enumerate(reply))
        return total, len(reply)

    losses = []
    for row in rows():
        w = tokenize_pair(to_preference(row, "chosen_rejected"), tokenizer)
        (lw, nw), (ll, nl) = logp(w.prompt, w.chosen), logp(w.prompt, w.rejected)
        z = beta / nw * lw - beta / nl * ll - gamma
        losses.append(-math.log(1 / (1 + math.exp(-z))))
    expected = sum(losses) / len(losses)
    print(f"simpo: ftune {float(ours):.8f}, the formula {expected:.8f}")
    assert float(ours) == pytest.approx(expected, rel=RTOL)
