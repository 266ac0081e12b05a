// ftune dashboard: a job's page: its charts, memory, data, checkpoints, samples and events.
"use strict";

// Reads what is new for the job; returns the function that draws it, as loadList does.
async function loadJob(id) {
  if (!view || view.id !== id) {
    view = {id, steps: new Map(), evals: new Map(), lastStep: 0, lastEvent: 0, plan: undefined, done: false};
    $("samples").replaceChildren(); $("samples-section").hidden = true;
    $("events").innerHTML = ""; $("chart-loss").innerHTML = ""; $("chart-rewards").innerHTML = ""; $("memory").innerHTML = "";
  }
  const v = view;
  if (v.done) return () => {};  // a terminal job was loaded completely; nothing changes any more
  const job = await getJSON("/jobs/" + id);
  const metrics = await getJSON(`/jobs/${id}/metrics?after_step=${v.lastStep}`);
  metrics.data.forEach((r) => v.steps.set(r.step, r));
  (metrics.eval || []).forEach((r) => v.evals.set(r.step, r));
  v.steps.forEach((r) => { if (r.eval_loss != null) v.evals.set(r.step, r); });
  if (v.steps.size) v.lastStep = Math.max(...v.steps.keys());
  let newSamples = false;
  for (let more = true; more;) {  // the cursor-paginated event log, only what is new
    const page = await getJSON(`/jobs/${id}/events?limit=200&after=${v.lastEvent}`);
    newSamples ||= page.data.some((e) => e.kind === "samples");
    $("events").insertAdjacentHTML("beforeend", page.data.map((e) =>
      `<div data-event-id="${e.id}">${esc(e.created_at.slice(0, 19).replace("T", " "))} <b>${esc(e.kind)}</b> ${esc(e.message)}</div>`).join(""));
    if (page.next_after != null) v.lastEvent = page.next_after;
    more = page.has_more;
  }
  if (v.plan === undefined) {
    v.plan = await getJSON(`/jobs/${id}/plan`).catch((e) => { if (e.status === 404) return null; throw e; });
  }
  const artifacts = await getJSON(`/jobs/${id}/artifacts`);
  const samples = newSamples ? await getJSON(`/jobs/${id}/samples`) : null;  // read when a set arrives
  return () => {
    if (view !== v) return;  // the user navigated away meanwhile
    renderJob(job, artifacts);
    if (samples) renderSamples(samples);
    v.done = ["succeeded", "failed", "cancelled"].includes(job.status);
  };
}

