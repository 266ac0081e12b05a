"""jobs.suffix, jobs.metadata, jobs.openai: what a /v1/fine_tuning/jobs job carries beyond its JobSpec;
jobs.deleted_at: a finished job whose files were deleted (the record stays for audits and the dashboard);
webhooks, webhook_events (the outbox) and webhook_deliveries (every attempt)

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
    op.create_table(
        "webhooks",
        sa.Column("id", sa.String(length=64), primary_key=True),
        sa.Column("tenant_id", sa.String(length=64), sa.ForeignKey("tenants.id"), nullable=False, index=True),
        sa.Column("url", sa.String(length=2000), nullable=False),
        sa.Column("secret", sa.String(length=100), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "webhook_events",
        sa.Column("id", sa.String(length=64), primary_key=True),
        sa.Column(
            "webhook_id", sa.String(length=64), sa.ForeignKey("webhooks.id"), nullable=False, index=True
        ),
        sa.Column("job_id", sa.String(length=64), sa.ForeignKey("jobs.id"), nullable=False, index=True),
        sa.Column("type", sa.String(length=64), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True, index=True),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("gave_up_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "event_id", sa.String(length=64), sa.ForeignKey("webhook_events.id"), nullable=False, index=True
        ),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("webhook_deliveries")
    op.drop_table("webhook_events")
    op.drop_table("webhooks")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("deleted_at")
        batch_op.drop_column("openai")
        batch_op.drop_column("metadata")
        batch_op.drop_column("suffix")
