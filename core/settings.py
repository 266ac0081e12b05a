"""Process-wide settings, read once from the environment (prefix FTUNE_)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FTUNE_", extra="ignore")

    # Where everything lives. Relative paths are taken from the working directory.
    data_dir: Path = Path("var/data")
    models_dir: Path = Path("var/models")
    # Empty means: SQLite in data_dir.
    database_url: str = ""
    # Empty means: no broker configured; `ftune up` starts an embedded one and sets this for its children.
    redis_url: str = ""
    # Also search the local Hugging Face cache for base models (never downloads).
    hf_cache_dir: Path | None = None
    # POST /models/pull (admins; the dashboard's "Pull a model"): the API may download base models from the
    # Hub (HF_ENDPOINT, HF_TOKEN) into models_dir. Off: 403 hub_pull_disabled (`ftune models pull`, run by an
    # operator on the machine, is not affected). HF_HUB_OFFLINE=1 stops any attempt either way.
    hub_pull_enabled: bool = True
    # Any one file a pull fetches (either way): one the Hub lists larger is refused before it is fetched, a
    # body that streams past it is cut off (core.hub; a mirror is not trusted with the disk).
    hub_max_file_bytes: int = Field(default=20 * 2**30, ge=1)

    api_host: str = "127.0.0.1"
    api_port: int = 8000

    # Auth. "off" is a loud development mode: every request acts as the admin of tenant "local".
    auth: Literal["on", "off"] = "on"
    # Provision this admin key (format ftk_<id>_<secret>) at start, e.g. from a secret store.
    bootstrap_admin_key: str = ""

    # Per-tenant limits. The request rate and the bounds on a tenant's work at once below are counted in the
    # broker (redis_url) across every API process (models.fleet_limits); in each process where there is none.
    max_active_jobs_per_tenant: int = Field(default=20, ge=1)
    max_stored_bytes_per_tenant: int = Field(default=100 * 2**30, ge=0)
    rate_limit_per_minute: int = Field(default=1200, ge=1)
    # An upload that sends nothing for this long is dropped (slow clients cannot hold a slot forever).
    upload_idle_timeout_seconds: float = Field(default=60, gt=0)

    # Upload limits.
    max_upload_bytes: int = 1 << 30
    max_line_bytes: int = 1 << 20
    min_examples: int = 1
    max_reported_problems: int = 50

    # Jobs. The broker's visibility timeout must exceed the longest job, or the broker redelivers it.
    max_job_seconds: int = 7 * 24 * 3600
    max_attempts: int = Field(default=3, ge=1)
    # A running job's lease; the worker renews it on every progress tick. Expired: the reaper requeues.
    lease_seconds: float = Field(default=120, gt=0)
    # How often each worker heartbeats and runs a reaper pass.
    reaper_interval_seconds: float = Field(default=20, gt=0)
    # A queued job whose message may be lost is re-sent after this long (only when the queue is empty).
    resend_after_seconds: float = Field(default=60, gt=0)
    # Token statistics of a new job's dataset (`python -m training.token_stats`, run by a CPU worker):
    # killed after this long.
    token_stats_timeout_seconds: float = Field(default=600, gt=0)
    # Admission measures the data's lengths of a job whose worst case does not fit, for at most this long
    # (the request waits); 0: never, such a job is refused on its worst case.
    admission_measure_seconds: float = Field(default=60, ge=0)
    # Admission under a hostile tenant (models.token_stats, models.tenants.TenantGate): measurements at
    # once, all tenants together, per API process (one per tenant at most); beyond: 429 with Retry-After.
    # The measuring child's address space (RLIMIT_AS, bytes; 0: unlimited) and CPU seconds (RLIMIT_CPU; 0:
    # the measurement's timeout). Uploads streaming at once per tenant (429 beyond).
    admission_max_concurrent_measurements: int = Field(default=2, ge=1)
    admission_measure_max_memory_bytes: int = Field(default=2 * 2**30, ge=0)
    admission_measure_max_cpu_seconds: int = Field(default=0, ge=0)
    max_concurrent_uploads_per_tenant: int = Field(default=2, ge=1)
    # Webhook delivery (worker/webhooks.py): a failed attempt is retried after backoff * 2^(attempt-1)
    # seconds (at most an hour), up to max attempts; each attempt waits at most the timeout.
    webhook_backoff_seconds: float = Field(default=5, gt=0)
    webhook_max_attempts: int = Field(default=12, ge=1)
    webhook_timeout_seconds: float = Field(default=10, gt=0)
    # Webhooks under a hostile tenant (worker/webhooks.py, core/net.py, core/secretbox.py). The timeout above
    # is a hard deadline on connect + send + read. Deliveries run in a pool of `webhook_concurrency` threads
    # apart from the heartbeat, at most so many at once per tenant and per destination host (per worker).
    # Loopback, private, link-local, multicast and reserved destinations are refused at registration and at
    # delivery unless allowed. A rotated secret still signs for the grace period. Endpoints per tenant.
    webhook_concurrency: int = Field(default=8, ge=1)
    webhook_max_in_flight_per_tenant: int = Field(default=2, ge=1)
    webhook_max_in_flight_per_host: int = Field(default=2, ge=1)
    webhook_allow_private: bool = False
    webhook_secret_grace_seconds: float = Field(default=24 * 3600, ge=0)
    max_webhooks_per_tenant: int = Field(default=10, ge=0)
    # The key that encrypts webhook secrets in the database (any long random string). Empty: the key file
    # `secret.key` in data_dir, made on first use; a worker on another machine must set this to its content.
    secret_key: SecretStr = SecretStr("")
    # http(s) image URLs in chat rows and chat requests (core/image_fetch.py, docs/operations.md). Off:
    # refused (400 / line code image_url_not_fetched); send images inline as data: URLs. On: the API fetches
    # each one through the webhooks' address guard (private destinations refused unless allowed), within the
    # timeout (lookup + connect + read) and the image limits of core/data/images.py, no redirects followed,
    # and inlines it: a stored dataset row holds the image as a data: URL. At most so many URLs per upload.
    image_fetch_enabled: bool = False
    image_fetch_timeout_seconds: float = Field(default=10, gt=0)
    image_fetch_allow_private: bool = False
    image_fetch_max_per_upload: int = Field(default=100, ge=1)
    worker_name: str = ""
    worker_concurrency: int = 1
    # Start single-process training runs from a warm fork server (training.forkserver), saving each run
    # the ~5 s of importing torch, transformers and peft; false: a fresh process per run.
    fork_training: bool = True
    # torch.compile each decoder layer's training step on CUDA where it was measured to pay (packed SFT,
    # LoRA without checkpointing, one GPU: training.compiled); false: every layer runs eagerly.
    compile_layers: bool = True
    # Declared devices of this worker (e.g. "A100-80GB,A100-80GB" or "24GB"); empty: detect.
    worker_devices: str = ""
    # Plan against this GPU (type or size) while no worker has registered its devices yet; empty: admit.
    plan_gpu: str = ""
    # Fair share: at most this many running jobs per tenant across the fleet (0: no limit beyond the fleet).
    max_running_jobs_per_tenant: int = Field(default=0, ge=0)
    # How often the worker relays training progress into the database.
    progress_interval_seconds: float = Field(default=1.0, gt=0)
    # Server-sent events: how often the API process looks for new events of the jobs it streams (one query
    # for all of them), and the keep-alive comment period (shorter than the idle timeouts of proxies).
    sse_poll_seconds: float = Field(default=1.0, gt=0)
    sse_keepalive_seconds: float = Field(default=15.0, gt=0)
    # Event streams open at once per tenant in an API process (429 `too_many_streams` past it): one
    # process's streams share one poller (api/watch.py), but each holds a connection and a task.
    sse_max_streams_per_tenant: int = Field(default=16, ge=1)
    # An OpenAI-compatible inference engine (ftune's `inference.server`, or vLLM with --enable-lora) to which
    # /v1/chat/completions is forwarded; `ftune up` starts ftune's own and sets this. Empty: no chat (503).
    inference_url: str = ""
    # Chat completions and the engine (docs/inference.md). The engine's key (vLLM's --api-key): when set,
    # ftune's engine wants `Authorization: Bearer <key>` on every route but /health, and the API and the
    # workers send it; `ftune up` makes one for its own engine. n x max_tokens at most this many tokens;
    # vLLM's ignore_eos only where the operator allows it. ftune's engine stops a generation after this many
    # seconds.
    inference_api_key: str = ""
    chat_max_total_tokens: int = Field(default=4096, ge=1)
    chat_allow_ignore_eos: bool = False
    inference_generation_seconds: float = Field(default=120, gt=0)
    # The fair queue in front of the engine (api/chat_queue.py, docs/inference.md): an API process forwards
    # at most chat_max_running chat requests at once, all tenants (the engine's batch rows,
    # FTUNE_INFERENCE_MAX_RUNNING, divided among the API processes); a tenant alone runs all but one (a
    # newcomer starts at once). While k > 1 tenants are active each runs at most
    # chat_max_running_shared // k (at least 1): fewer rows, faster steps, so a flooding tenant barely slows
    # the others (raise it where a bigger batch costs little, as on a GPU). The rest wait their turn, round
    # robin across tenants; a tenant with chat_max_queued_per_tenant waiting is refused (429
    # too_many_concurrent_requests, Retry-After from the recent pace). A tenant stays active
    # chat_share_linger_seconds after its last request ended, so its next one finds its share. With a broker
    # a tenant's running and waiting requests are bounded fleet-wide by chat_max_running + the queue bound.
    chat_max_running: int = Field(default=32, ge=1)
    chat_max_running_shared: int = Field(default=4, ge=1)
    chat_max_queued_per_tenant: int = Field(default=64, ge=0)
    chat_share_linger_seconds: float = Field(default=2.0, ge=0)
    # The engine's running batch (inference.batcher): its KV bound (rows x their longest prompt + max_tokens)
    # and how many rows (choices) decode together at most.
    inference_max_batch_tokens: int = Field(default=2048, ge=1)
    inference_max_running: int = Field(default=32, ge=1)
    # Tenants' python graders (graders/sandbox.py): untrusted code, so off unless the operator turns them
    # on. Per batch of calls (one sandboxed child): CPU seconds, address space in MiB, wall-clock seconds.
    python_grader_enabled: bool = False
    python_grader_cpu_seconds: int = Field(default=10, ge=1)
    python_grader_memory_mb: int = Field(default=512, ge=64)
    python_grader_timeout_seconds: float = Field(default=30, gt=0)
    # score_model and label_model graders ask this OpenAI-compatible endpoint (".../v1": ftune's own /v1 with
    # an API key, vLLM, OpenAI); unset: such graders are refused at submission. Threads grading at once.
    grader_model_base_url: str = ""
    grader_model_api_key: str = ""
    grader_model_timeout_seconds: float = Field(default=60, gt=0)
    # The judge is asked for OpenAI's {"steps", "result"} JSON schema; false for a judge that answers text
    # only (ftune's own /v1 takes response_format text alone): the graders then read a bare number or label.
    grader_model_structured_outputs: bool = True
    grader_concurrency: int = Field(default=8, ge=1, le=256)
    # The operator's bounds on the judge (graders.judge). The models a grader may name, as a JSON list
    # (a name ending in * stands for every name that starts with the rest: "ft:*", with ftune's own /v1 as
    # the judge, is each tenant's own fine-tuned models); empty: every model grader is refused (400
    # grader_model_not_allowed). The max_completion_tokens of a judge call (a grader asking more is refused;
    # one asking none gets this), a tenant's judge calls at once per process (a training run, an API
    # process; more wait), and the judge tokens a run may spend (a training attempt, a graders/run; 0: no
    # bound; past it a sample scores 0 with model_grader_server_error).
    grader_model_allowed_models: list[str] = Field(default_factory=list)
    grader_model_max_completion_tokens: int = Field(default=4096, ge=1)
    grader_model_max_concurrent_per_tenant: int = Field(default=2, ge=1)
    grader_model_max_tokens_per_run: int = Field(default=0, ge=0)
    # POST /v1/fine_tuning/alpha/graders/run: samples graded at once per tenant, and in all per API process
    # (each can hold a threadpool thread, a sandboxed child or a judge request; 429 past either).
    grader_run_max_concurrent_per_tenant: int = Field(default=2, ge=1)
    grader_run_max_concurrent: int = Field(default=8, ge=1)

    @model_validator(mode="after")
    def _absolute_paths(self) -> Settings:
        self.data_dir = self.data_dir.expanduser().resolve()
        self.models_dir = self.models_dir.expanduser().resolve()
        if self.hf_cache_dir is not None:
            self.hf_cache_dir = self.hf_cache_dir.expanduser().resolve()
        return self

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'ftune.db'}"

    @property
    def visibility_timeout_seconds(self) -> int:
        return self.max_job_seconds + 3600


@lru_cache
def get_settings() -> Settings:
    return Settings()
