"""node_leases: the workers a multi-node job (spec num_nodes) is gang-placed on, one row a node.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_leases",
        sa.Column("worker_id", sa.String(length=200), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("endpoint", sa.String(length=300), nullable=False),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("worker_id"),
    )
    op.create_index(op.f("ix_node_leases_job_id"), "node_leases", ["job_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_node_leases_job_id"), table_name="node_leases")
    op.drop_table("node_leases")
