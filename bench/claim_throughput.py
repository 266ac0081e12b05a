"""Jobs submitted and claimed per second through the real API, database and broker.

    .venv/bin/python bench/claim_throughput.py [--jobs 200] [--workers 1 4] [--db sqlite postgres]

For each database (SQLite file; PostgreSQL on 127.0.0.1:5432 when it runs) and each worker count: a real
`ftune api` (uvicorn) and Redis (127.0.0.1:6379, a scratch db index), the demo model built locally.
1. submit: --jobs POST /jobs from 8 client threads (quota, admission with the plan, row, plan file,
   wake-up on the broker): jobs/s.
2. claim: N Celery worker processes on the jobs queue, each consuming the real wake-ups and claiming
   with the worker's own code (worker.dispatch.pass_on, then worker.claiming.claim_next: the fair pick
   with models.placement on declared devices, the gang check of multi-node jobs, the placement record),
   ending each job at once instead of training it: claims/s from
   the first to the last claim. This bounds how many jobs the fleet can start per second; training itself
   takes minutes to days per job.
Prints measured next to the goal (a fleet of a few hundred GPUs starting jobs that run for minutes needs a
few claims per second; the goal is 20) and the baseline of docs/scaling.md (2026-11-24, before gang
placement, when the bench claimed through models.fairshare.claim_next alone).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GOAL_SUBMIT_PER_S = 20.0
GOAL_CLAIM_PER_S = 20.0
# docs/scaling.md, 2026-11-24: (db, claiming workers) -> (submitted/s, claimed/s), 200 jobs
BASELINE = {
    ("sqlite", 1): (57, 50),
    ("sqlite", 4): (94, 92),
    ("postgres", 1): (73, 80),
    ("postgres", 4): (60, 34),
}
KEY = "ftk_0123456789ab_" + "b" * 32
DEVICES = "cpu:16GiB"

CLAIMER = r"""
import sys
sys.path.insert(0, sys.argv[1])
from core.queues import QUEUE, RUN_JOB, Enqueuer, class_queue
from core.settings import get_settings
from core.catalog import Catalog
from core.states import JobStatus
from models import fairshare, jobs as jobs_db
from models.db import make_engine, make_session_factory, session_scope
from models.placement import Placer
from core.storage import Storage
from worker.celery_app import create_celery
from worker.claiming import claim_next
from worker.devices import detect_devices
from worker.dispatch import pass_on

settings = get_settings()
app = create_celery(settings)  # a bare app: this bench registers its own run_job
sessions = make_session_factory(make_engine(settings.resolved_database_url))
placer = Placer(Catalog(settings.models_dir))
devices = detect_devices(settings.worker_devices)
storage = Storage(settings.data_dir)
wake = Enqueuer(app.send_task, RUN_JOB)
me = sys.argv[2]

def claim_and_end() -> bool:
    if sys.argv[3] == "fairshare":  # the baseline's path: the fair pick alone, no gang check, no record
        with session_scope(sessions) as s:
            picked = fairshare.claim_next(s, can_run=lambda j: placer.fits(j, devices), worker_id=me,
                                          lease_seconds=60)
            got = (picked[0].id, picked[1]) if picked else None
    else:
        got = claim_next(sessions, settings=settings, storage=storage, placer=placer, devices=devices,
                         worker=me)
    if got is None:
        return False
    with session_scope(sessions) as s:
        jobs_db.finish(s, job_id=got[0], attempt=got[1], dst=JobStatus.SUCCEEDED, message="bench")
    return True

@app.task(name=RUN_JOB, acks_late=True)
def run_job(job_id: str) -> str:
    pass_on(sessions, placer, devices, job_id, wake.to)
    while claim_and_end():
        pass
    return "ok"

app.worker_main(["worker", "--pool=solo", "--loglevel=WARNING", "--without-gossip", "--without-mingle",
                 f"--hostname={me}", f"--queues={QUEUE},{class_queue(devices)}"])
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _postgres_db() -> str | None:
    import socket

    try:
        socket.create_connection(("127.0.0.1", 5432), timeout=0.5).close()
    except OSError:
        return None
    from sqlalchemy import create_engine, text

    name = f"ftune_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine("postgresql+psycopg://postgres@127.0.0.1:5432/test", isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"


