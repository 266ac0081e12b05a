"""The layout keeps its promises: imports point one way, and the compose file runs real commands."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import grimp
import pytest
import yaml

from cli.main import build_parser

REPO = Path(__file__).resolve().parents[1]


def _imported(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=REPO)
    return {m.split(".")[0] for m in out.stdout.split()}


def test_api_does_not_import_torch() -> None:
    mods = _imported("api.main")
    assert "torch" not in mods and "transformers" not in mods and "training" not in mods


def test_core_is_pure() -> None:
    every = ", ".join(sorted(grimp.build_graph("core").modules))
    mods = _imported(every)
    assert not mods & {
        "torch",
        "fastapi",
        "celery",
        "sqlalchemy",
        "models",
        "api",
        "worker",
        "training",
        "planner",
        "graders",
    }


def test_layer_contracts_hold() -> None:
    """The import-linter contracts in pyproject.toml (api/worker -> models -> core, training -> core)."""
    lint_imports = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint_imports), "--no-cache"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:]


@pytest.mark.parametrize(
    "package", ["core", "planner", "graders", "training", "models", "api", "worker", "inference"]
)
def test_no_import_cycles(package: str) -> None:
    """No module imports (directly or not, in-function imports included) a module that imports it back."""
    graph = grimp.build_graph(package)
    cycles = [
        (m, n)
        for m in graph.modules
        for n in graph.find_modules_directly_imported_by(m)
        if graph.chain_exists(importer=n, imported=m)
    ]
    assert cycles == []


def test_worker_tasks_do_not_import_torch() -> None:
    assert "torch" not in _imported("worker.tasks")


def test_compose_services_run_real_commands() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "api", "worker"} <= set(services)
    parser = build_parser()
    for name in ("migrate", "api", "worker"):
        cmd = services[name]["command"]
        assert cmd[0] == "ftune"
        args = parser.parse_args(cmd[1:])  # exits (fails the test) on an unknown command or flag
        assert args.command == cmd[1]
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    for name in ("api", "worker", "migrate"):
        env = services[name]["environment"]
        assert env["FTUNE_DATABASE_URL"].startswith("postgresql") and env["FTUNE_REDIS_URL"].startswith(
            "redis://"
        )


def test_compose_runs_the_inference_engine_beside_the_api() -> None:
    """No Docker engine here: the file is read. The engine runs `ftune inference` with flags the engine
    takes, is healthy when its /health answers, reads models and adapters without writing them, and the
    API waits for it and reaches it (URL and key) by default; the workers know it too."""
    from inference.server import parse_args

    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    engine = services["inference"]
    cmd = engine["command"]
    args, rest = build_parser().parse_known_args(cmd[1:])
    assert cmd[0] == "ftune" and args.command == "inference"
    flags = parse_args(rest)  # exits (fails the test) on a flag the engine does not know
    assert flags.host == "0.0.0.0"

    probe = " ".join(engine["healthcheck"]["test"])
    assert f"http://127.0.0.1:{flags.port}/health" in probe
    assert engine["restart"] == "unless-stopped"
    mounts = {v.split(":")[1]: v for v in engine["volumes"]}
    assert mounts["/data"].endswith(":ro") and mounts["/models"].endswith(":ro")
    assert engine["environment"]["FTUNE_DATA_DIR"] == "/data"
    assert engine["environment"]["FTUNE_MODELS_DIR"] == "/models"
    assert engine["environment"]["HF_HUB_OFFLINE"] == "1"  # no download at run time
    assert "ports" not in engine  # only the compose network reaches it
    assert engine["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]

    key = engine["environment"]["FTUNE_INFERENCE_API_KEY"]
    assert key.startswith("${FTUNE_INFERENCE_API_KEY:?")  # from the operator's environment, never a literal
    for name in ("api", "worker", "cpu-worker"):
        env = services[name]["environment"]
        assert env["FTUNE_INFERENCE_URL"] == f"http://inference:{flags.port}", name
        assert env["FTUNE_INFERENCE_API_KEY"] == key, name
    assert services["api"]["depends_on"]["inference"] == {"condition": "service_healthy"}

    # The API writes pulled models (POST /models/pull) unless pulls are off; the workers only read them.
    api_mounts = {v.split(":")[1]: v for v in services["api"]["volumes"]}
    pulls_on = str(services["api"]["environment"].get("FTUNE_HUB_PULL_ENABLED", "true")).lower() == "true"
    assert api_mounts["/models"].endswith(":ro") != pulls_on
    assert {v.split(":")[1]: v for v in services["worker"]["volumes"]}["/models"].endswith(":ro")


@pytest.mark.slow
def test_the_compose_engine_command_runs_and_its_health_check_passes(tmp_path: Path) -> None:
    """What the compose engine service runs, run here (no Docker engine): its command as written, with its
    environment (the volumes as local folders), answers its health check as written, and wants the key
    on everything else."""
    import httpx

    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    engine = services["inference"]
    env = {k: str(v) for k, v in engine["environment"].items() if not str(v).startswith("${")}
    env |= {"FTUNE_DATA_DIR": str(tmp_path / "data"), "FTUNE_MODELS_DIR": str(tmp_path / "models")}
    env |= {"FTUNE_INFERENCE_API_KEY": "k" * 32, "PATH": str(Path(sys.executable).parent)}
    (tmp_path / "models").mkdir()
    with socket.socket() as s:  # the health check names the port: nothing else may answer it
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no owner
        s.bind(("127.0.0.1", 8001))
    proc = subprocess.Popen(
        engine["command"], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    probe = [sys.executable if part == "python" else part for part in engine["healthcheck"]["test"][1:]]
    try:
        for _ in range(120):
            if subprocess.run(probe, capture_output=True).returncode == 0:
                break
            assert proc.poll() is None, "the engine exited"
            time.sleep(0.5)
        else:
            raise AssertionError("the health check never passed")
        url = "http://127.0.0.1:8001/v1/models"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer " + "k" * 32}).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_image_holds_the_engine_and_not_the_local_environment() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "pip install --no-cache-dir -e ." in dockerfile and "8001" in dockerfile
    text = (REPO / "pyproject.toml").read_text()
    assert '"inference*"' in text  # the package the engine is, installed with the project
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", "var", ".git"} <= set(ignored)


def _interpolated(text: str, env: dict[str, str]) -> dict:
    """The compose file as docker compose reads it with `env`: ${NAME}, ${NAME:?error}, ${NAME:-default}."""

    def value(m: re.Match[str]) -> str:
        name, how, rest = m["name"], m["how"] or "", m["rest"] or ""
        if env.get(name):
            return env[name]
        assert how != ":?", f"compose would refuse to start: {name} {rest}"
        return rest

    return yaml.safe_load(re.sub(r"\$\{(?P<name>\w+)(?:(?P<how>:[?-])(?P<rest>[^}]*))?\}", value, text))


def test_compose_secrets_are_made_by_compose_env_never_defaults(tmp_path: Path) -> None:
    """No Docker engine here: the file is read. PostgreSQL and Redis (--requirepass) want passwords that
    `make compose-env` makes (cli.compose_env) and compose requires: none has a default, and the services'
    URLs carry them; a rerun keeps the values (PostgreSQL keeps the one its volume was made with)."""
    from cli.compose_env import SECRETS, ensure_env

    text = (REPO / "docker-compose.yml").read_text()
    required = set(re.findall(r"\$\{(\w+):\?", text))
    assert required == set(SECRETS)
    assert not any(f"${{{name}:-" in text for name in SECRETS)  # no fallback value
    assert "ftune:ftune@" not in text  # the old default password
    services = yaml.safe_load(text)["services"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--requirepass") + 1].startswith("${REDIS_PASSWORD:?")

    env_file = tmp_path / ".env"
    env_file.write_text("# mine\nFTUNE_INFERENCE_API_KEY=\nOTHER=1\n")
    assert ensure_env(env_file) == list(SECRETS)  # the empty key too
    assert env_file.stat().st_mode & 0o777 == 0o600
    made = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
    assert made["OTHER"] == "1" and "# mine" in env_file.read_text()
    assert len({made[name] for name in SECRETS}) == 3 and all(len(made[name]) == 64 for name in SECRETS)
    assert (
        ensure_env(env_file) == []
        and dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line) == made
    )

    with pytest.raises(AssertionError, match="compose would refuse to start"):
        _interpolated(text, {})
    services = _interpolated(text, made)["services"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == made["POSTGRES_PASSWORD"]
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == made["REDIS_PASSWORD"]  # its health check
    for name in ("migrate", "api", "worker", "cpu-worker", "inference"):
        env = services[name]["environment"]
        database, broker = urlsplit(env["FTUNE_DATABASE_URL"]), urlsplit(env["FTUNE_REDIS_URL"])
        assert (database.username, database.password) == ("ftune", made["POSTGRES_PASSWORD"]), name
        assert (broker.hostname, broker.password) == ("redis", made["REDIS_PASSWORD"]), name
        assert env["FTUNE_INFERENCE_API_KEY"] == made["FTUNE_INFERENCE_API_KEY"], name
    for ignore in (".gitignore", ".dockerignore"):
        assert ".env" in (REPO / ignore).read_text().split(), ignore


def test_compose_keeps_python_graders_off() -> None:
    """The grader sandbox needs namespaces that Docker's default seccomp profile denies: off, and said."""
    text = (REPO / "docker-compose.yml").read_text()
    assert "seccomp" in text
    services = yaml.safe_load(text)["services"]
    for name in ("api", "worker", "cpu-worker"):
        assert services[name]["environment"]["FTUNE_PYTHON_GRADER_ENABLED"] == "false", name


def test_the_image_entrypoint_sets_the_umask_and_the_data_dir_mode(tmp_path: Path) -> None:
    """The Dockerfile's ENTRYPOINT, run here with sh: whatever command follows runs with umask 077, and a
    writable FTUNE_DATA_DIR made open before is 0700; a read-only one is left alone."""
    [line] = [ln for ln in (REPO / "Dockerfile").read_text().splitlines() if ln.startswith("ENTRYPOINT ")]
    entrypoint = json.loads(line.removeprefix("ENTRYPOINT "))
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    show = ["sh", "-c", 'umask; touch "$FTUNE_DATA_DIR/f"; stat -c %a "$FTUNE_DATA_DIR" "$FTUNE_DATA_DIR/f"']
    env = {"PATH": "/usr/bin:/bin", "FTUNE_DATA_DIR": str(data)}
    done = subprocess.run([*entrypoint, *show], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["0077", "700", "600"]
    missing = {**env, "FTUNE_DATA_DIR": str(tmp_path / "none")}
    done = subprocess.run([*entrypoint, "true"], env=missing, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr  # not there (or read-only): the command still runs


def test_console_script_is_declared() -> None:
    text = (REPO / "pyproject.toml").read_text()
    assert 'ftune = "cli.main:main"' in text
