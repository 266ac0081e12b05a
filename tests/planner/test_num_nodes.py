"""num_nodes: a job over several workers is planned per node at world size num_nodes x num_gpus, its
step is split over every rank, and admission wants that many workers."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.arch import from_config
from core.errors import Infeasible
from planner import estimate
from planner.feasibility import plan_for_fleet
from planner.gpus import resolve_gpu
from planner.sharding import fsdp_problem
from tests.planner.planner_util import LLAMA2_7B, spec

A100 = [{"kind": "cuda", "name": "A100-80GB", "memory_bytes": 80 * 2**30}]


def test_num_nodes_defaults_to_one_and_is_bounded() -> None:
    assert spec().num_nodes == 1
    with pytest.raises(ValidationError, match="num_nodes"):
        spec(num_nodes=0)


def test_a_step_is_split_over_every_rank_of_every_node() -> None:
    s = spec(micro_batch_size=2, gradient_accumulation_steps=3, num_gpus=4, num_nodes=2)
    assert s.placement.world_size == 8
    assert s.batch.effective_size == 2 * 3 * 8
    assert s.placement.sharded and spec(num_nodes=2).placement.sharded


def test_a_node_is_planned_like_one_device_of_the_whole_world() -> None:
    arch, gpu = from_config(LLAMA2_7B), resolve_gpu("A100-80GB")
    two_nodes = estimate(spec(method="full", num_gpus=2, num_nodes=2), arch, gpu, suggest=False)
    one_node = estimate(spec(method="full", num_gpus=4), arch, gpu, suggest=False)
    alone = estimate(spec(method="full", num_gpus=2), arch, gpu, suggest=False)
    assert two_nodes.total_bytes == one_node.total_bytes < alone.total_bytes


def test_sharding_rules_hold_across_nodes() -> None:
    problem = fsdp_problem(spec(num_nodes=2, optimizer="paged_adamw_8bit"))
    assert problem is not None and problem[0] == "optimizer"


def test_admission_wants_num_nodes_workers() -> None:
    arch = from_config(LLAMA2_7B)
    with pytest.raises(Infeasible) as e:
        plan_for_fleet(spec(method="qlora", num_nodes=2), arch, [A100])
    assert e.value.param == "num_nodes" and "2 workers" in e.value.message
    assert plan_for_fleet(spec(method="qlora", num_nodes=2), arch, [A100, A100]).fits
