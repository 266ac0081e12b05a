"""Announcing a succeeded job's adapter to the inference engine at FTUNE_INFERENCE_URL.

When a job succeeds its adapter is registered with the engine's `POST /v1/load_lora_adapter` (vLLM's
runtime LoRA loading, which ftune's own engine answers too) under its `ft:` name, so a vLLM server lists
and serves it before anyone asks and the first chat request does not wait for the load. Best effort: the
API registers an adapter before the first request that names it anyway (api/inference_client.py). The
engine's key (FTUNE_INFERENCE_API_KEY), when set, goes with it.
"""

from __future__ import annotations

import logging

import httpx

from core import ft_names
from core.settings import Settings
from core.storage import Storage
from models.tables import Job

log = logging.getLogger(__name__)
TIMEOUT_S = 30.0


def announce_adapter(settings: Settings, storage: Storage, job: Job) -> bool:
    """Register the job's adapter with the engine, if one is configured. True when the engine has it."""
    if not settings.inference_url:
        return False
    body = {
        "lora_name": ft_names.fine_tuned_model(job.base_model, job.tenant_id, job.suffix, job.id),
        "lora_path": str(storage.adapter_dir(job.id)),
        "base_model": job.base_model,
    }
    url = settings.inference_url.rstrip("/") + "/v1/load_lora_adapter"
    try:
        headers = {"Authorization": f"Bearer {key}"} if (key := settings.inference_api_key) else {}
        r = httpx.post(url, json=body, headers=headers, timeout=TIMEOUT_S)
    except httpx.HTTPError as e:
        log.warning("job %s: inference engine %s unreachable (%s); it loads on first use", job.id, url, e)
        return False
    # vLLM answers a second load of a name with 400 "... has already been loaded": it is there.
    if r.status_code < 400 or (r.status_code == 400 and "already been loaded" in r.text):
        log.info("job %s: adapter loaded by the inference engine as %s", job.id, body["lora_name"])
        return True
    log.warning("job %s: the engine refused the adapter (%d): %s", job.id, r.status_code, r.text[:300])
    return False
