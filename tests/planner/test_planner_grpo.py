"""Planner: objective grpo's rollouts (the KV cache of generation), its reference forward and suggestions."""

from __future__ import annotations

from typing import Any

from core.arch import from_config
from core.spec import JobSpec
from planner import FTUNE, BatchShape, Plan, estimate
from planner.context import plan_context
from planner.feasibility import device_gpu
from planner.gpus import resolve_gpu
from planner.rollouts import rollout, rollout_terms
from tests.planner.planner_util import LLAMA2_7B, LLAMA3_8B, spec, term

GRADER = {
    "type": "string_check",
    "name": "s",
    "input": "{{sample.output_text}}",
    "reference": "a",
    "operation": "eq",
}
# Llama-2-13B: 40 layers of full multi-head attention, whose cache outgrows a checkpointed QLoRA step
LLAMA2_13B = {
    **LLAMA2_7B,
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "num_key_value_heads": 40,
}
CPU = device_gpu({"kind": "cpu", "name": "cpu", "memory_bytes": 64 * 2**30})


def grpo(**kw: Any) -> JobSpec:
    return spec(objective="grpo", grader=GRADER, **kw)


def kv_term(job: JobSpec, config: dict[str, Any] = LLAMA3_8B, gpu: Any = None) -> int:
    c = plan_context(job, from_config(config), gpu or resolve_gpu("A100-80GB"), FTUNE)
    return next(t.bytes for t in rollout_terms(c) if t.name == "rollout KV cache")


def test_the_kv_cache_is_layers_x_kv_heads_x_head_dim_x_rows_x_max_seq_len() -> None:
    job = grpo(micro_batch_size=2, num_generations=8, max_seq_len=1024, max_completion_tokens=512)
    # 2 (k, v) x 32 layers x 8 kv heads x head_dim 128 x 2 B (bf16 autocast on a GPU) x 16 rows x 1024
    assert kv_term(job) == 2 * 32 * 8 * 128 * 2 * (2 * 8) * 1024
    # a CPU has no autocast: the weights' dtype, bf16 as config.json says, or fp32 when asked
    assert kv_term(job, gpu=CPU) == 2 * 32 * 8 * 128 * 2 * 16 * 1024
    assert (
        kv_term(job.model_copy(update={"torch_dtype": "float32"}), gpu=CPU)
        == 2 * 32 * 8 * 128 * 4 * 16 * 1024
    )
    # fp32 weights under bf16 autocast: RoPE promotes the keys to the fp32 residual stream, values stay bf16
    assert kv_term(job.model_copy(update={"torch_dtype": "float32"})) == 32 * 8 * 128 * (4 + 2) * 16 * 1024
    # full multi-head attention: every head cached
    assert kv_term(job, LLAMA2_7B) == 2 * 32 * 32 * 128 * 2 * 16 * 1024


def test_the_kv_cache_grows_linearly_with_generations_micro_batch_and_length() -> None:
    base = dict(micro_batch_size=2, num_generations=4, max_seq_len=1024, max_completion_tokens=256)
    one = kv_term(grpo(**base))
    assert kv_term(grpo(**{**base, "num_generations": 8})) == 2 * one
    assert kv_term(grpo(**{**base, "num_generations": 12})) == 3 * one
    assert kv_term(grpo(**{**base, "micro_batch_size": 4})) == 2 * one
    assert kv_term(grpo(**{**base, "max_seq_len": 2048})) == 2 * one
    # the prompt and completion share the cache's length: only their sum counts
    assert kv_term(grpo(**{**base, "max_completion_tokens": 768})) == one


def test_the_rollouts_sample_all_of_a_steps_prompts_at_once_unless_rollout_batch_size_says_fewer() -> None:
    base = dict(micro_batch_size=2, num_generations=4, max_seq_len=1024, max_completion_tokens=256)
    one = kv_term(grpo(**base))
    # a step of 2 x 3 prompts samples them together, however the step is split into micro-batches
    assert kv_term(grpo(**{**base, "gradient_accumulation_steps": 3})) == 3 * one
    assert kv_term(grpo(**{**base, "micro_batch_size": 6})) == 3 * one
    assert kv_term(grpo(**{**base, "gradient_accumulation_steps": 3, "rollout_batch_size": 4})) == 2 * one
    assert kv_term(grpo(**{**base, "gradient_accumulation_steps": 3, "rollout_batch_size": 1})) == one // 2
    assert kv_term(grpo(**{**base, "rollout_batch_size": 64})) == one  # never more than the step's


def test_the_datas_longest_prompt_sets_the_caches_length_and_never_raises_it() -> None:
    """With the data's shape (training.memory.batch_shape: its longest prompt + max_completion_tokens) the
    rollouts are counted at that length, not max_seq_len; a shape from other settings cannot raise it."""
    job = grpo(micro_batch_size=2, num_generations=8, max_seq_len=1024, max_completion_tokens=256)
    arch, gpu = from_config(LLAMA3_8B), resolve_gpu("A100-80GB")

    def kv(shape: BatchShape | None) -> int:
        c = plan_context(job, arch, gpu, FTUNE, shape)
        return next(t.bytes for t in rollout_terms(c) if t.name == "rollout KV cache")

    per_position = 2 * 32 * 8 * 128 * 2 * 16
    assert kv(None) == per_position * 1024
    assert kv(BatchShape(tokens=16 * 300, seq_len=40 + 256, targets=16 * 256)) == per_position * 296
    assert kv(BatchShape(tokens=16 * 4096, seq_len=4096, targets=16 * 256)) == per_position * 1024


