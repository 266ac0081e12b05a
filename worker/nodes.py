"""A node of a multi-node job: which one this worker runs, and the torchrun that starts it.

Every node starts torchrun with the same c10d rendezvous (torchrun's own; no launcher protocol of ours):
the endpoint is rank 0's worker, which hosts the rendezvous store, and the run id is the job and its
attempt, so a retried attempt never joins an earlier attempt's rendezvous. c10d gives the global ranks
itself (in join order; torchrun ignores --node-rank off the static backend), which is why any rank 0
writes the run's files to the data directory every node mounts. A node that does not join within
RDZV_JOIN_TIMEOUT_S fails the attempt; --max-restarts 0, because a restart is the fleet's to decide (a
new attempt from the last checkpoint), not torchrun's.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from core.queues import worker_queue
from models import nodes as nodes_db
from models.db import session_scope
from models.tables import NodeLease

RDZV_JOIN_TIMEOUT_S = 600  # c10d's join_timeout: how long the first node waits for the last

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Node:
    rank: int  # 0: the worker that claimed the job; it hosts the rendezvous store
    count: int  # the job's num_nodes
    endpoint: str  # host:port of rank 0's rendezvous store
    run_id: str  # the rendezvous of one attempt: job id and attempt

    @property
    def hosts_store(self) -> bool:
        return self.rank == 0


def rendezvous_id(job_id: str, attempt: int) -> str:
    return f"{job_id}-{attempt}"


def node_launcher(node: Node, nproc_per_node: int, join_timeout_s: int = RDZV_JOIN_TIMEOUT_S) -> list[str]:
    """torchrun for one node of `node.count`, each of `nproc_per_node` ranks. is_host is said, not
    guessed from the hostname: two nodes on one machine (tests) would both claim the store."""
    conf = f"join_timeout={join_timeout_s},is_host={int(node.hosts_store)}"
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={node.count}",
        f"--node-rank={node.rank}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={node.endpoint}",
        f"--rdzv-id={node.run_id}",
        f"--rdzv-conf={conf}",
        "--max-restarts=0",
    ]


def node_of(lease: NodeLease, count: int) -> Node:
    """The Node a lease describes, for a job of `count` nodes."""
    return Node(
        rank=lease.rank,
        count=count,
        endpoint=lease.endpoint,
        run_id=rendezvous_id(lease.job_id, lease.attempt),
    )


def my_node(sessions: sessionmaker[Session], worker: str, job_id: str) -> Node | None:
    """This worker's node of `job_id` (node 0, having claimed it), or None for a one-node job."""
    with session_scope(sessions) as s:
        lease = nodes_db.held_by(s, worker)
        if lease is None or lease.job_id != job_id:
            return None
        return node_of(lease, len(nodes_db.nodes_of(s, job_id)))


def reserved_node(sessions: sessionmaker[Session], worker: str) -> tuple[str, int, Node] | None:
    """(job id, attempt, node) when this worker is leased as another worker's job's node (rank > 0)."""
    with session_scope(sessions) as s:
        lease = nodes_db.held_by(s, worker)
        if lease is None or lease.rank == 0:
            return None
        return lease.job_id, lease.attempt, node_of(lease, len(nodes_db.nodes_of(s, lease.job_id)))


def wake_peers(
    sessions: sessionmaker[Session], job_id: str, attempt: int, send: Callable[[str, str], bool]
) -> list[str]:
    """Node 0's worker, once the attempt's run config is written: wake each other node's worker on its
    own queue (core.queues.worker_queue), so it starts its node now rather than on its next tick. The
    message proves nothing: the woken worker runs the node its lease in the database names. Returns the
    workers woken (a lost wake-up costs a tick: the tick looks for a lease too)."""
    with session_scope(sessions) as s:
        peers = [n.worker_id for n in nodes_db.nodes_of(s, job_id) if n.rank > 0 and n.attempt == attempt]
    woken = [w for w in peers if send(worker_queue(w), job_id)]
    log.info("job %s: attempt %d, woke its other nodes' workers %s", job_id, attempt, ", ".join(woken))
    return woken


def keep_node(
    sessions: sessionmaker[Session], worker: str, job_id: str, attempt: int, lease_seconds: float
) -> bool:
    """Renew this worker's node lease; False once the attempt no longer runs (its node must stop)."""
    with session_scope(sessions) as s:
        return nodes_db.extend(
            s, worker_id=worker, job_id=job_id, attempt=attempt, lease_seconds=lease_seconds
        )


def release_nodes(sessions: sessionmaker[Session], job_id: str, attempt: int) -> None:
    with session_scope(sessions) as s:
        nodes_db.release(s, job_id=job_id, attempt=attempt)
