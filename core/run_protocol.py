"""The contract between a worker and `python -m training.run run.json`: one definition, read by all.

The worker writes a RunConfig to run.json and starts training as a subprocess. Training appends one
JSON record per line to output_dir/metrics.jsonl (flushed and fsynced as it goes) and exits with an
exit code below; on failure it also writes output_dir/error.json ({"code", "message"}).

Records, in order of appearance (typed below, told apart by "type"):
  start       once per attempt: totals, the data's token statistics, resumed_from_step
  step        one per optimizer step: loss, lr, grad norm, tokens, speed, ETA, peak memory, and its
              objective's own metrics (sft: token accuracy; dpo: rewards, reward accuracy and margin,
              log-probs; grpo: rl, the rollouts' rewards and timing)
  eval        after an evaluation: eval loss, the best so far, and its objective's own metrics (sft: token
              accuracy and tokens; dpo: as its step's; grpo: rl)
  checkpoint  after a checkpoint is complete on disk
  samples     before/after greedy completions (spec.sample_prompts): at an evaluation (sample_at_eval)
              and at the end, before done
  stopped     after a stop request (SIGTERM), last: the run saved a checkpoint and will resume
  done        the adapter (and a merged export, if asked) is written, last

The file is append-only, also across resumes: a process killed after its last checkpoint may have
written step records that the resumed process repeats. The resume rule: a start record with
resumed_from_step = k supersedes every earlier step, eval, checkpoint and samples record with step > k
(samples at step k itself, e.g. the end's when a run died before done, are kept: latest_samples
keeps one set per (step, at), the newest).
`read_records` applies it; every reader (worker, API, tests) goes through it or through RecordTail.

A step or eval record carries the metrics its objective set (OBJECTIVE_FIELDS; encode leaves the other
objectives' out), and reads the others as None: files written before, which held every objective's
fields (null where not its own), read the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from core.judge_config import JudgeConfig
from core.spec import JobSpec

if TYPE_CHECKING:  # the training process never loads the service's settings
    from core.settings import Settings

# Exit codes of `python -m training.run`. torchrun reports any non-zero exit of its ranks as 1, so a
# stop under torchrun is read from the records (a "stopped" record), not from the code.
EXIT_OK = 0  # done: output_dir/adapter/ written
EXIT_FAILED = 1  # failed: output_dir/error.json written
EXIT_USAGE = 2  # bad command line
EXIT_STOPPED = 3  # stopped by SIGTERM after the current step and a checkpoint; resumable


class GradingConfig(BaseModel):
    """How a grpo run grades (graders), from the worker's settings: python graders in the sandbox
    (None: off), the judge of score_model and label_model graders with the operator's bounds (None: none),
    the job's tenant, for whom the judge answers (written by the worker, worker.run_config), and the
    threads grading."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    python_cpu_seconds: int | None = None  # None: python graders are off
    python_memory_mb: int = 512
    python_timeout_seconds: float = 30
    judge: JudgeConfig | None = None
    tenant_id: str = ""
    concurrency: int = 8

    @classmethod
    def from_settings(cls, settings: Settings) -> GradingConfig:
        return cls(
            python_cpu_seconds=settings.python_grader_cpu_seconds if settings.python_grader_enabled else None,
            python_memory_mb=settings.python_grader_memory_mb,
            python_timeout_seconds=settings.python_grader_timeout_seconds,
            judge=JudgeConfig.from_settings(settings),
            concurrency=settings.grader_concurrency,
        )


