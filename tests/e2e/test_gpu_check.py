"""bench/gpu_check.py's CPU path: without CUDA it says so and exits 0; the model it would build is ~1B."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from core.arch import load_architecture
from core.spec import JobSpec
from planner.feasibility import plan_on
from planner.gpus import resolve_gpu
from tests.e2e.stack import REPO


def bench(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """A bench script run on this CPU as the GPU session runs it, which must exit 0."""
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done


def test_without_cuda_it_says_so_and_exits_0() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "no CUDA device here" in done.stdout


def test_the_model_it_builds_is_llama_shaped_with_about_a_billion_parameters(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check

    from training.demo import DemoSize

    shape = gpu_check.SHAPE
    config = {
        "model_type": "llama",
        "vocab_size": DemoSize().vocab_size,
        "hidden_size": shape["hidden_size"],
        "intermediate_size": shape["intermediate_size"],
        "num_hidden_layers": shape["num_layers"],
        "num_attention_heads": shape["num_heads"],
        "num_key_value_heads": shape["num_kv_heads"],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = JobSpec(base_model="gpu-check-1b", dataset_id="gpucheck01")
    plan = plan_on(spec, load_architecture(tmp_path), resolve_gpu("A100-80GB"))
    assert 0.9e9 < plan.total_params < 1.2e9, plan.total_params


def test_the_fused_ops_bench_runs_on_a_cpu_and_prints_both_sides() -> None:
    """bench/fused_ops.py as the GPU session runs it, on this CPU with few tokens: a row per op, the eager
    and the fused time side by side, and no new tensor kept by the fused ones (the rotary embeddings keep
    the model's cos and sin, as eager does)."""
    done = bench("fused_ops.py", "--tokens", "64", "--repeat", "1")
    assert "torch.compile failed on: none" in done.stdout  # the fused column was compiled
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("RMSNorm", "silu"))]
    assert len(rows) == 2, done.stdout
    for row in rows:
        assert row[-2:] == ["0.0", "MiB"] and float(row[-4]) > 0, row  # eager keeps new tensors, fused none
    rotary = [line.split() for line in done.stdout.splitlines() if line.startswith("rotary")]
    assert len(rotary) == 1 and rotary[0][-4:] == ["0.0", "MiB", "0.0", "MiB"], done.stdout  # cos, sin only


def test_the_rollouts_decode_bench_runs_on_a_cpu_and_prints_each_row() -> None:
    """bench/rollouts_decode.py on this CPU with 2 layers and 8 tokens: a time per decoding step for each
    way of sampling, side by side."""
    done = bench("rollouts_decode.py", "--layers", "2", "--tokens", "8", "--repeats", "1")
    labels = ("transformers alone", "engine, bare model", "transformers + peft", "engine, fused always",
              "engine, prompt by prompt", "engine (now)", "engine, static cache")  # fmt: skip
    rows = [line for line in done.stdout.splitlines() if line.startswith(labels)]
    assert len(rows) == 7, done.stdout
    for row in rows:
        ms, steps = row.split()[-3:-1]
        calls = 2 if "prompt by prompt" in row else 1  # 2 prompts: one decoded batch each, or one for both
        assert float(ms) > 0 and calls <= int(steps) <= 8 * calls, row


def test_the_lora_layer_bench_runs_on_a_cpu_and_prints_each_row() -> None:
    """bench/lora_layer.py on this CPU with few calls: microseconds per call for each forward."""
    done = bench("lora_layer.py", "--calls", "20", "--rounds", "2")
    labels = ("base linear alone", "peft's forward", "engine's forward", "its ops alone")
    rows = [line for line in done.stdout.splitlines() if line.startswith(labels)]
    assert len(rows) == 4 and all(float(row[20:].split()[0]) > 0 for row in rows), done.stdout


def test_the_preflight_runs_a_job_to_its_adapter(tmp_path: Path) -> None:
    """bench/gpu_preflight.py, which a GPU session runs first: a case that trains to its adapter says ok."""
    done = bench("gpu_preflight.py", "--keep", str(tmp_path), "--only", "sft lora, packed")
    assert "ok    sft lora, packed" in done.stdout
    assert "1 ok, 0 failed" in done.stdout


