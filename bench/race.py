"""bench/gpu_vs_trl.py's race: which runs there are (CATALOG), whether each trained as the reference did,
the best of each engine, and the table with each row's exact configuration."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import gpu_check  # its GPU lookup
from sft_job import Setup
from trl_reference import Variant

# -- one run, as the parent sees it --------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    name: str
    engine: str  # "ftune" | "trl" | "unsloth"
    packing: bool
    # ftune: what this bench compiles in its engine: "fused" (--compiled-fused; sft_job.prepare_engine)
    compiled: str = ""
    compile_layers: bool = True  # RunConfig.compile_layers (--eager-layers: false)
    variant: Variant = field(default_factory=Variant)  # the opponent's (trl_reference.Variant)

    @property
    def dir_name(self) -> str:
        return self.name.replace(" ", "-")


FASTEST = Variant(liger=True, compile=True, attn="varlen")
CATALOG = {
    r.name: r
    for r in (
        Run("ftune packed", "ftune", True),
        Run("trl packed", "trl", True),
        Run("trl fastest", "trl", True, variant=FASTEST),
        Run("trl fastest bf16", "trl", True, variant=replace(FASTEST, lora_bf16=True)),
        Run("trl fastest sdpa", "trl", True, variant=replace(FASTEST, attn="sdpa")),
        Run("unsloth", "unsloth", True, variant=Variant(unsloth=True)),
        Run("ftune eager", "ftune", True, compile_layers=False),
        Run("ftune jit", "ftune", True, "fused", compile_layers=False),
        Run("ftune padded", "ftune", False),
        Run("trl padded", "trl", False),
    )
}
# The pairs first: a budget that runs out still leaves a comparison.
DEFAULT_RUNS = ("ftune packed", "trl packed", "trl fastest", "trl fastest bf16", "unsloth", "ftune padded",
                "trl padded")  # fmt: skip
NAME_WIDTH = max(len(name) for name in CATALOG)


def runs_asked(names: str | None, eager_layers: bool, compiled_fused: bool) -> list[Run]:
    """The runs in order: --runs (comma-separated names of CATALOG) or DEFAULT_RUNS, with the A/B rows of
    --eager-layers and --compiled-fused after the first two where not named already."""
    chosen = [n.strip() for n in names.split(",") if n.strip()] if names else list(DEFAULT_RUNS)
    unknown = [n for n in chosen if n not in CATALOG]
    if unknown:
        raise SystemExit(f"gpu_vs_trl: unknown runs {unknown}; known: {', '.join(CATALOG)}")
    extra = [n for n, on in (("ftune eager", eager_layers), ("ftune jit", compiled_fused)) if on]
    extra = [n for n in extra if n not in chosen]
    return [CATALOG[n] for n in [*chosen[:2], *extra, *chosen[2:]]]


def same_as_ran(run: Run, rows: list[dict]) -> str | None:
    """Why `run` need not run: "trl fastest sdpa" is "trl fastest" again where that one picked SDPA (no
    varlen kernel here); None otherwise."""
    if run.name != "trl fastest sdpa":
        return None
    fastest = next((r for r in rows if r["run"] == "trl fastest" and r["exit"] == 0), None)
    if fastest and str(fastest.get("attn", "")).startswith("sdpa"):
        return "the same as trl fastest, which ran with SDPA"
    return None


# -- does each run train as the reference does? --------------------------------------------------------------

FIRST_TOLERANCE, LAST_TOLERANCE, MIN_DROP, LAST_N = 0.02, 0.03, 0.05, 5


def check_losses(rows: list[dict]) -> None:
    """Set each row's `loss_check`: "reference", "ok", "mismatch: ..." or None (nothing to compare). The
    reference of the packed rows is TRL's default packed row where it trained, else ftune's; of the padded
    rows, TRL's padded row, else ftune's. Same data, init and lr, different batches across engines: the
    losses agree to about 0.5% (2026-11-28: 8.680 vs 8.648 at step 1, 6.851 vs 6.875 at step 30)."""
    for packing in (True, False):
        mine = [r for r in rows if r["packing"] == packing]
        done = {r["run"]: r for r in mine if r["exit"] == 0 and r.get("losses")}
        order = ("trl packed", "ftune packed") if packing else ("trl padded", "ftune padded")
        ref = next((done[n] for n in order if n in done), None)
        for r in mine:
            if r is ref:
                r["loss_check"] = "reference"
            elif ref is None or r["run"] not in done:
                r["loss_check"] = None
            else:
                r["loss_check"] = _compare(r["losses"], ref["losses"], ref["run"])


def _compare(losses: list[float], ref: list[float], ref_name: str) -> str:
    def tail(values: list[float]) -> float:
        return sum(values[-LAST_N:]) / len(values[-LAST_N:])

    first = abs(losses[0] - ref[0]) / abs(ref[0])
    last = abs(tail(losses) - tail(ref)) / abs(tail(ref))
    bad = []
    if first > FIRST_TOLERANCE:
        bad.append(f"first loss {losses[0]:.4f} vs {ref[0]:.4f} ({first:.1%})")
    if last > LAST_TOLERANCE:
        bad.append(f"last-{LAST_N} mean {tail(losses):.4f} vs {tail(ref):.4f} ({last:.1%})")
    if len(losses) >= 10 and tail(losses) > losses[0] * (1 - MIN_DROP):
        bad.append(f"no drop: {losses[0]:.4f} -> {tail(losses):.4f}")
    return f"mismatch with {ref_name}: " + "; ".join(bad) if bad else "ok"


def best(rows: list[dict], engine: str) -> dict | None:
    """The engine's fastest row that ran and does not train differently from the reference."""
    done = [
        r
        for r in rows
        if r["engine"] == engine
        and r["exit"] == 0
        and r.get("tokens_per_s")
        and not str(r.get("loss_check") or "").startswith("mismatch")
    ]
    return max(done, key=lambda r: r["tokens_per_s"]) if done else None