class RunConfig(BaseModel):
    """What the worker hands to `python -m training.run run.json`: the spec plus resolved local paths."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    spec: JobSpec
    model_dir: str
    dataset_path: str
    output_dir: str
    # The upload's column mapping, applied when the examples are read (core.data.examples.read_examples).
    column_mapping: dict[str, str] | None = None
    # spec.validation_dataset_id's file and column mapping, when the spec names one.
    validation_path: str | None = None
    validation_column_mapping: dict[str, str] | None = None
    # spec.init_from's adapter directory (the earlier job's output adapter/), resolved by the worker.
    init_adapter_dir: str | None = None
    grading: GradingConfig = GradingConfig()  # objective grpo: how its samples are graded
    # torch.compile the decoder layers' training step where the engine does (training.compiled): the
    # worker's settings.compile_layers
    compile_layers: bool = True
    # The bytes the job's files may take in output_dir (planner.job_files: reserved in its tenant's storage
    # quota at admission); a checkpoint, the adapter or the merged export that would pass it fails the run
    # with storage_quota_exceeded. None: no bound (a job admitted before allowances existed).
    files_allowance_bytes: int | None = None


class _Record(BaseModel):
    # Readers ignore fields they do not know (a newer trainer); JSON has no NaN: a diverged loss is null.
    model_config = ConfigDict(extra="ignore", frozen=True, ser_json_inf_nan="null")


class StartRecord(_Record):
    type: Literal["start"] = "start"
    total_steps: int
    num_examples: int
    num_validation_examples: int = 0
    dropped_examples: int = 0
    token_stats: dict[str, Any] | None = None  # count, p50, p95, max, ... of the training file
    trainable_params: int | None = None
    resumed_from_step: int = 0
    predicted_peak_bytes: int | None = None  # the plan on the device this attempt runs on: allocated bytes
    # and, on CUDA, what max_memory_reserved should reach (the plan's total less the CUDA context)
    predicted_reserved_bytes: int | None = None


class PreferenceMetrics(_Record):
    """Objective dpo's own metrics (training.objectives.dpo.metrics), means over a step's pairs (an eval
    record: the validation pairs, its eval_loss their DPO loss): rewards (beta x the log-prob ratio to the
    reference; simpo: beta x the mean token log-prob), the share of pairs whose chosen reward is higher,
    and the completions' summed log-probs. Flat in the step and eval records, as readers have them."""

    rewards_chosen: float | None = None
    rewards_rejected: float | None = None
    rewards_margin: float | None = None
    rewards_accuracy: float | None = None
    logps_chosen: float | None = None
    logps_rejected: float | None = None


class RLMetrics(_Record):
    """Objective grpo's own metrics (training.objectives.grpo.metrics): a step's rollouts and their grades
    (an eval record: the validation prompts' greedy answers). Means over the graded samples; `scores`:
    each named grader of a multi grader; `errors`: how many samples hit each of OpenAI's grader errors;
    `timing`: seconds."""

    samples: int
    reward_mean: float | None = None  # over the samples whose reward is a number
    reward_std: float | None = None
    scores: dict[str, float] = Field(default_factory=dict)
    errors: dict[str, int] = Field(default_factory=dict)
    completion_tokens_mean: float | None = None
    truncated_share: float | None = None  # samples cut off by max_completion_tokens
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_region: float | None = None
    kl: float | None = None  # with beta > 0: the mean k3 KL to the reference
    timing: dict[str, float] = Field(default_factory=dict)  # sampling, grading, training


class StepRecord(PreferenceMetrics):
    type: Literal["step"] = "step"
    step: int
    total_steps: int
    epoch: float  # fractional: 2.5 is half-way through the third epoch
    loss: float | None
    lr: float
    grad_norm: float | None = None
    tokens: int  # input tokens (not padding) of the step
    target_tokens: int | None = None  # tokens the loss is taken on
    tokens_per_s: float | None = None
    elapsed_s: float  # training time so far, summed over resumed attempts
    eta_s: float | None = None
    peak_mem_bytes: int | None = None  # CUDA: max_memory_allocated; a CPU: live tensor bytes
    peak_reserved_bytes: int | None = None  # CUDA: max_memory_reserved (the allocator's segments)
    # The objective's own metrics (OBJECTIVE_FIELDS), dpo's from PreferenceMetrics.
    # sft: share of the step's target tokens whose argmax prediction is the label (all micro-batches and
    # ranks, so the same for every split of the step)
    token_accuracy: float | None = None
    rl: RLMetrics | None = None  # grpo: rewards, grader errors, timing


class EvalRecord(PreferenceMetrics):
    type: Literal["eval"] = "eval"
    step: int
    eval_loss: float | None
    # The objective's own metrics (OBJECTIVE_FIELDS), dpo's from PreferenceMetrics: sft's token accuracy
    # and tokens, grpo's rl (the validation prompts' rewards; eval_loss is null).
    eval_token_accuracy: float | None = None
    eval_tokens: int | None = None
    best_eval_loss: float | None = None
    rl: RLMetrics | None = None


