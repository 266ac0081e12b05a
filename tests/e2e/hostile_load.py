"""A hostile tenant's load on a running API, and what another client sees meanwhile.

`post_graders` (run in a child process, `python -m tests.e2e.hostile_load BASE KEY SECONDS POSTERS`, so
that the poster threads do not share the prober's interpreter lock) posts 1 MiB bodies with a grader to
every route that parses one: /v1 graders validate and run, POST /plan, POST /jobs and /v1 fine-tuning
jobs. Each grader is one of the shapes that once cost the most to parse: a template of "{{" repeated
(a lazy regex scanned to the end from each "{{": 14 s for 40k characters), a multi grader of thousands
of graders, a judge prompt of thousands of messages. `probe_health` meanwhile asks GET /health every
`interval` seconds and returns each answer's latency. Used by tests/e2e/test_hostile_load.py and
bench/hostile_load.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import httpx

from tests.e2e.stack import REPO

BODY_BYTES = 1 << 20  # the API's cap on a JSON body (api/bodylimit.py): the most one request may carry


def _padded(shape: str) -> dict[str, Any]:
    """A grader of `shape` just under BODY_BYTES once wrapped in a request."""
    room = BODY_BYTES - 2048
    if shape == "braces":
        return {
            "type": "string_check",
            "name": "x",
            "operation": "eq",
            "reference": "r",
            "input": "{{" * (room // 2),
        }
    if shape == "many_graders":
        one = {
            "type": "string_check",
            "input": "{{ item.a }}",
            "reference": "{{ item.b }}",
            "operation": "eq",
        }
        count = room // (len(json.dumps(one)) + 12)
        return {"type": "multi", "graders": {f"g{i}": one for i in range(count)}, "calculate_output": "g0"}
    message = {"role": "user", "content": "{{ item.a }}"}
    count = room // (len(json.dumps(message)) + 2)
    return {"type": "score_model", "name": "s", "model": "judge", "input": [message] * count}


SHAPES = ("braces", "many_graders", "many_messages")


def requests_for(shape: str) -> list[tuple[str, bytes]]:
    """(path, body) for every grader-parsing route, each body ~1 MiB."""
    grader = _padded(shape)
    spec = {"base_model": "ftune-demo", "dataset_id": "none", "objective": "grpo", "grader": grader}
    bodies = {
        "/v1/fine_tuning/alpha/graders/validate": {"grader": grader},
        "/v1/fine_tuning/alpha/graders/run": {"grader": grader, "model_sample": "x", "item": {}},
        "/plan": spec,
        "/jobs": spec,
        "/v1/fine_tuning/jobs": {
            "model": "ftune-demo",
            "training_file": "file-none",
            "method": {"type": "reinforcement", "reinforcement": {"grader": grader}},
        },
    }
    return [(path, json.dumps(body).encode()) for path, body in bodies.items()]


def post_graders(base: str, key: str, seconds: float, posters: int) -> Counter[str]:
    """`posters` threads post every request in turn for `seconds`; the count of each answer's status."""
    work = [r for shape in SHAPES for r in requests_for(shape)]
    statuses: Counter[str] = Counter()
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}

    def post(offset: int) -> None:
        with httpx.Client(base_url=base, headers=headers, timeout=120) as client:
            i = offset
            while time.monotonic() < deadline:
                path, body = work[i % len(work)]
                i += 1
                try:
                    status = str(client.post(path, content=body).status_code)
                except httpx.HTTPError as e:
                    status = type(e).__name__
                with lock:
                    statuses[f"{path} {status}"] += 1

    threads = [threading.Thread(target=post, args=(n,)) for n in range(posters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


def warm_up(base: str, key: str) -> None:
    """One request to each route first: FastAPI builds a route's state (its models' validators) on the
    first request that reaches it, ~5-40 ms of the event loop's time once per route and process, which
    a latency percentile over a short run would otherwise count as the hostile load's doing."""
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    with httpx.Client(base_url=base, headers=headers, timeout=120) as client:
        for path, body in requests_for(SHAPES[0]):
            client.post(path, content=b"{}" if path.endswith("/run") else body)
        client.get("/health")


def start_posters(base: str, key: str, seconds: float, posters: int) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "tests.e2e.hostile_load", base, key, str(seconds), str(posters)]
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, text=True)


def probe(
    base: str, path: str, seconds: float, key: str | None = None, interval: float = 0.05
) -> list[float]:
    """GET `path` (with `key`, if given) every `interval` for `seconds`: each answer's latency in seconds
    (all must be 200)."""
    latencies = []
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=base, headers=headers, timeout=60) as client:
        while time.monotonic() < deadline:
            started = time.perf_counter()
            r = client.get(path)
            latencies.append(time.perf_counter() - started)
            assert r.status_code == 200, r.text
            time.sleep(interval)
    return latencies


def probe_health(base: str, seconds: float) -> list[float]:
    return probe(base, "/health", seconds)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


if __name__ == "__main__":
    base_url, api_key, run_seconds, threads = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(post_graders(base_url, api_key, run_seconds, threads)))
