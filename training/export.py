"""What a finished run leaves: the adapter (peft's safetensors format + a model card), and for
`export: merged` the base model with the trained adapter folded into its weights, in safetensors.

The base is loaded unquantized (its checkpoint dtype) even for QLoRA: merging into 4-bit weights would
round the update away, so a QLoRA adapter is merged into the full-precision base, as is usual.
The merge runs on the CPU, after training has finished with the GPU.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

from core.run_protocol import RunConfig
from core.storage import atomic_dir
from training.step import Position


def save_adapter(
    net: torch.nn.Module, weights: dict[str, torch.Tensor], adapter_dir: Path, base_model: str, card: str
) -> None:
    """peft's safetensors adapter + adapter_config.json + a model card, renamed into place.

    `weights` are the whole trainable tensors by name (gathered from all ranks under FSDP)."""
    with atomic_dir(adapter_dir) as tmp:
        # the trained adapter only ("default"), not a continued job's frozen reference (training.reference)
        net.save_pretrained(  # type: ignore[operator]
            tmp, safe_serialization=True, state_dict=weights, selected_adapters=["default"]
        )
        cfg_path = tmp / "adapter_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["base_model_name_or_path"] = base_model  # a name, not this server's path
        cfg_path.write_text(json.dumps(cfg, indent=2))
        (tmp / "README.md").write_text(card)


def _installed_version(name: str) -> str | None:
    """A package's version without importing it (a lora job on a machine without bitsandbytes: None)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def model_card(config: RunConfig, *, final_loss: float | None, pos: Position, peak: int) -> str:
    import peft
    import transformers

    spec = config.spec
    versions = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "bitsandbytes": _installed_version("bitsandbytes"),
    }
    final: dict[str, Any] = {
        "steps": pos.step,
        "final_loss": final_loss,
        "first_loss": pos.losses[0] if pos.losses else None,
        "tokens_seen": pos.tokens_seen,
        "train_seconds": round(pos.elapsed_s, 1),
        "peak_mem_bytes": peak,
        "best_eval_loss": pos.best_eval_loss,
        "stopped_early": pos.stopped_early,
    }
    return "\n".join(
        [
            f"# LoRA adapter for {spec.base_model}",
            "",
            f"Trained by ftune, job `{config.job_id}`, method `{spec.method}`, seed {spec.seed}.",
            "",
            f"Dataset `{spec.dataset_id}`, sha256 `{file_sha256(Path(config.dataset_path))}`.",
            "",
            "```python",
            "from peft import PeftModel",
            f"model = PeftModel.from_pretrained(base_model, 'path/to/this/dir')  # base: {spec.base_model}",
            "```",
            "",
            "## Spec",
            "```json",
            json.dumps(spec.model_dump(mode="json"), indent=2),
            "```",
            "## Final metrics",
            "```json",
            json.dumps(final, indent=2),
            "```",
            "## Library versions",
            "```json",
            json.dumps(versions, indent=2),
            "```",
            "",
        ]
    )


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def export_merged(model_dir: Path, adapter_dir: Path, dest: Path, dtype: torch.dtype) -> Path:
    """Write model_dir + adapter_dir merged to `dest` (config, safetensors weights, tokenizer), atomically."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = {"local_files_only": True, "trust_remote_code": False}
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **local)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    with atomic_dir(dest) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(model_dir, **local).save_pretrained(tmp)
    return dest
