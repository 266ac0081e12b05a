"""Admission's bounds on work, below the API: the measuring child's memory and CPU limits (a child past
them fails cleanly, a failed-measurement record), and the gate that lets one measurement per tenant and
a few in all run at once. The API's side (429 with Retry-After, the job slot):
tests/api/test_hostile_tenant.py."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest

from core.data.token_stats import StatsRequest
from core.errors import RateLimited
from core.settings import Settings
from models.tenants import TenantGate
from models.token_stats import limited_command, subprocess_compute, worker_compute

MiB = 2**20
ALLOCATE = """
import resource
print(resource.getrlimit(resource.RLIMIT_AS)[0], resource.getrlimit(resource.RLIMIT_CPU)[0])
try:
    block = bytearray(512 * 2**20)
    print("allocated")
except MemoryError:
    print("MemoryError")
"""


def test_the_child_runs_under_its_memory_and_cpu_limits() -> None:
    cmd = limited_command(["-c", ALLOCATE], memory_bytes=256 * MiB, cpu_seconds=7)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout.split("\n")
    assert out[0] == f"{256 * MiB} 7"  # set in the child, before it runs the computation
    assert out[1] == "MemoryError"  # 512 MiB asked for, past the limit: refused, not the machine's memory
    unlimited = subprocess.run(limited_command(["-c", ALLOCATE]), capture_output=True, text=True, timeout=60)
    assert unlimited.stdout.split("\n")[1] == "allocated"


@pytest.mark.parametrize("where", ["admission", "cpu worker"])
def test_a_measurement_past_its_memory_limit_is_a_clean_failed_record(tmp_path: Path, where: str) -> None:
    request = StatsRequest(
        job_id="j1",
        model_dir=tmp_path / "model",
        dataset_path=tmp_path / "data.jsonl",
        column_mapping=None,
        spec_json="{}",
    )
    if where == "admission":
        compute = subprocess_compute(60, memory_bytes=200 * MiB)
    else:  # the worker's task measures a tenant's data too: under the same limit
        compute = worker_compute(Settings(admission_measure_max_memory_bytes=200 * MiB))
    result = compute(request, threading.Event())
    assert result is not None and result["status"] == "failed", result
    assert result["error"]["code"] == "token_stats_memory", result
    assert "/" not in result["error"]["message"]  # no server paths


def test_the_gate_lets_one_measurement_per_tenant_and_a_few_in_all() -> None:
    gate = TenantGate(
        what="measurements", code="too_many_measurements", per_tenant=1, total=2, retry_after=10
    )
    with gate.hold("acme"):
        with pytest.raises(RateLimited) as same_tenant, gate.hold("acme"):
            pass
        assert same_tenant.value.code == "too_many_measurements" and same_tenant.value.retry_after == 10
        with gate.hold("globex"), pytest.raises(RateLimited), gate.hold("initech"):  # the server's bound
            pass
        with gate.hold("initech"):  # one has finished: room again
            pass
    with gate.hold("acme"):  # given back when it ends
        pass