class CheckpointRecord(_Record):
    type: Literal["checkpoint"] = "checkpoint"
    step: int
    path: str


class SampleItem(_Record):
    """One prompt (as given, or a dataset example's prompt) and its two greedy completions."""

    prompt: str | list[dict[str, str]]  # a string, or chat messages ({"role", "content"})
    base: str  # the base model's completion (the adapter disabled)
    tuned: str  # the fine-tuned model's completion


class SamplesRecord(_Record):
    type: Literal["samples"] = "samples"
    step: int
    at: Literal["eval", "end"]
    items: list[SampleItem]


class StoppedRecord(_Record):
    type: Literal["stopped"] = "stopped"
    step: int


class DoneRecord(_Record):
    type: Literal["done"] = "done"
    step: int
    final_loss: float | None = None
    adapter_dir: str
    stopped_early: bool = False
    best_eval_loss: float | None = None
    merged_dir: str | None = None


Record = Annotated[
    StartRecord | StepRecord | EvalRecord | CheckpointRecord | SamplesRecord | StoppedRecord | DoneRecord,
    Field(discriminator="type"),
]
_RECORD: TypeAdapter[Record] = TypeAdapter(Record)
SUPERSEDED_BY_RESUME = (StepRecord, EvalRecord, CheckpointRecord, SamplesRecord)


_PREFERENCE = tuple(PreferenceMetrics.model_fields)
# Each objective's own fields of a step and of an eval record.
OBJECTIVE_FIELDS: dict[type[_Record], dict[str, tuple[str, ...]]] = {
    StepRecord: {"sft": ("token_accuracy",), "dpo": _PREFERENCE, "grpo": ("rl",)},
    EvalRecord: {"sft": ("eval_token_accuracy", "eval_tokens"), "dpo": _PREFERENCE, "grpo": ("rl",)},
}


def encode(record: _Record) -> str:
    """One line of metrics.jsonl (without the newline). A step or eval record's objective fields are
    written where its objective set them (training.recipe passes the objective's own), not the others'."""
    by_objective = OBJECTIVE_FIELDS.get(type(record), {})
    unset = {f for fields in by_objective.values() for f in fields if f not in record.model_fields_set}
    return record.model_dump_json(exclude=unset or None)


def parse_record(line: bytes | str) -> Record | None:
    """A record, or None for a torn line (the writer was killed mid-write) or a foreign one."""
    try:
        return _RECORD.validate_json(line)
    except ValidationError:
        return None


def apply_resume_rule(records: list[Record], new: Record) -> list[Record]:
    """`records` with `new` appended, after dropping what `new` supersedes (see the module doc)."""
    if isinstance(new, StartRecord) and new.resumed_from_step:
        k = new.resumed_from_step
        records = [r for r in records if not (isinstance(r, SUPERSEDED_BY_RESUME) and r.step > k)]
    records.append(new)
    return records


def read_records(path: Path) -> list[Record]:
    """The records of a metrics file as they stand after every resume (superseded ones dropped)."""
    records: list[Record] = []
    if not path.is_file():
        return records
    with path.open("rb") as f:
        for line in f:
            rec = parse_record(line)
            if rec is not None:
                records = apply_resume_rule(records, rec)
    return records


class RecordTail:
    """The new complete records of a metrics file that another process appends to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read_new(self) -> list[Record]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [rec for rec in map(parse_record, lines) if rec is not None]


def latest_samples(records: list[Record]) -> list[SamplesRecord]:
    """The samples records in order, one per (step, at): a resumed run that samples again at the same
    point (its end, when it died before done) replaces the earlier set instead of adding one."""
    kept: dict[tuple[int, str], SamplesRecord] = {}
    for r in records:
        if isinstance(r, SamplesRecord):
            kept.pop((r.step, r.at), None)
            kept[(r.step, r.at)] = r
    return sorted(kept.values(), key=lambda r: (r.step, r.at == "end"))


def read_error(path: Path) -> tuple[str, str] | None:
    """(code, message) of an error.json, or None if there is none or it is unreadable."""
    try:
        err = json.loads(path.read_text())
        return str(err["code"]), str(err["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
