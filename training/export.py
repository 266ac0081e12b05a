"""`export: merged`: the base model with the trained adapter folded into its weights, in safetensors.

The base is loaded unquantized (its checkpoint dtype) even for QLoRA: merging into 4-bit weights would
round the update away, so a QLoRA adapter is merged into the full-precision base, as is usual.
The merge runs on the CPU, after training has finished with the GPU.
"""

from __future__ import annotations

from pathlib import Path

import torch

from core.storage import atomic_dir


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
