"""A vision-language base (training.vision, training.demo_vlm): a tiny Qwen2.5-VL trains through the
recipe on examples/vision_colors.jsonl (LoRA and QLoRA); its inputs are the model's own (image processor,
get_rope_index); packing keeps each example's images and positions; the planner's image tokens are the
processor's; accumulation and 2-rank FSDP train what one big batch trains, as on the dense bases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.run_protocol import EXIT_OK, RunConfig
from core.spec import JobSpec
from core.storage import ADAPTER_DIR, METRICS_FILE
from planner.vision import image_tokens
from tests.training.test_fsdp import adapter, finish, launch
from tests.training.util import read_metrics, relative_difference
from training import vision
from training.data import collate
from training.demo_vlm import build_vlm_model
from training.loss import token_losses
from training.packing import collate_packed
from training.run import run

EXAMPLES = Path(__file__).parents[2] / "examples" / "vision_colors.jsonl"
ROWS = [json.loads(line) for line in EXAMPLES.read_text().splitlines()]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vlm_model(tmp_path_factory.mktemp("vlm"))


@pytest.fixture(scope="module")
def proc(vlm: Path) -> vision.Processor:
    return vision.load_processor(vlm)


def _model(vlm: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vlm, local_files_only=True).eval()


@pytest.mark.parametrize("size", [(12, 12), (40, 40), (28, 64), (300, 200), (1000, 90), (2000, 3000)])
def test_planner_image_tokens_are_the_processors(size: tuple[int, int]) -> None:
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    h, w = size
    for processor, bounds in (
        (Qwen2VLImageProcessorPil(), {}),  # the defaults Qwen2.5-VL-7B ships
        (Qwen2VLImageProcessorPil(min_pixels=784, max_pixels=12544), dict(min_pixels=784, max_pixels=12544)),
    ):  # fmt: skip
        grid = processor(images=[Image.new("RGB", (w, h))], return_tensors="pt")["image_grid_thw"]
        assert (
            image_tokens(h, w, **bounds)
            == int(grid.prod()) // 4
            == processor.get_number_of_image_patches(h, w, {}) // 4
        )


def test_positions_are_the_models_get_rope_index(vlm: Path, proc: vision.Processor) -> None:
    model = _model(vlm)
    row = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "first"}, ROWS[1]["messages"][0]["content"][0],
        {"type": "text", "text": "then"}, ROWS[5]["messages"][0]["content"][0]]},
        {"role": "assistant", "content": "two"}]}  # fmt: skip
    t = vision.tokenize_row(row, proc)
    ids = torch.tensor([t.input_ids])
    kinds = (ids == proc.image_token_id).int()
    expected, _ = model.model.get_rope_index(ids, kinds, image_grid_thw=t.image_grid_thw)
    assert t.image_grid_thw.shape[0] == 2 and kinds.sum() == int(t.image_grid_thw.prod(-1).sum()) // 4
    assert torch.equal(t.mrope_positions, expected[:, 0])
    assert all(
        label == -100 for i, label in zip(t.input_ids, t.labels, strict=True) if i == proc.image_token_id
    )


def test_packing_keeps_each_examples_images_and_positions(vlm: Path, proc: vision.Processor) -> None:
    from training.model import load_model

    spec = JobSpec(base_model="tiny-vlm", dataset_id="testdata01", packing=True, lora_dropout=0.0)
    model = load_model(spec, vlm, torch.device("cpu")).eval()  # the packed attention, a fresh (zero) LoRA
    items = [vision.tokenize_row(r, proc) for r in ROWS[:3]]
    with torch.no_grad():
        padded, _ = token_losses(model, collate(items, 0), torch.device("cpu"))
        packed, _ = token_losses(model, collate_packed(items), torch.device("cpu"))
        alone = torch.cat([token_losses(model, collate([t], 0), torch.device("cpu"))[0] for t in items])
        blind = collate(items, 0)
        del blind["pixel_values"], blind["image_grid_thw"]
        blind["input_ids"][blind["input_ids"] == proc.image_token_id] = 0
        without, _ = token_losses(model, blind, torch.device("cpu"))
    assert torch.allclose(packed, alone, atol=1e-5) and torch.allclose(padded, alone, atol=1e-5)
    assert (without - alone).abs().max() > 1e-3  # the images are read


def test_truncation_never_cuts_an_image(proc: vision.Processor) -> None:
    t = vision.tokenize_row(ROWS[1], proc)  # a 64 x 28 image: 2 tokens
    first_image = t.input_ids.index(proc.image_token_id)
    assert t.input_ids.count(proc.image_token_id) == 2
    assert t.cut(first_image + 1, proc.image_token_id) is None
    kept = t.cut(len(t.input_ids) - 1, proc.image_token_id)
    assert kept is not None and kept.length == t.length - 1 and kept.mrope_positions.shape[1] == kept.length


@pytest.mark.parametrize(
    ("method", "packing"),
    [("lora", False), ("lora", True), ("qlora", True)],
    ids=["padded", "packed", "qlora"],
)
def test_a_tiny_vlm_job_trains_an_adapter_that_changes_the_output(
    vlm: Path, tmp_path: Path, method: str, packing: bool
) -> None:
    from peft import PeftModel

    spec = JobSpec(
        base_model="tiny-vlm", dataset_id="testdata01", method=method, lora_r=8, lora_alpha=16,
        micro_batch_size=2, gradient_accumulation_steps=2, max_seq_len=64, learning_rate=2e-2,
        checkpoint_every_steps=0, warmup_steps=1, epochs=3, packing=packing,
    )  # fmt: skip
    out = tmp_path / "out"
    config = RunConfig(job_id="jobvlm", spec=spec, model_dir=str(vlm), dataset_path=str(EXAMPLES),
                       output_dir=str(out))  # fmt: skip
    assert run(config) == EXIT_OK
    steps = [r for r in read_metrics(out / METRICS_FILE) if r["type"] == "step"]
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3
    adapter = json.loads((out / ADAPTER_DIR / "adapter_config.json").read_text())
    assert not any(".visual." in name for name in adapter["target_modules"])  # the tower stays frozen
    batch = collate([vision.tokenize_row(ROWS[0], vision.load_processor(vlm))], 0)
    inputs = {k: batch[k] for k in ("input_ids", "pixel_values", "image_grid_thw", "position_ids")}
    base = _model(vlm)
    with torch.no_grad():
        before = base(**inputs).logits
        tuned = PeftModel.from_pretrained(base, out / ADAPTER_DIR)
        after = tuned(**inputs).logits
        assert (after - before).abs().max() > 1e-2
        with tuned.disable_adapter():
            assert torch.equal(tuned(**inputs).logits, before)


def test_qlora_quantizes_the_language_model_and_leaves_the_tower(vlm: Path) -> None:
    """4-bit NF4 for the language model's block linears; the frozen tower and projector and the head keep
    the base's precision (what the planner counts: planner/state.py)."""
    from bitsandbytes.nn import Linear4bit

    from training.model import load_model

    spec = JobSpec(base_model="tiny-vlm", dataset_id="testdata01", method="qlora", lora_r=8)
    net = load_model(spec, vlm, torch.device("cpu"))
    linears = {
        name: isinstance(m, Linear4bit) for name, m in net.named_modules() if isinstance(m, torch.nn.Linear)
    }
    quantized = [name for name, is_4bit in linears.items() if is_4bit]
    tower = [name for name in linears if ".visual." in name]
    assert quantized and all(".language_model.layers." in name for name in quantized)
    assert tower and any(".visual.merger." in name for name in tower)  # the projector is the tower's
    assert not any(linears[name] for name in tower) and not linears["base_model.model.lm_head"]


