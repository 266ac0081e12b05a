"""The run of `ftune import-openai`: list the source, copy its files, then its job definitions; a progress
line for each item, the end report last. A dry run only reads (and asks POST /plan, which stores nothing).
"""

from __future__ import annotations

import sys
from typing import Any

import openai
from openai.types.fine_tuning import FineTuningJob

from cli.openai_import import jobs as jobs_mod
from cli.openai_import.endpoints import Endpoints, SetupError, connect
from cli.openai_import.files import FileMap, copy_files
from cli.openai_import.memory import plan
from cli.openai_import.options import Options
from cli.openai_import.report import Outcome, Report
from core.settings import Settings

Result = tuple[Outcome, str | None, str]  # (outcome, ftune's id, detail)


def _create(ep: Endpoints, job: FineTuningJob, body: dict[str, Any], paused: bool) -> Result:
    """Create the copy once (its Idempotency-Key), and pause it at once if asked."""
    try:
        raw = ep.dest.fine_tuning.jobs.with_raw_response.create(
            **body, extra_headers=ep.idempotency_key("job", job.id)
        )
    except openai.APIStatusError as e:
        if e.code == "idempotency_key_reused":
            return Outcome.NOT_MOVED, None, "copied before with another definition (a changed --model?)"
        return Outcome.NOT_MOVED, None, ep.reason(e)
    copy = raw.parse()
    if raw.headers.get("idempotent-replayed") == "true":
        return Outcome.THERE, copy.id, ""
    if paused:
        try:
            ep.dest.fine_tuning.jobs.pause(copy.id)
        except openai.APIStatusError as e:
            return Outcome.MOVED, copy.id, f"(not paused: {ep.reason(e)})"
    return Outcome.MOVED, copy.id, "(paused)" if paused else ""


def copy_job(ep: Endpoints, options: Options, job: FineTuningJob, files: FileMap) -> tuple[Result, list[str]]:
    """(what became of one source job, lines to print under it)."""
    if job.status not in jobs_mod.COPIED_STATUSES and not options.include_failed:
        why = "not copied by default (--include-failed copies failed and cancelled jobs too)"
        return (Outcome.NOT_MOVED, None, why), []
    made = jobs_mod.definition(job, options.models, files)
    if isinstance(made, str):
        return (Outcome.NOT_MOVED, None, made), []
    if options.dry_run:
        planned = plan(ep, made.body, options.gpu)
        if planned.refusal is not None:
            return (Outcome.NOT_MOVED, None, planned.refusal), made.notes
        return (Outcome.MOVED, None, ""), [planned.line, *made.notes]
    return _create(ep, job, made.body, options.paused), made.notes


def copy_jobs(
    ep: Endpoints,
    options: Options,
    report: Report,
    files: FileMap,
    source: list[FineTuningJob],
    copies: dict[str, FineTuningJob],
) -> None:
    for job in source:
        what = jobs_mod.describe(job, options.models)
        if (copy := copies.get(job.id)) is not None:
            report.add("job", job.id, Outcome.THERE, copy.id, what)
            continue
        (outcome, dest_id, detail), notes = copy_job(ep, options, job, files)
        detail = f"{what}: {detail}" if outcome is Outcome.NOT_MOVED else f"{what} {detail}".rstrip()
        report.add("job", job.id, outcome, dest_id, detail)
        for line in notes:
            if line:
                report.note(line)


def _import(ep: Endpoints, options: Options, report: Report) -> None:
    source = jobs_mod.source_jobs(ep.source.fine_tuning.jobs)
    copies = jobs_mod.imported(ep.dest.fine_tuning.jobs)
    report.say(f"{len(source)} job(s) on the source; {len(copies)} of them already imported into ftune")
    files = copy_files(ep, report, jobs_mod.known_files(source, copies))
    copy_jobs(ep, options, report, files, source, copies)


def run(options: Options, settings: Settings) -> int:
    """The import; its exit status: 0 all in ftune, 1 something not moved (listed), 2 it could not run."""
    try:
        ep = connect(options, settings)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = Report(options.dry_run)
    mode = "dry run: nothing will change" if options.dry_run else "copying"
    report.say(f"from {ep.source_url} into ftune at {ep.dest_url} ({mode})")
    try:
        _import(ep, options, report)
    except openai.APIError as e:  # a list the run needs, or an end that went away: stop, say how far
        report.finish()
        print(f"stopped: {ep.reason(e)}; what was copied stays, a rerun goes on from there", file=sys.stderr)
        return 2
    finally:
        ep.close()
    return report.finish()