function renderJob(job, artifacts) {
  const v = view, p = job.progress;
  const steps = [...v.steps.values()].sort((a, b) => a.step - b.step);
  $("job-title").innerHTML = `job ${esc(job.id)} <span class="status ${esc(job.status)}" id="job-status">${esc(job.status)}</span>`;
  const err = job.error ? `<br><span class="error">${esc(job.error.code)}: ${esc(job.error.message)}</span>` : "";
  const q = job.queue;  // a queued job: its place on the workers that can run it, or why none can
  const queue = !q ? "" : q.waiting_reason ? `<br><span class="error" id="job-queue">${esc(q.waiting_reason)}</span>`
    : `<br><span id="job-queue">queue position ${q.position} · starts ${q.estimated_start
      ? "in ~" + duration(Math.max(0, (Date.parse(q.estimated_start) - Date.now()) / 1000)) : "when a worker frees up"}</span>`;
  $("job-summary").innerHTML = `${esc(job.spec.base_model)} · ${esc(job.spec.method)} · r=${job.spec.lora_r} ·
    attempt ${job.attempt}/${job.max_attempts} · step ${p.step}/${p.total_steps ?? "?"} (${p.percent ?? 0}%) ·
    loss ${num(p.loss, 4)} · ${num(p.tokens_per_s, 0)} tokens/s ·
    ${job.status === "running" ? "ETA " + duration(p.eta_seconds) + " · " : ""}worker ${workerLabel(job.worker_id) || "-"}${err}${queue}`;
  const evals = [...v.evals.values()].sort((a, b) => a.step - b.step);
  const series = (rows, key) => rows.filter((r) => r[key] != null).map((r) => [r.step, r[key]]);
  $("chart-loss").innerHTML = lineChart("loss", [
    {name: "loss", color: COLORS[0], points: series(steps, "loss")},
    {name: "eval loss", color: COLORS[1], points: evals.map((r) => [r.step, r.eval_loss ?? r.loss]).filter((q) => q[1] != null)},
  ], (y) => y.toFixed(3));
  $("chart-lr").innerHTML = lineChart("learning rate", [{name: "lr", color: COLORS[2], points: series(steps, "lr")}], (y) => y.toExponential(1));
  $("chart-tps").innerHTML = lineChart("tokens/s", [{name: "tokens/s", color: COLORS[3], points: series(steps, "tokens_per_s")}], (y) => y.toFixed(0));
  const rewards = series(steps, "rewards_accuracy");  // a dpo job's preference metrics
  $("chart-rewards").innerHTML = !rewards.length ? "" : lineChart("rewards (dpo)", [
    {name: "reward accuracy", color: COLORS[0], points: rewards},
    {name: "reward margin", color: COLORS[1], points: series(steps, "rewards_margin")},
    {name: "eval reward accuracy", color: COLORS[2], points: series(evals, "rewards_accuracy")},
  ], (y) => y.toFixed(2));
  $("memory").innerHTML = memoryBar(v.plan, job);
  $("data").innerHTML = dataBox(job.token_stats);
  // As the API lists them: what is still stored, the adapter first, then checkpoints newest first.
  $("artifacts").innerHTML = !artifacts.length ? `<tr><td class="muted">none yet</td></tr>`
    : `<tr><th>kind</th><th>name</th><th>step</th><th>loss</th><th>eval loss</th><th>size</th><th></th></tr>` +
      artifacts.map((a) => `<tr class="artifact" data-kind="${esc(a.kind)}" data-step="${esc(a.step)}">
    <td>${esc(a.kind)}</td><td>${esc(a.name)}</td><td>${a.step == null ? "" : "step " + a.step}</td>
    <td class="loss">${a.kind === "checkpoint" ? num(a.loss, 4) : ""}</td><td>${a.eval_loss == null ? "" : num(a.eval_loss, 4)}</td>
    <td>${size(a.size_bytes)}</td>
    <td><a href="${esc(a.download_url)}" class="download" data-name="${esc(a.name)}">download</a></td></tr>`).join("");
}

// Before/after samples (spec.sample_prompts): the newest set, older ones folded. Model output and prompts
// are the user's text: drawn with textContent only.
function promptText(p) {
  return typeof p === "string" ? p : p.map((m) => m.role + ": " + m.content).join("\n");
}
function samplesTable(set) {
  const table = document.createElement("table");
  table.className = "samples";
  const head = table.createTHead().insertRow();
  for (const name of ["prompt", "base", "tuned"]) head.appendChild(document.createElement("th")).textContent = name;
  const body = table.createTBody();
  for (const item of set.items) {
    const tr = body.insertRow();
    tr.className = "sample";
    for (const [cls, text] of [["sample-prompt", promptText(item.prompt)], ["sample-base", item.base], ["sample-tuned", item.tuned]]) {
      const td = tr.insertCell();
      td.className = cls;
      td.textContent = text;
      if (!text.trim()) td.dataset.blank = "";  // an empty completion is shown as such, not as a blank cell
    }
  }
  return table;
}
function renderSamples(doc) {
  const box = $("samples");
  box.replaceChildren();
  $("samples-section").hidden = !doc.sets.length;
  [...doc.sets].reverse().forEach((set, i) => {
    const title = document.createElement(i ? "summary" : "h3");
    title.textContent = `step ${set.step}, ${set.at === "end" ? "end of training" : "evaluation"}`;
    if (!i) return box.append(title, samplesTable(set));
    const older = document.createElement("details");
    older.append(title, samplesTable(set));
    box.append(older);
  });
}

// Downloads need the Authorization header, so they are fetched and handed to the browser as a blob.
$("artifacts").addEventListener("click", async (ev) => {
  const a = ev.target.closest("a.download");
  if (!a) return;
  ev.preventDefault();
  try {
    const blob = await (await api(a.getAttribute("href"))).blob();
    const link = Object.assign(document.createElement("a"),
      {href: URL.createObjectURL(blob), download: a.dataset.name.replaceAll("/", "-") + ".tar.gz"});
    link.click();
    setTimeout(() => URL.revokeObjectURL(link.href), 10000);
  } catch (e) { alert("download failed: " + e.message); }
});
