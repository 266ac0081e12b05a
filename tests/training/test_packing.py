"""Packing: packed loss and gradients equal the per-example ones; packed steps and their packs are a
resumable partition; attention never crosses (or computes across) an example boundary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from core.spec import JobSpec
from tests.training.util import qa_rows, write_jsonl
from training import packing
from training.batches import epoch_steps, split_step, total_steps
from training.data import IGNORE, PAD_MULTIPLE, Tokenized, collate, load_dataset
from training.loss import TARGET_KEYS
from training.model import load_model, trainable_parameters
from training.objectives.sft.loss import TokenLoss
from training.packing import ATTN_NAME, collate_packed, packed_attention, per_example_attention
from training.step import Parts, accumulate_gradients, count_targets, make_optimizer


def make_trainer(tiny_model: Path, items, **kw) -> Parts:
    s = JobSpec(base_model="tiny", dataset_id="testdata01", lora_dropout=0.0, lora_r=4, **kw)
    torch.manual_seed(0)
    model = load_model(s, tiny_model, torch.device("cpu"))
    params = [p for _, p in trainable_parameters(model)]
    with torch.no_grad():  # LoRA B starts at zero; make every LoRA weight get a gradient
        for p in params:
            p.add_(torch.randn_like(p) * 0.05)
    return Parts(s, model, make_optimizer(s, params), params, torch.device("cpu"))


@pytest.fixture
def items(tokenizer, tmp_path: Path) -> list[Tokenized]:
    items, _ = load_dataset(write_jsonl(tmp_path / "d.jsonl", qa_rows(6)), tokenizer, 128)
    assert len({len(t.input_ids) for t in items}) >= 4  # unequal lengths
    return items


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_packed_loss_and_gradients_equal_per_example(tiny_model: Path, items, method: str) -> None:
    # transformers' own eager attention with its causal mask: a reference that shares no code with ours
    per_example = make_trainer(tiny_model, items, method=method, packing=False, attn_implementation="eager")
    assert per_example.model.config._attn_implementation == "eager"
    batches = [collate([t], 0) for t in items]
    tok_a = sum(count_targets(b) for b in batches)
    loss_a = accumulate_gradients(per_example, batches, TokenLoss(per_example, tok_a))

    packed = make_trainer(tiny_model, items, method=method, packing=True)
    assert packed.model.config._attn_implementation == ATTN_NAME
    packed_batch = collate_packed(items)
    tok_b = count_targets(packed_batch)
    loss_b = accumulate_gradients(packed, [packed_batch], TokenLoss(packed, tok_b))

    assert tok_a == tok_b == sum(t.num_targets for t in items)
    assert float(loss_b) == pytest.approx(float(loss_a), abs=1e-4)
    for pa, pb in zip(per_example.params, packed.params, strict=True):
        assert pa.grad is not None and pa.grad.abs().sum() > 0
        torch.testing.assert_close(pb.grad, pa.grad, atol=1e-4, rtol=1e-4)


def test_packed_attention_equals_dense_block_diagonal_attention() -> None:
    """Per-example SDPA == full-row attention with a block-diagonal causal mask (GQA, 3 examples)."""
    torch.manual_seed(0)
    bounds = [0, 5, 6, 13]
    q, k, v = torch.randn(1, 4, 13, 8), torch.randn(1, 2, 13, 8), torch.randn(1, 2, 13, 8)
    module = torch.nn.Module()
    out, _ = packed_attention(module, q, k, v, None, cu_seq_lens_q=torch.tensor(bounds, dtype=torch.int32))
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor(np.diff(bounds)))
    mask = (doc[:, None] == doc[None, :]) & torch.ones(13, 13, dtype=torch.bool).tril()
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask
    )
    assert out.shape == (1, 13, 4, 8)
    torch.testing.assert_close(out, dense.transpose(1, 2), atol=1e-6, rtol=1e-6)


def test_attention_never_crosses_examples(tiny_model: Path, items) -> None:
    """Changing one example leaves the logits of the others bit for bit unchanged."""
    t = make_trainer(tiny_model, items, packing=True)
    changed = list(items)
    changed[2] = Tokenized([5] * len(items[2].input_ids), items[2].labels)
    with torch.no_grad():
        a = t.model(**_inputs(collate_packed(items))).logits[0]
        b = t.model(**_inputs(collate_packed(changed))).logits[0]
    starts = np.cumsum([0] + [len(x.input_ids) for x in items])
    for i in range(len(items)):
        s, e = starts[i], starts[i + 1]
        assert torch.equal(a[s:e], b[s:e]) == (i != 2), i


def test_packed_attention_does_no_cross_example_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each SDPA call sees exactly one example: the score work is sum(n_i^2), not T^2. Calls are 4-D,
    which SDPA's fused CPU kernel needs (3-D inputs take the math path and keep n x n scores)."""
    calls: list[tuple[int, int, int]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(q, k, v, **kw):
        calls.append((q.dim(), q.shape[2], k.shape[2]))
        return sdpa(q, k, v, **kw)

    q = torch.randn(1, 2, 10, 4)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    packed_attention(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=torch.tensor([0, 3, 4, 10]))
    assert calls == [(4, 3, 3), (4, 1, 1), (4, 6, 6)]


def test_a_model_loaded_for_packing_handles_any_batch(tiny_model: Path, items) -> None:
    """Right-padded batches (no mask: causal attention never reaches the padding), a packed row and a
    single sequence all agree with transformers' eager attention under its padding mask, example by
    example."""
    packed = make_trainer(tiny_model, items, packing=True).model
    plain = make_trainer(tiny_model, items, packing=False, attn_implementation="eager").model
    padded = collate(items, 0)
    lengths = torch.tensor([len(t.input_ids) for t in items])
    mask = (torch.arange(padded["input_ids"].shape[1])[None] < lengths[:, None]).long()
    assert padded["input_ids"].shape[1] % PAD_MULTIPLE == 0 and "attention_mask" not in padded
    with torch.no_grad():
        want = plain(input_ids=padded["input_ids"], attention_mask=mask).logits
        got_padded = packed(input_ids=padded["input_ids"]).logits
        got_row = packed(**_inputs(collate_packed(items))).logits[0]
        got_single = packed(input_ids=padded["input_ids"][:1, : len(items[0].input_ids)]).logits[0]
    start = 0
    for i, t in enumerate(items):
        n = len(t.input_ids)
        torch.testing.assert_close(got_padded[i, :n], want[i, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_row[start : start + n], want[i, :n], atol=1e-5, rtol=1e-5)
        start += n
    torch.testing.assert_close(got_single, want[0, : len(items[0].input_ids)], atol=1e-5, rtol=1e-5)


def _per_example_double(calls: list[dict]):
    """Stands in for torch's CUDA-only varlen kernel on a CPU: records each call, computes per example."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                    enable_gqa=False):  # fmt: skip
        calls.append({"tokens": query.shape[0], "window": window_size, "gqa": enable_gqa, "max": max_q})
        out = per_example_attention(
            query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None], cu_seq_q,
            scaling=scale,
        )  # fmt: skip
        return out[0]

    return varlen_attn


def test_packed_rows_make_one_varlen_call_per_layer(tiny_model: Path, items, monkeypatch) -> None:
    """Where the varlen kernel runs (CUDA, half precision), a packed forward makes one attention call per
    layer for the whole row, causal, with GQA and the row's longest example from collation; its output is
    the per-example path's."""
    calls: list[dict] = []
    t = make_trainer(tiny_model, items, packing=True)
    row = collate_packed(items)
    with torch.no_grad():
        want = t.model(**_inputs(row)).logits
        monkeypatch.setattr(
            packing, "varlen_kernel", lambda q: packing._varlen_call(_per_example_double(calls))
        )
        got = t.model(**_inputs(row)).logits
    layers = t.model.get_base_model().config.num_hidden_layers
    assert len(calls) == layers
    longest = max(len(x.input_ids) for x in items)
    assert calls[0] == {"tokens": row["input_ids"].shape[1], "window": (-1, 0), "gqa": True, "max": longest}
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_varlen_call_adapts_to_the_older_signature() -> None:
    """torch releases whose varlen_attn takes is_causal and no enable_gqa get causality by flag and the
    key/value heads repeated."""
    seen: dict = {}

    def old_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
        seen.update(is_causal=is_causal, kv_heads=key.shape[1])
        return per_example_attention(
            query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None], cu_seq_q
        )[0]

    q, k = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 9, 8)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out = packing._varlen_call(old_varlen_attn)(q, k, k, cu, 5, None)
    assert seen == {"is_causal": True, "kv_heads": 4}
    torch.testing.assert_close(out, per_example_attention(q, k, k, cu), atol=1e-6, rtol=1e-6)


