"""ftune's memory plan of a job copy, for --dry-run: the create request mapped onto a JobSpec as ftune's /v1
maps it (api.openai.hyperparameters, the one definition of that mapping), then planned by the
destination's POST /plan, which changes nothing.

`batch_size` is split as /v1 splits it where nothing else decides: the largest micro-batch up to JobSpec's
default that divides the batch per GPU, smaller ones tried while the plan does not fit. The plan is the
worst case (every micro-batch full length); ftune plans again from the data's lengths when a job is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import openai
from pydantic import ValidationError

from cli.openai_import.endpoints import Endpoints

GIB = 2**30


@dataclass(frozen=True)
class Planned:
    line: str  # what to print under the job ("" when refused)
    refusal: str | None = None  # why ftune would refuse the job: a bad setting, a model it does not have


def _micro_batches(per_gpu: int | None, default: int) -> list[int]:
    """The micro-batches to try, largest first: divisors of the batch per GPU up to `default`."""
    from core.spec import limits

    if per_gpu is None:  # the split was given as settings of its own
        return [0]
    most = limits("gradient_accumulation_steps")["le"]
    return [d for d in range(min(per_gpu, default), 0, -1) if per_gpu % d == 0 and per_gpu // d <= most]


def _spec_fields(body: dict[str, Any]) -> tuple[dict[str, Any], int | None, int] | str:
    """(the JobSpec's fields as set, the batch per GPU to split or None, JobSpec's default micro-batch), or
    why ftune would refuse the request."""
    from api.openai.hyperparameters import (
        DEFAULT_MICRO,
        CreateJobRequest,
        build_spec,
        map_request,
        per_gpu_batch,
    )
    from core.errors import FtuneError

    try:
        mapped = map_request(CreateJobRequest.model_validate(body), body["model"], None)
        spec = build_spec(mapped.fields)
        per_gpu = None if mapped.batch_size is None else per_gpu_batch(mapped.batch_size, spec.num_gpus)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"ftune would refuse it: {where}: {first['msg']}"
    except FtuneError as e:
        return f"ftune would refuse it ({e.code}): {e.message}"
    return spec.model_dump(mode="json", exclude_unset=True), per_gpu, DEFAULT_MICRO


def _line(plan: dict[str, Any], micro: int, accumulation: int) -> str:
    verdict = "fits" if plan["fits"] else "does NOT fit in the worst case"
    line = (
        f"memory plan on {plan['gpu']} x{plan['num_gpus']}: {plan['total_bytes'] / GIB:.2f} GiB per GPU of "
        f"{plan['usable_bytes'] / GIB:.2f} usable, {verdict} (micro-batch {micro} x {accumulation})"
    )
    if not plan["fits"] and plan.get("suggestions"):
        line += f"; suggestion: {plan['suggestions'][0]['description']}"
    return line


def plan(ep: Endpoints, body: dict[str, Any], gpu: str | None) -> Planned:
    """The memory plan of the job `body` would create (its files may still be stand-ins: no matter)."""
    from api.openai.hyperparameters import DEFAULT_ACCUM as accum

    if str(body["model"]).startswith("ft:"):
        return Planned("memory plan: made when the job is created (its base is a fine-tuned model)")
    fields = _spec_fields(body)
    if isinstance(fields, str):
        return Planned("", fields)
    spec, per_gpu, default = fields
    line = ""
    for micro in _micro_batches(per_gpu, default):
        asked = dict(spec)
        if per_gpu is not None:  # micro-batch x accumulation = the batch per GPU
            asked |= {"micro_batch_size": micro, "gradient_accumulation_steps": per_gpu // micro}
        try:
            sent = asked | ({"gpu": gpu} if gpu else {})
            result = cast(dict[str, Any], ep.dest.post(f"{ep.dest_root}/plan", body=sent, cast_to=object))
        except openai.APIStatusError as e:
            if e.status_code == 503:  # no worker has reported its devices, and no GPU was named
                return Planned(f"memory plan: none ({ep.reason(e)}); --gpu names a GPU to plan on")
            return Planned("", ep.reason(e))
        split_as = asked.get("micro_batch_size", default), asked.get("gradient_accumulation_steps", accum)
        line = _line(result, *split_as)
        if result["fits"]:
            break
    return Planned(line)