def test_the_preflight_reports_a_failing_case_with_its_last_lines(tmp_path: Path) -> None:
    """A case whose process fails, or ends without its steps and adapter, is a FAIL with the process's
    last lines (processes standing in for the training ones)."""
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_preflight

    def process(code: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    ok, line = gpu_preflight.verdict("dpo", process("print('no CUDA device'); raise SystemExit(3)"), tmp_path)
    assert not ok and line.startswith("FAIL  dpo") and "exit 3" in line and "no CUDA device" in line
    ok, line = gpu_preflight.verdict("grpo", process("print('done')"), tmp_path)  # exit 0, nothing written
    assert not ok and "exit 0, 0 steps, adapter False" in line


def test_the_step_profile_runs_on_a_cpu_and_splits_the_step_by_kind() -> None:
    """bench/step_profile.py on this CPU (the smoke's tiny model): the step's wall time beside the time of
    its operators, split by kind, and the operators that take the most."""
    done = bench("step_profile.py", "--steps", "3", "--rows", "12")  # a loaded CPU reorders the top few
    assert "step_profile on CPU" in done.stdout and "profiled: steps 3..3" in done.stdout
    kinds = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ") and "%" in line]
    assert "matrix" in kinds and "attention" in kinds, done.stdout
    assert "aten::mm" in done.stdout


def _arch(tmp_path: Path, shape: dict[str, int], vocab: int):  # -> core.arch.Architecture
    config = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": shape["hidden_size"],
        "intermediate_size": shape["intermediate_size"],
        "num_hidden_layers": shape["num_layers"],
        "num_attention_heads": shape["num_heads"],
        "num_key_value_heads": shape["num_kv_heads"],
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return load_architecture(tmp_path)


def test_the_8b_shape_is_llama_3_8b_and_its_configs_are_planned_to_fit_an_h200(tmp_path: Path) -> None:
    """--shape 8b: Llama-3-8B's 8.03B parameters (its 128,256-row vocabulary included); the planner, as the
    bench calls it, plans both of its configs (2 x 4,096 packed, no checkpointing) within an H200."""
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check

    arch = _arch(tmp_path, gpu_check.SHAPE_8B, gpu_check.VOCAB_8B)
    assert arch.total_params == 8_030_261_248  # Llama-3-8B's count
    for name, fields in gpu_check.CONFIGS_8B.items():
        spec = JobSpec(base_model="gpu-check-8b", dataset_id="gpucheck01", max_seq_len=4096, packing=True,
                       **fields)  # fmt: skip
        plan = plan_on(spec, arch, resolve_gpu("H200"))
        assert plan.fits and 30 * 2**30 < plan.reserved_bytes < 100 * 2**30, (name, plan.reserved_bytes)


def test_flops_count_lora_as_4n_plus_attention_beside_6n(tmp_path: Path) -> None:
    """bench/flops.py: causal attention per layer and sequence is 2 d_attn s(s+1) (PaLM's full square:
    4 d_attn s^2), per token over the sequences' tokens; the LoRA count 4 N_mm + 6 N_lora + 3 A_fwd, N_mm
    the blocks' linears and the output layer; the 6N count every parameter; MFU of both at a peak."""
    sys.path.insert(0, str(REPO / "bench"))
    import flops
    import gpu_check

    assert flops.attention_fwd_per_token(1, 8, [3]) == 2 * 8 * 3 * 4 / 3  # 3 tokens, 6 causal pairs
    assert flops.attention_fwd_per_token(1, 8, [3], causal=False) == 4 * 8 * 9 / 3
    assert flops.attention_fwd_per_token(2, 8, [3, 5], max_len=4) == 2 * 2 * 8 * (3 * 4 + 4 * 5) / 7
    arch = _arch(tmp_path, gpu_check.SHAPE, 4096)
    count = flops.count(arch, [100, 300], n_lora=1000)
    assert count.n_matmul == count.n_blocks + 4096 * 2048 == arch.matmul_params
    assert count.n_total == arch.total_params > count.n_matmul
    attn = 2 * 2 * (32 * 64) * 22 * (100 * 101 / 2 + 300 * 301 / 2) / 400
    assert count.attn_fwd_per_token == attn
    assert count.lora_per_token == 4 * count.n_matmul + 6 * 1000 + 3 * attn
    assert count.tokens_per_sequence == (100**2 + 300**2) / 400
    mfu = count.mfu(1000.0, 1e15)
    assert mfu == {"mfu_6n": 6 * count.n_total * 1000 / 1e15, "mfu_lora": count.lora_per_token * 1000 / 1e15}
    assert count.mfu(None, 1e15) == count.mfu(1000.0, None) == {"mfu_6n": None, "mfu_lora": None}
    assert flops.FlopCount.from_json(count.as_json()) == count
    assert "N_total" in count.describe() and "N_blocks" in count.describe()


def test_gpu_check_smoke_of_the_8b_path_runs_lora_and_qlora_on_a_cpu(tmp_path: Path) -> None:
    """gpu_check.py --smoke --shape 8b: the 8B path (its builder, long rows, 4k context, both configs, the
    planner's prediction, tokens/s over the steps after the warmup, both MFU counts) on a tiny model here:
    no peaks and no MFU on a CPU, the rest filled."""
    out = tmp_path / "rows.json"
    done = bench("gpu_check.py", "--smoke", "--shape", "8b", "--steps", "2", "--keep", str(tmp_path),
                 "--json-out", str(out))  # fmt: skip
    rows = json.loads(out.read_text())
    assert [r["config"] for r in rows] == ["lora-8b", "qlora-8b"]
    for r in rows:
        assert r["exit"] == 0 and r["steps_done"] == 2 and r["timed_steps"] == 1, r
        assert r["max_seq_len"] == 4096 and r["micro_batch"] == 2 and r["tokens_per_s"] > 0, r
        assert r["plan_reserved_gib"] > 0 and r["max_reserved_gib"] is None, r
        assert r["mfu_6n"] is None and r["mfu_lora"] is None, r
        assert r["flops"]["lora_flops_per_token"] > 0
    assert [r["method"] for r in rows] == ["lora", "qlora"]
    assert "MFU LoRA" in done.stdout and "  FLOPs: N_total" in done.stdout


def test_the_new_families_run_their_configs_on_a_cpu(tmp_path: Path) -> None:
    """--shape moe and vl (issue 43's GPU check) with --smoke: a tiny Qwen3-MoE trains LoRA and QLoRA, a
    tiny Qwen2.5-VL LoRA on images (checkpointing takes the same path: left out for time); each row has its
    plan."""
    for shape, configs in (("moe", ["lora", "qlora"]), ("vl", ["lora"])):
        names = ",".join(configs)
        keep = str(tmp_path / shape)
        done = bench(
            "gpu_check.py", "--smoke", "--shape", shape, "--steps", "2", "--keep", keep, "--configs", names
        )
        rows = json.loads(done.stdout.strip().splitlines()[-1])
        assert [r["config"] for r in rows] == configs
        assert all(r["exit"] == 0 and r["steps_done"] == 2 and r["plan_allocated_gib"] > 0 for r in rows)
