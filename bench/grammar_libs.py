"""The grammar libraries for structured outputs, side by side on the demo model's tokenizer: llguidance
(what ftune uses: training/decoding/constraint.py) and xgrammar (when installed: `pip install xgrammar`;
it brings triton and a TVM runtime, which is why ftune does not depend on it).

    .venv/bin/python bench/grammar_libs.py [--samples 100]

For issue 40's schema (an enum string and an integer 0-9, compact JSON) each library:
  - compiles the schema (ms);
  - computes the token mask for a fixed answer, token by token (median us a token, the first apart);
  - drives `--samples` random "models" (logits drawn from a seeded generator, temperature 1, at most 64
    tokens) through its mask: how many answers parse and validate.
Prints one row per library.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.inference.test_tools_server import PICK  # noqa: E402
from training.demo import build_demo_model  # noqa: E402

SCHEMA = PICK  # issue 40's: an enum string and a small integer
ANSWER = '{"color":"green","n":7}'


class Lib:
    """A library's matcher behind two calls: mask(matcher, vocab) -> the tokens allowed (the end token once
    the JSON is whole), matcher.accept(token)."""

    def __init__(self, name: str, start: Callable[[], Any], mask: Callable[[Any, int], torch.Tensor]) -> None:
        self.name, self.start, self.mask = name, start, mask


def llguidance_lib(tokenizer: Any) -> tuple[Lib, float]:
    from training.decoding.constraint import Grammar

    began = time.perf_counter()
    grammar = Grammar.json_schema(tokenizer, SCHEMA)
    compiled = time.perf_counter() - began

    def mask(constraint: Any, vocab: int) -> torch.Tensor:
        logits = torch.zeros(vocab)
        constraint.restrict(logits, {tokenizer.eos_token_id})
        return logits == 0

    lib = Lib("llguidance", grammar.constraint, mask)
    return lib, compiled


def xgrammar_lib(tokenizer: Any, vocab: int) -> tuple[Lib, float] | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    began = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
    )
    seconds = time.perf_counter() - began

    class Matcher:
        def __init__(self) -> None:
            self.m = xgr.GrammarMatcher(compiled)
            self.bits = xgr.allocate_token_bitmask(1, vocab)

        def accept(self, token: int) -> None:
            self.m.accept_token(token)

    def mask(matcher: Any, vocab: int) -> torch.Tensor:
        logits = torch.zeros(1, vocab)
        matcher.m.fill_next_token_bitmask(matcher.bits)
        xgr.apply_token_bitmask_inplace(logits, matcher.bits)
        return logits[0] == 0

    return Lib("xgrammar", Matcher, mask), seconds


def mask_costs(lib: Lib, ids: list[int], vocab: int, repeats: int = 50) -> tuple[float, float]:
    firsts, rest = [], []
    for _ in range(repeats):
        matcher = lib.start()
        for k, token in enumerate(ids):
            began = time.perf_counter()
            lib.mask(matcher, vocab)
            (firsts if k == 0 else rest).append(time.perf_counter() - began)
            matcher.accept(token)
    return statistics.median(firsts), statistics.median(rest)


def valid_answers(lib: Lib, tokenizer: Any, vocab: int, samples: int) -> int:
    import jsonschema

    eos, good = tokenizer.eos_token_id, 0
    invalid = (ValueError, jsonschema.ValidationError)  # not JSON, or not the schema's
    for seed in range(samples):
        draw, matcher, ids = torch.Generator().manual_seed(seed), lib.start(), []
        for _ in range(64):
            logits = torch.randn(vocab, generator=draw).masked_fill(~lib.mask(matcher, vocab), float("-inf"))
            token = int(torch.multinomial(logits.softmax(-1), 1, generator=draw))
            if token == eos:
                break
            ids.append(token)
            matcher.accept(token)
        try:
            jsonschema.validate(json.loads(tokenizer.decode(ids)), SCHEMA)
            good += 1
        except invalid:
            pass
    return good


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=100)
    args = p.parse_args()
    from transformers import AutoTokenizer

    model_dir = build_demo_model(Path(tempfile.mkdtemp(prefix="ftune-bench-grammar-")) / "models")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = len(tokenizer)
    ids = [*tokenizer.encode(ANSWER, add_special_tokens=False), tokenizer.eos_token_id]
    libs = [llguidance_lib(tokenizer), xgrammar_lib(tokenizer, vocab)]
    print(f"demo tokenizer, vocab {vocab}; schema: an enum string and an integer 0-9, compact JSON")
    print(f"{'library':12}{'compile ms':>12}{'first mask us':>15}{'mask us/token':>15}{'valid':>10}")
    for found in libs:
        if found is None:
            print(f"{'xgrammar':12}  not installed (pip install xgrammar)")
            continue
        lib, compiled = found
        first, rest = mask_costs(lib, ids, vocab)
        good = valid_answers(lib, tokenizer, vocab, args.samples)
        print(
            f"{lib.name:12}{compiled * 1e3:>12.1f}{first * 1e6:>15.1f}{rest * 1e6:>15.1f}"
            f"{f'{good}/{args.samples}':>10}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
