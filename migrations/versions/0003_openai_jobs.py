"""jobs.suffix, jobs.metadata, jobs.openai: what a /v1/fine_tuning/jobs job carries beyond its JobSpec;
jobs.deleted_at: a finished job whose files were deleted (the record stays for audits and the dashboard)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24 09:15:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # All nullable: a native job has none of them.
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("suffix", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("metadata", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("openai", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("deleted_at")
        batch_op.drop_column("openai")
        batch_op.drop_column("metadata")
        batch_op.drop_column("suffix")
