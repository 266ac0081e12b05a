"""Nothing untrusted is unpickled and no remote code runs: a guard over the product's source."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "core", "models", "training", "worker", "cli", "inference")
FORBIDDEN = {
    r"\btorch\.load\(": "torch.load unpickles; checkpoints and adapters are safetensors",
    r"\bimport pickle\b|\bpickle\.loads?\(|\bdill\b|\bjoblib\.load\(": "pickle",
    r"trust_remote_code[\"']?\s*[:=]\s*True": "trust_remote_code must stay off",
    r"weights_only\s*=\s*False": "unrestricted unpickling",
    r"\byaml\.load\(": "yaml.load can build objects; use yaml.safe_load",
    r"\bextractall\((?![^)]*filter=)": "tar extraction without a filter can write outside its target",
}


def test_no_unsafe_loading_in_product_code() -> None:
    hits = []
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            text = path.read_text()
            for pattern, why in FORBIDDEN.items():
                for m in re.finditer(pattern, text):
                    line = text.count("\n", 0, m.start()) + 1
                    hits.append(f"{path.relative_to(REPO)}:{line}: {why}")
    assert not hits, "\n".join(hits)


def test_the_guard_can_fail() -> None:
    samples = ["torch.load(p)", 'x = {"trust_remote_code": True}', "yaml.load(f)", "t.extractall(d)"]
    for sample in samples:
        assert any(re.search(p, sample) for p in FORBIDDEN), sample
    assert not any(re.search(p, 'tar.extractall(out, filter="data")') for p in FORBIDDEN)
