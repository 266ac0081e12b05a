"""`ftune` subcommands. Heavy imports (torch, celery, uvicorn) happen inside the command that needs them."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from cli.openai_import.options import add_arguments as add_import_arguments
from core.settings import Settings, get_settings


def cmd_migrate(_: argparse.Namespace) -> int:
    from models.migrate import upgrade

    settings = get_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.resolved_database_url)
    print(f"database at head: {settings.resolved_database_url}")
    return 0


def cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    settings = get_settings()
    uvicorn.run(
        "api.main:create_app",
        factory=True,
        host=args.host or settings.api_host,
        port=args.port or settings.api_port,
        log_level="info",
        timeout_graceful_shutdown=10,
    )
    return 0


def cmd_inference(args: argparse.Namespace) -> int:
    """The inference engine alone, as docker-compose runs it beside the API: `python -m inference.server`
    with its own flags, and (as `ftune up` starts it) only adapters under the job directories loadable."""
    from inference.server import main as serve

    engine_args = list(args.engine_args)
    if not any(a.split("=")[0] == "--adapter-root" for a in engine_args):
        engine_args += ["--adapter-root", str(get_settings().data_dir / "jobs")]
    serve(engine_args)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    settings = get_settings()
    if not settings.redis_url:
        print("FTUNE_REDIS_URL is not set (ftune up starts an embedded broker for you)", file=sys.stderr)
        return 2
    from worker.tasks import app

    app.worker_main(worker_argv(settings, cpu=args.queue == "cpu", concurrency=args.concurrency))
    return 0


def worker_argv(settings: Settings, *, cpu: bool, concurrency: int | None) -> list[str]:
    """The Celery worker's command line. Two kinds of worker process, so short CPU work never waits behind
    a training job that holds a jobs worker (prefetch 1) for hours: "jobs" trains, one job per slot; "cpu"
    computes token statistics. A trainer consumes the shared queue, its device class's and its own (the
    wake-ups of the nodes it is leased as: core.queues), so its id is fixed here, before the runner reads
    it (settings.worker_name: FTUNE_WORKER_NAME, or a name made once for this process)."""
    from core.queues import CPU_QUEUE, QUEUE, class_queue, worker_queue
    from worker.devices import detect_devices
    from worker.runner import worker_id

    named = bool(settings.worker_name)
    settings.worker_name = settings.worker_name or worker_id()
    devices = detect_devices(settings.worker_devices)
    jobs_queues = f"{QUEUE},{class_queue(devices)},{worker_queue(settings.worker_name)}"
    # The slots as run, also where the runner reads them (each run's share of the CPUs: threads_per_run)
    settings.worker_concurrency = concurrency or (1 if cpu else settings.worker_concurrency)
    argv = [
        "worker",
        "--pool=threads",
        f"--concurrency={settings.worker_concurrency}",
        f"--queues={CPU_QUEUE if cpu else jobs_queues}",
        "--loglevel=INFO",
        "--without-gossip",
        "--without-mingle",
    ]
    if named:  # else Celery's own (celery@host), which health checks address
        argv.append(f"--hostname={settings.worker_name}{'-cpu' if cpu else ''}")
    return argv


def cmd_reaper(args: argparse.Namespace) -> int:
    import time

    from worker.tasks import reap_now

    while True:
        print(json.dumps(reap_now()))
        if args.once:
            return 0
        time.sleep(args.interval)


def cmd_models_build_demo(args: argparse.Namespace) -> int:
    from training.demo import build_demo_model

    models_dir = get_settings().models_dir
    if args.family == "llama":
        path = build_demo_model(models_dir, force=args.force)
    elif args.family == "qwen2_5_vl":  # a tiny vision-language base (training.demo_vlm)
        from training.demo_vlm import build_vlm_model

        path = build_vlm_model(models_dir, force=args.force)
    else:  # a tiny mixture-of-experts base of transformers' own class (training.demo_moe)
        from training.demo_moe import build_moe_model

        name = f"ftune-demo-{args.family.replace('_', '-')}"
        path = build_moe_model(models_dir, name=name, family=args.family, force=args.force)
    print(f"demo model ready: {path}")
    return 0


def cmd_models_list(_: argparse.Namespace) -> int:
    from core.catalog import Catalog

    settings = get_settings()
    for m in Catalog(settings.models_dir, settings.hf_cache_dir).list():
        size = f"{m.total_params:,}" if m.total_params else "?"
        if m.active_params and m.active_params != m.total_params:
            size += f" ({m.active_params:,} active)"
        print(f"{m.name}\t{m.architecture}\t{m.source}\t{m.path}\t{m.family}\t{size}\t{m.modality}")
    return 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    """Download a base model from the Hub (core.hub: checked, safetensors only) into FTUNE_MODELS_DIR."""
    from core.errors import FtuneError
    from core.hub import pull

    for name in ("httpx", "httpx2"):  # one INFO line per request would bury the progress lines
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        settings = get_settings()
        pull(
            args.repo_id,
            settings.models_dir,
            revision=args.revision,
            force=args.force,
            say=lambda line: print(line, flush=True),
            max_file_bytes=settings.hub_max_file_bytes,
        )
    except FtuneError as e:
        print(f"error ({e.code}): {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "interrupted: the files already down are kept; run the same command to continue", file=sys.stderr
        )
        return 130
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from core.arch import load_architecture
    from core.catalog import Catalog
    from core.errors import FtuneError
    from core.spec import JobSpec
    from planner.feasibility import plan_on
    from planner.gpus import resolve_gpu

    settings = get_settings()
    raw = Path(args.spec[1:]).read_text() if args.spec.startswith("@") else args.spec
    fields = json.loads(raw)
    fields.setdefault("dataset_id", "0" * 32)  # planning needs no dataset
    try:
        spec = JobSpec.model_validate(fields)
        model = Catalog(settings.models_dir, settings.hf_cache_dir).get(spec.base_model)
        plan = plan_on(spec, load_architecture(model.path), resolve_gpu(args.gpu))
    except FtuneError as e:
        print(f"error ({e.code}): {e.message}", file=sys.stderr)
        return 2
    if args.json:
        print(plan.model_dump_json(indent=2))
        return 0
    gib = 2**30
    print(f"{spec.base_model} {spec.method} on {plan.gpu} x{plan.num_gpus}")
    for term in plan.breakdown:
        print(f"  {term.name:<28}{term.bytes / gib:>9.3f} GiB  {term.note}")
    verdict = "fits" if plan.fits else "does NOT fit"
    usable = f"of {plan.usable_bytes / gib:.2f} usable: {verdict}"
    print(f"  {'total per GPU':<28}{plan.total_bytes / gib:>9.3f} GiB  {usable}")
    for s in plan.suggestions:
        print(f"  suggestion: {s.description} -> {s.plan_total_bytes / gib:.2f} GiB  {json.dumps(s.change)}")
    return 0 if plan.fits else 1


def cmd_keys_create(args: argparse.Namespace) -> int:
    from models.db import make_engine, make_session_factory, session_scope
    from models.tenants import create_key

    engine = make_engine(get_settings().resolved_database_url)
    with session_scope(make_session_factory(engine)) as s:
        key = create_key(s, args.tenant, is_admin=args.admin)
    engine.dispose()
    role = "admin key" if args.admin else "key"
    print(f"new {role} for tenant {args.tenant!r} (shown once, store it now):\n{key}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from models.db import make_engine, make_session_factory, session_scope
    from models.tenants import revoke_key

    engine = make_engine(get_settings().resolved_database_url)
    with session_scope(make_session_factory(engine)) as s:
        found = revoke_key(s, args.key)
    engine.dispose()
    print("revoked" if found else "no such key", file=sys.stdout if found else sys.stderr)
    return 0 if found else 1


def cmd_jobs_submit(args: argparse.Namespace) -> int:
    """The same submission as POST /jobs (Services.submit: models.submission.submit_job), for a tenant
    named here."""
    from pathlib import Path

    from pydantic import ValidationError

    from api.deps import Services
    from api.schemas import job_out
    from core.errors import FtuneError
    from core.spec import JobSpec
    from models.db import session_scope
    from models.tenants import get_or_create_tenant

    settings = get_settings()
    if not settings.redis_url and (url := _local_broker_url(settings)):
        settings = settings.model_copy(update={"redis_url": url})
    raw = sys.stdin.read() if args.spec == "-" else Path(args.spec).read_text()
    try:
        spec = JobSpec.model_validate_json(raw)
    except ValidationError as e:
        print(f"error (invalid_spec): {e}", file=sys.stderr)
        return 2
    services = Services.from_settings(settings)  # the API's services, publishing to the broker
    try:
        with session_scope(services.sessions) as s:
            tenant_id = get_or_create_tenant(s, args.tenant).id
        job = services.submit(spec, tenant_id=tenant_id)
    except FtuneError as e:
        print(f"error ({e.code}): {e.message}", file=sys.stderr)
        return 2
    finally:
        services.engine.dispose()
    print(json.dumps(job_out(job).model_dump(mode="json"), indent=2))
    return 0


def cmd_import_openai(args: argparse.Namespace) -> int:
    """Copy fine-tuning files and job definitions from an OpenAI-compatible API (cli/openai_import)."""
    from cli.openai_import.command import run
    from cli.openai_import.options import options_from

    for name in ("httpx", "httpx2", "openai"):  # one INFO line per request would bury the progress lines
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        options = options_from(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run(options, get_settings())


def _local_broker_url(settings: Settings) -> str:
    """The embedded broker of a running `ftune up` on this data directory, if any."""
    from cli.up import BROKER_URL_FILE

    path = settings.data_dir / BROKER_URL_FILE
    return path.read_text().strip() if path.is_file() else ""


def cmd_up(_: argparse.Namespace) -> int:
    from cli.up import up

    return up(get_settings())


def _add_models(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`ftune models build-demo | list | pull`."""
    models = sub.add_parser("models", help="base models").add_subparsers(dest="models_command", required=True)
    demo = models.add_parser("build-demo", help="build the small local demo model")
    demo.add_argument("--force", action="store_true")
    demo.add_argument(
        "--family",
        choices=["llama", "qwen3_moe", "mixtral", "qwen2_5_vl"],
        default="llama",
        help="llama: ftune-demo; qwen3_moe / mixtral: a tiny random-weight mixture-of-experts base, "
        "ftune-demo-qwen3-moe / ftune-demo-mixtral; qwen2_5_vl: a tiny vision-language base, ftune-demo-vlm",
    )
    demo.set_defaults(fn=cmd_models_build_demo)
    models.add_parser("list", help="list local base models").set_defaults(fn=cmd_models_list)
    pull = models.add_parser(
        "pull",
        help="download a base model from the Hugging Face Hub (HF_ENDPOINT, HF_TOKEN) into the models dir",
        description="Checks the architecture from config.json first, refuses custom code, fetches "
        "safetensors weights only; an interrupted pull continues where it stopped when run again.",
    )
    pull.add_argument("repo_id", help="a Hub model id, org/name")
    pull.add_argument("--revision", help="a branch, tag or commit (default main); the commit is recorded")
    pull.add_argument("--force", action="store_true", help="replace a different model already at that name")
    pull.set_defaults(fn=cmd_models_pull)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftune", description="Self-hosted LoRA/QLoRA fine-tuning service.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="migrate, build the demo model, start broker + API + worker").set_defaults(
        fn=cmd_up
    )
    sub.add_parser("migrate", help="upgrade the database to the newest schema").set_defaults(fn=cmd_migrate)
    api = sub.add_parser("api", help="serve the HTTP API (uvicorn)")
    api.add_argument("--host")
    api.add_argument("--port", type=int)
    api.set_defaults(fn=cmd_api)
    # The engine's flags are its own (python -m inference.server --help): passed through as they are.
    sub.add_parser(
        "inference",
        add_help=False,
        help="serve the inference engine alone (chat completions); flags: python -m inference.server --help",
    ).set_defaults(fn=cmd_inference)
    worker = sub.add_parser("worker", help="run a Celery worker (needs FTUNE_REDIS_URL)")
    worker.add_argument("--concurrency", type=int, help="jobs at once (one per GPU)")
    worker.add_argument(
        "--queue",
        choices=["jobs", "cpu"],
        default="jobs",
        help="jobs: train (default); cpu: token statistics of new jobs (ftune up starts one of each)",
    )
    worker.set_defaults(fn=cmd_worker)
    reaper = sub.add_parser("reaper", help="requeue jobs of lost workers and re-send lost messages")
    reaper.add_argument("--once", action="store_true")
    reaper.add_argument("--interval", type=float, default=30)
    reaper.set_defaults(fn=cmd_reaper)
    plan = sub.add_parser("plan", help="predict a job's peak GPU memory, itemised, with suggestions")
    plan.add_argument("spec", help="a JobSpec as JSON, or @file.json (dataset_id may be left out)")
    plan.add_argument("--gpu", required=True, help="a GPU type (A100-80GB) or a size (24GB)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(fn=cmd_plan)
    keys = sub.add_parser("keys", help="API keys").add_subparsers(dest="keys_command", required=True)
    create = keys.add_parser("create", help="create an API key for a tenant (created if new)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--admin", action="store_true", help="an ops key: sees every tenant, the dashboard")
    create.set_defaults(fn=cmd_keys_create)
    revoke = keys.add_parser("revoke", help="revoke an API key at once (give the key or its id)")
    revoke.add_argument("key")
    revoke.set_defaults(fn=cmd_keys_revoke)
    jobs = sub.add_parser("jobs", help="fine-tuning jobs").add_subparsers(dest="jobs_command", required=True)
    submit = jobs.add_parser("submit", help="submit a job as POST /jobs does (admitted, planned, queued)")
    submit.add_argument("spec", help="a JobSpec as a JSON file, or - for stdin")
    submit.add_argument("--tenant", default="local", help="the tenant it belongs to (created if new)")
    submit.set_defaults(fn=cmd_jobs_submit)
    # Not `ftune migrate`: that upgrades the database schema (docker-compose runs it before the API).
    imports = sub.add_parser(
        "import-openai",
        help="copy fine-tuning files and job definitions from OpenAI (or any OpenAI-compatible API)",
        description="Copies every file (by id, with its purpose) and job definition (method, "
        "hyperparameters, suffix, seed, files) into ftune, each job on the local base model --model maps its "
        "base to. Keys come from the environment and are never stored. A rerun skips what was copied; the "
        "end report lists what was not moved and why.",
    )
    add_import_arguments(imports)
    imports.set_defaults(fn=cmd_import_openai)
    _add_models(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Everything ftune writes (the database with its webhook secrets and API key hashes, datasets,
    # adapters, the broker's files) is for this user alone: directories 0700, files 0600. Children
    # (workers, training, the broker) inherit the mask.
    os.umask(0o077)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "inference":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.engine_args = rest
    return int(args.fn(args) or 0)