@pytest.mark.slow  # starts torchrun
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_every_split_of_the_global_batch_trains_the_same_adapter(
    make_config, vlm: Path, packing: bool
) -> None:
    """micro 4 x accumulation 1 = micro 1 x 4 = 2 FSDP ranks (torchrun, gloo) x micro 2, each tensor within
    1e-4 (relative Frobenius); half the global batch (the control) differs."""
    splits = {
        "one": {"micro_batch_size": 4, "gradient_accumulation_steps": 1},
        "accumulated": {"micro_batch_size": 1, "gradient_accumulation_steps": 4},
        "fsdp": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "num_gpus": 2},
        "control": {"micro_batch_size": 2, "gradient_accumulation_steps": 1},
    }
    configs = {
        name: make_config(
            ROWS, model_dir=vlm, name=name, learning_rate=2e-2, epochs=2, packing=packing, **split
        )
        for name, split in splits.items()
    }
    ranks = launch(configs["fsdp"], Path(configs["fsdp"].output_dir).parent)
    assert all(run(configs[name]) == EXIT_OK for name in ("one", "accumulated", "control"))  # meanwhile
    rc, log = finish(ranks)
    assert rc == 0 and "FSDP over 2 processes" in log, log[-3000:]
    adapters = {name: adapter(Path(c.output_dir)) for name, c in configs.items()}
    diffs = {name: relative_difference(adapters["one"], adapters[name]) for name in splits if name != "one"}
    print(f"\n{'packed' if packing else 'padded'}: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    assert diffs["accumulated"] <= 1e-4 and diffs["fsdp"] <= 1e-4
    assert diffs["control"] > 1e-2


def test_token_statistics_count_image_tokens_as_training_does(
    vlm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m training.token_stats` (what admission re-plans a job with) reads a vision base's data as
    training does, through its processor: an image is its tokens, not the one placeholder the chat
    template writes."""
    from training.model import load_tokenizer
    from training.objectives import objective_class
    from training.recipe import load_splits
    from training.token_stats import main

    fields = {"base_model": "tiny-vlm", "dataset_id": "testdata01", "max_seq_len": 64, "micro_batch_size": 2}
    assert main(["--model-dir", str(vlm), "--dataset", str(EXAMPLES), "--spec", json.dumps(fields)]) == 0
    got = json.loads(capsys.readouterr().out)
    spec = JobSpec(**fields)
    config = RunConfig(job_id="vlstats", spec=spec, model_dir=str(vlm), dataset_path=str(EXAMPLES),
                       output_dir="unused")  # fmt: skip
    _, _, _, trained = load_splits(config, load_tokenizer(vlm))  # training's own statistics
    assert {k: got[k] for k in trained} == trained
    _, _, text_only = objective_class(spec).load(EXAMPLES, load_tokenizer(vlm), spec, None)
    assert got["max"] > text_only["max"]


def test_a_vision_base_without_its_image_processor_names_no_path(
    vlm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its tokenizer loads, its processor does not: a tokenizer_error whose message names no path of the
    server's (the processor's own error does)."""
    import shutil

    from training.token_stats import main

    broken = tmp_path / "no-processor"
    shutil.copytree(vlm, broken, ignore=shutil.ignore_patterns("preprocessor_config.json", "*.safetensors"))
    fields = {"base_model": "tiny-vlm", "dataset_id": "testdata01"}
    assert main(["--model-dir", str(broken), "--dataset", str(EXAMPLES), "--spec", json.dumps(fields)]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "tokenizer_error" and str(tmp_path) not in error["message"], error
