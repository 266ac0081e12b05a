"""jobs.files_allowance_bytes and jobs.files_bytes: a job's files in its tenant's storage quota (the
bytes reserved at admission while it runs, what its directory holds once it has finished).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable: a job admitted before this revision has none and counts nothing (models.job_files).
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("files_allowance_bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("files_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("files_bytes")
        batch_op.drop_column("files_allowance_bytes")
