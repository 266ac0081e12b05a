// ftune dashboard: the jobs list and the counts above it.
"use strict";

function workerLabel(workerId) {
  if (!workerId) return "";
  const w = summary?.workers?.find((x) => x.id === workerId);
  const d = w?.devices?.[0], n = w?.devices?.length || 0;
  return esc(workerId) + (d ? ` <span class="muted">(${n > 1 ? n + "× " : ""}${esc(d.name)} ${gib(d.memory_bytes)})</span>` : "");
}

function jobRow(j) {
  const p = j.progress, pct = p.percent ?? (j.status === "succeeded" ? 100 : 0);
  const age = (Date.now() - Date.parse(j.created_at)) / 1000;
  const tenant = summary?.tenants?.[j.tenant_id] ?? j.tenant_id.slice(0, 8);
  return `<tr class="job" id="job-${esc(j.id)}" data-id="${esc(j.id)}" data-status="${esc(j.status)}">
    <td><a href="#/jobs/${esc(j.id)}">${esc(j.id.slice(0, 8))}</a></td>
    <td><span class="status ${esc(j.status)}">${esc(j.status)}</span></td>
    <td>${esc(tenant)}</td><td>${esc(j.spec.base_model)}</td><td>${esc(j.spec.method)}</td>
    <td><span class="bar"><div style="width:${pct}%"></div></span> ${p.step}/${p.total_steps ?? "?"}</td>
    <td>${j.status === "running" ? duration(p.eta_seconds) : ""}</td>
    <td>${num(p.loss, 4)}</td><td>${workerLabel(j.worker_id)}</td><td>${duration(age)}</td></tr>`;
}

function renderSummary() {
  $("counts").innerHTML = Object.entries(summary.counts)
    .map(([k, v]) => `<span data-count="${esc(k)}">${esc(k)}: <b>${v}</b></span>`).join("");
  $("queue").innerHTML = `queue depth: <b id="queue-depth">${summary.queue_depth}</b>`;
  $("workers-section").hidden = !summary.workers;
  $("pull-section").hidden = !summary.workers;  // an admin key: only admins may pull
  $("workers").innerHTML = (summary.workers || []).map((w) => {
    const state = w.alive ? "alive" : "lost";
    const devices = w.devices.map((d) => `${esc(d.name)} ${gib(d.memory_bytes)}`).join(", ");
    const job = w.current_job_id ? `<a href="#/jobs/${esc(w.current_job_id)}">${esc(w.current_job_id.slice(0, 8))}</a>` : "";
    return `<tr><td>${esc(w.id)}</td><td><span class="status ${state}">${state}</span></td><td>${devices}</td>
      <td>${job}</td><td>${duration(w.heartbeat_age_seconds)} ago</td></tr>`;
  }).join("");
}

// Reads the rows; returns the function that draws them (once the summary they sit under is read).
async function loadList() {
  const status = $("filter").value;
  const page = await getJSON("/jobs?limit=100" + (status ? "&status=" + status : ""));
  return () => {
    $("jobs").innerHTML = page.data.map(jobRow).join("") ||
      `<tr><td colspan="10" class="muted">no jobs${status ? " with status " + esc(status) : ""}</td></tr>`;
  };
}