def test_collate_packed_restarts_positions_and_ignores_first_labels() -> None:
    a, b = Tokenized([1, 2, 3], [IGNORE, 2, 3]), Tokenized([4, 5], [4, 5])
    batch = collate_packed([a, b])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    # 4 (b's first token) is never the target of 3 (a's last): labels[1:] are the targets.
    assert batch["labels"].tolist() == [[IGNORE, 2, 3, IGNORE, 5]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5] and batch["max_length_q"] == 3


def test_packed_steps_are_a_seeded_full_partition_of_rows_within_capacity() -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(150), 0.8, 3000), 8, 512).astype(int).tolist()
    s = JobSpec(
        base_model="tiny", dataset_id="testdata01", micro_batch_size=2, max_seq_len=512,
        gradient_accumulation_steps=2, seed=7,
    )  # fmt: skip
    p0 = epoch_steps(s, lengths, 0)
    assert p0 == epoch_steps(s, lengths, 0)  # resumable: a pure function
    assert p0 != epoch_steps(s, lengths, 1)
    assert p0 != epoch_steps(s.model_copy(update={"seed": 8}), lengths, 0)
    rows = [row for step in p0 for row in step]
    assert sorted(i for row in rows for i in row) == list(range(3000))
    fill = [sum(lengths[i] for i in row) for row in rows]
    assert max(fill) <= 512
    assert sum(fill) / (len(rows) * 512) > 0.97  # best-fit decreasing leaves little slack
    assert sum(len(step) != 4 for step in p0) <= 1  # one shorter step: the epoch's remainder
    for step in p0:  # 2 packs of 2 rows each (the one shorter step: fewer)
        packs = split_step(s, lengths, step)
        assert len(packs) == -(-len(step) // 2) and all(sum(lengths[i] for i in p) <= 1024 for p in packs)
    with pytest.raises(ValueError, match="does not fit"):
        epoch_steps(s, [10, 513], 0)


def test_total_steps_counts_packed_steps_per_epoch() -> None:
    lengths = [(i * 37) % 101 + 1 for i in range(200)]
    s = JobSpec(
        base_model="tiny", dataset_id="testdata01", micro_batch_size=2, max_seq_len=128,
        gradient_accumulation_steps=3, epochs=2,
    )  # fmt: skip
    expected = sum(len(epoch_steps(s, lengths, e)) for e in range(2))
    assert total_steps(s, lengths) == expected
    assert expected < total_steps(s.model_copy(update={"packing": False}), lengths)  # 2 * ceil(200 / 6)


def _inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k not in TARGET_KEYS}