# -- the table -----------------------------------------------------------------------------------------------


def gpu_peak() -> tuple[str, float | None]:
    """(CUDA's name of GPU 0, its dense bf16 FLOP/s from planner.gpus; None where it is not known)."""
    import torch

    name = torch.cuda.get_device_name(0)
    gpu = gpu_check.gpu_by_name(name)
    return name, gpu.bf16_flops if gpu else None


def fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-".rjust(int(spec.split(".")[0]))


def _check_cell(check: str | None) -> str:
    if check is None:
        return "-"
    return {"reference": "ref", "ok": "ok"}.get(check, "BAD")


def describe(row: dict, setup: Setup) -> str:
    """What the row ran, exactly: ftune's RunConfig switches, or the opponent's SFTConfig as set, what it
    used (with versions) and what it asked for and could not use (with the reason)."""
    if row.get("unavailable"):
        return f"unavailable: {row['unavailable']}"
    if row.get("skipped"):
        return str(row.get("error"))
    if row["engine"] == "ftune":
        run = CATALOG.get(row["run"])
        layers = "decoder layers compiled where the engine compiles them" if run and run.compile_layers else (
            "decoder layers eager (compile_layers false)")  # fmt: skip
        fused = "; fused functions compiled (training.fused jit)" if run and run.compiled == "fused" else ""
        return (f"training.run, method {setup.method}, packing {row['packing']}, gradient checkpointing "
                f"{setup.checkpointing}, LoRA weights fp32, {layers}{fused}; "
                f"attention {row.get('attn')}")  # fmt: skip
    opp = row.get("opponent") or {}
    config = opp.get("config") or {}
    if not config:
        return "did not get as far as its trainer"
    cfg = ", ".join(f"{k}={v!r}" for k, v in config.items())
    parts = [f"SFTConfig({cfg})", f"attn_implementation {row.get('attn')}",
             f"LoRA weights {'/'.join(row.get('lora_dtypes') or ['?'])}"]  # fmt: skip
    used = opp.get("used") or {}
    if used:
        parts.append("used: " + ", ".join(f"{k} {v}" for k, v in used.items()))
    if opp.get("notes"):
        parts.append("not used: " + "; ".join(opp["notes"]))
    versions = opp.get("versions") or {}
    parts.append(", ".join(f"{k} {v}" for k, v in versions.items() if v))
    return "; ".join(parts)


def print_table(rows: list[dict], setup: Setup) -> None:
    w = NAME_WIDTH
    print(
        f"{'run':{w}} {'exit':>4} {'steps':>5} {'tok/s':>8} {'loop tok/s':>10} {'ms/step':>8} "
        f"{'tok/step':>8} {'pad':>5} {'alloc GiB':>9} {'resv GiB':>8} {'MFU 6N':>6} {'MFU LoRA':>8} "
        f"{'loss':>7} {'check':>5}  attention"
    )
    for r in rows:
        gib = {k: (r[k] / 2**30 if r.get(k) else None) for k in ("max_allocated_bytes", "max_reserved_bytes")}
        cells = [
            fmt(r.get("tokens_per_s"), "8.0f"),
            fmt(r.get("loop_tokens_per_s"), "10.0f"),
            fmt(r.get("ms_per_step"), "8.1f"),
            fmt(r.get("tokens_per_step"), "8.0f"),
            fmt(r.get("padding_share"), "5.0%"),
            fmt(gib["max_allocated_bytes"], "9.2f"),
            fmt(gib["max_reserved_bytes"], "8.2f"),
            fmt(r.get("mfu_6n"), "6.1%"),
            fmt(r.get("mfu_lora"), "8.1%"),
            fmt(r.get("final_loss"), "7.4f"),
            f"{_check_cell(r.get('loss_check')):>5}",
        ]
        code = str(r["exit"]) if r["exit"] is not None else "skip" if r.get("skipped") else "T/O"
        print(f"{r['run']:{w}} {code:>4} {r.get('steps_done', 0):>5} {' '.join(cells)}  {r.get('attn', '-')}")
    # below the table, whose rows a reader (and the smoke test) takes line by line
    print("\nwhat each row ran:")
    for r in rows:
        print(f"  {r['run']}: {describe(r, setup)}")
        if r.get("error") and not r.get("skipped"):
            print(f"  {r['run']}: error: {r['error']}")
        for line in (r.get("log_tail") or [])[-4:]:  # a failed run's last lines (all 25: the JSON)
            print(f"  {r['run']}: | {line[:300]}")
        if str(r.get("loss_check") or "").startswith("mismatch"):
            print(f"  {r['run']}: loss {r['loss_check']}")
        if r.get("compile_steps_left_out"):
            print(f"  {r['run']}: {r['compile_steps_left_out']} step(s) after the warmup compiled: not timed")
    for r in rows:
        if r.get("compiled"):
            c = r["compiled"]
            print(f"{r['run']}: torch.compile made {c['graphs']} graphs, {c['recompiles']} recompiles, "
                  f"{c['graph_breaks']} graph breaks {c['break_reasons'] or ''}")  # fmt: skip