def run(db: str, workers: int, jobs: int, models_dir: Path, redis_db: int, path: str) -> tuple[float, float]:
    import httpx
    import redis
    from sqlalchemy import func, select

    from models.db import make_engine
    from models.tables import Job

    tmp = Path(tempfile.mkdtemp(prefix="ftune-claim-"))
    url = f"sqlite:///{tmp / 'ftune.db'}" if db == "sqlite" else _postgres_db()
    if url is None:
        raise SystemExit("PostgreSQL is not running on 127.0.0.1:5432")
    redis_url = f"redis://127.0.0.1:6379/{redis_db}"
    redis.Redis.from_url(redis_url).flushdb()
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTUNE_")}
    env.update(
        FTUNE_DATA_DIR=str(tmp / "data"),
        FTUNE_MODELS_DIR=str(models_dir),
        FTUNE_DATABASE_URL=url,
        FTUNE_REDIS_URL=redis_url,
        FTUNE_API_PORT=str(port),
        FTUNE_BOOTSTRAP_ADMIN_KEY=KEY,
        FTUNE_RATE_LIMIT_PER_MINUTE="1000000",
        FTUNE_MAX_ACTIVE_JOBS_PER_TENANT=str(jobs + 1),
        FTUNE_WORKER_DEVICES=DEVICES,
        HF_HUB_OFFLINE="1",
    )
    subprocess.run(
        [sys.executable, "-m", "cli", "migrate"], env=env, check=True, cwd=ROOT, capture_output=True
    )
    quiet: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [subprocess.Popen([sys.executable, "-m", "cli", "api"], env=env, cwd=ROOT, **quiet)]
    engine = make_engine(url)
    try:
        base = f"http://127.0.0.1:{port}"
        client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        for _ in range(600):
            try:
                if client.get("/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        from sqlalchemy.orm import Session

        from models import workers as workers_db
        from worker.devices import detect_devices

        with Session(engine) as s:  # the fleet the API admits against: one worker of the claimers' kind
            workers_db.register(s, "bench-fleet", "bench", detect_devices(DEVICES))
            s.commit()
        data = (ROOT / "examples" / "alpaca_small.jsonl").read_bytes()
        ds = client.post("/datasets", files={"file": ("a.jsonl", data)}).json()["id"]
        spec = {"base_model": "ftune-demo", "dataset_id": ds, "max_steps": 1}
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: client.post("/jobs", json=spec).status_code, range(jobs)))
        submit_s = time.perf_counter() - t0
        assert codes == [202] * jobs, {c: codes.count(c) for c in set(codes)}
        claimers = [
            subprocess.Popen(
                [sys.executable, "-c", CLAIMER, str(ROOT), f"bench-{i}@{uuid.uuid4().hex[:6]}", path],
                env=env,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for i in range(workers)
        ]
        procs += claimers
        while True:
            with Session(engine) as s:
                done = s.scalar(select(func.count()).where(Job.status == "succeeded")) or 0
                first, last = s.execute(select(func.min(Job.started_at), func.max(Job.started_at))).one()
            if done == jobs:
                break
            time.sleep(0.2)
        claim_s = max((last - first).total_seconds(), 1e-6)
        return jobs / submit_s, (jobs - 1) / claim_s
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        engine.dispose()


def broker_rate(n: int, redis_db: int) -> float:
    """Wake-ups published per second through Celery/kombu on Redis (the API's publishing path)."""
    import redis
    from celery import Celery

    from core.queues import RUN_JOB, Enqueuer, celery_config
    from core.settings import Settings

    url = f"redis://127.0.0.1:6379/{redis_db}"
    redis.Redis.from_url(url).flushdb()
    app = Celery("bench")
    app.conf.update(celery_config(Settings(redis_url=url)))
    wake = Enqueuer(app.send_task, RUN_JOB)
    wake.to("bench-broker", "warmup")
    t0 = time.perf_counter()
    for i in range(n):
        wake.to("bench-broker", f"job{i}")
    rate = n / (time.perf_counter() - t0)
    redis.Redis.from_url(url).flushdb()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--db", nargs="+", default=["sqlite", "postgres"])
    parser.add_argument(
        "--path",
        choices=["worker", "fairshare"],
        default="worker",
        help="claim through worker.claiming (the fleet's path) or models.fairshare alone (the baseline's)",
    )
    parser.add_argument("--broker-only", action="store_true", help="only the broker's publish rate")
    args = parser.parse_args()
    if args.broker_only:
        print(f"broker: {broker_rate(5000, 14):.0f} wake-ups published per second")
        return
    from training.demo import build_demo_model

    models_dir = Path(tempfile.mkdtemp(prefix="ftune-models-"))
    build_demo_model(models_dir)
    print(
        f"{'db':9} {'workers':>7} {'jobs':>5} {'submitted/s':>12} {'baseline':>9} {'claimed/s':>10} "
        f"{'baseline':>9} {'goal':>6}"
    )
    rows = []
    for db in args.db:
        for n in args.workers:
            submit, claim = run(db, n, args.jobs, models_dir, redis_db=14, path=args.path)
            rows.append(
                {"db": db, "workers": n, "jobs": args.jobs, "submit_per_s": submit, "claim_per_s": claim}
            )
            base = BASELINE.get((db, n), (float("nan"), float("nan")))
            print(
                f"{db:9} {n:>7} {args.jobs:>5} {submit:>12.1f} {base[0]:>9.0f} {claim:>10.1f} "
                f"{base[1]:>9.0f} {GOAL_CLAIM_PER_S:>6.0f}",
                flush=True,
            )
    print(json.dumps(rows))
    print(f"broker: {broker_rate(5000, 14):.0f} wake-ups published per second (one client, Redis 127.0.0.1)")


if __name__ == "__main__":
    main()