def test_the_sampling_buffers_are_rows_x_vocab() -> None:
    arch, gpu = from_config(LLAMA3_8B), resolve_gpu("A100-80GB")
    job = grpo(micro_batch_size=4, num_generations=16, max_seq_len=256, max_completion_tokens=192)
    r = rollout(plan_context(job, arch, gpu, FTUNE))
    # bf16 logits, their fp32 copy, softmax, multinomial's draws (temperature 1: no scaled copy)
    assert r.sampling == 64 * 128256 * (2 + 12)
    hot = rollout(plan_context(job.model_copy(update={"temperature": 0.7}), arch, gpu, FTUNE))
    assert hot.sampling == 64 * 128256 * (2 + 16)


def rollout_dominated() -> tuple[JobSpec, Any, Any]:
    job = grpo(
        method="qlora", micro_batch_size=4, num_generations=8, max_seq_len=2048, max_completion_tokens=1024
    )
    return job, from_config(LLAMA2_13B), resolve_gpu("L40S")


def test_a_grpo_job_whose_rollouts_do_not_fit_is_refused_with_the_rollout_line_and_fitting_suggestions() -> (
    None
):
    job, arch, gpu = rollout_dominated()
    plan = estimate(job, arch, gpu)
    assert not plan.fits
    kv = term(plan, "rollout KV cache")
    assert kv == 2 * 40 * 40 * 128 * 2 * 32 * 2048 == 50 * 2**30  # at the peak, not listed at 0
    assert term(plan, "rollout transients") > 0
    # the training phase is the alternative peak: listed at 0, its size in the note
    assert term(plan, "activations") == 0 and "not at the peak" in _note(plan, "activations")
    overhead = {"allocator fragmentation", "CUDA context"}
    assert plan.allocated_bytes == sum(t.bytes for t in plan.breakdown if t.name not in overhead)
    assert plan.suggestions
    for s in plan.suggestions:
        assert set(s.change) <= set(JobSpec.model_fields) and "num_gpus" not in s.change  # one GPU for grpo
        new = JobSpec.model_validate({**job.model_dump(), **s.change})  # a valid spec (prompt budget >= 8)
        again = estimate(new, arch, gpu, suggest=False)
        assert s.fits and again.fits and again.total_bytes == s.plan_total_bytes <= gpu.usable_bytes
    first = plan.suggestions[0].change
    # the cheapest levers, mildest: a step of 4 prompts sampled 2 at a time, trained 2 at a time
    assert first == {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "rollout_batch_size": 2}
    changed = {k for s in plan.suggestions for k in s.change}
    assert {"num_generations", "max_completion_tokens"} <= changed


def test_shorter_prompts_or_completions_change_max_seq_len_by_their_own_budget() -> None:
    job, arch, gpu = rollout_dominated()
    by_field = {frozenset(s.change): s.change for s in estimate(job, arch, gpu).suggestions}
    completions = by_field[frozenset({"max_completion_tokens", "max_seq_len"})]
    assert completions["max_completion_tokens"] < job.max_completion_tokens
    assert completions["max_seq_len"] - completions["max_completion_tokens"] == job.rl.max_prompt_tokens
    prompts = by_field[frozenset({"max_seq_len"})]
    assert 64 <= prompts["max_seq_len"] - job.max_completion_tokens < job.rl.max_prompt_tokens


def test_the_reference_forward_runs_with_beta_only() -> None:
    arch, gpu = from_config(LLAMA3_8B), resolve_gpu("24GB")
    mb, n, completion = 2, 4, 256
    fields = dict(micro_batch_size=mb, num_generations=n, max_seq_len=512, max_completion_tokens=completion)
    without = estimate(grpo(**fields), arch, gpu, suggest=False)
    names = {t.name for t in without.breakdown}
    assert "reference forward (no activations kept)" not in names and "reference log-probs" not in names
    plan = estimate(grpo(beta=0.04, **fields), arch, gpu, suggest=False)
    names = {t.name for t in plan.breakdown}
    assert "reference forward (no activations kept)" in names
    assert term(plan, "reference log-probs") == 2 * mb * n * completion * 4  # per completion token, fp32
    assert plan.total_bytes > without.total_bytes


def test_the_training_phase_counts_every_generation_and_scores_the_completions() -> None:
    arch, gpu = from_config(LLAMA3_8B), resolve_gpu("A100-80GB")
    job = grpo(micro_batch_size=2, num_generations=8, max_seq_len=512, max_completion_tokens=128)
    plan = estimate(job, arch, gpu, suggest=False)
    assert plan.planned_tokens == 2 * 8 * 512  # micro_batch_size x num_generations sequences, worst case
    assert f"of {2 * 8 * 128} scored tokens" in _note(plan, "logits and loss")  # the completions only


def test_sft_and_dpo_plans_have_no_rollouts() -> None:
    arch, gpu = from_config(LLAMA2_7B), resolve_gpu("A100-80GB")
    for job in (spec(), spec(objective="dpo"), spec(method="qlora", objective="dpo", loss_type="simpo")):
        assert not [t for t in estimate(job, arch, gpu).breakdown if t.name.startswith("rollout")]


def _note(plan: Plan, name: str) -> str:
    return next(t.note for t in plan.breakdown if t.name == name)
