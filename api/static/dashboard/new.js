// ftune dashboard: a new job: the form, its plan as you type, submit.
"use strict";

const form = $("new-form");
let choices = null;     // {datasets, models} read when the form opens
let extra = {};         // a suggestion's changes to fields the form has no input for (e.g. optimizer)
let planSeq = 0, planTimer = null;

// The spec as the form says it: empty fields are left to the API's defaults; what is not a number is
// sent as typed, so the API's 422 names the field.
function formSpec(forPlan) {
  const spec = {...extra};
  for (const el of form.elements) {
    if (!el.name || el.value.trim() === "" || ("planOnly" in el.dataset && !forPlan)) continue;
    const v = el.value.trim(), type = el.dataset.type;
    spec[el.name] = type === "bool" ? v === "true" : (type === "int" || type === "float") && !isNaN(Number(v)) ? Number(v) : v;
  }
  return spec;
}

function showErrors(err) {
  for (const el of form.querySelectorAll("[data-error-for]")) el.textContent = "";
  for (const el of form.elements) el.removeAttribute("aria-invalid");
  $("new-error").textContent = "";
  if (!err) return;
  const e = err.body?.error;
  const problems = Array.isArray(e?.details) ? e.details.filter((d) => d && d.message) : [];
  if (!problems.length) problems.push({param: e?.param, message: e?.message || err.message});
  for (const p of problems) {
    const name = String(p.param ?? "").split(".")[0];
    const slot = name && form.querySelector(`[data-error-for="${CSS.escape(name)}"]`);
    if (slot) {
      const text = p.message.startsWith(p.param + ": ") ? p.message.slice(p.param.length + 2) : p.message;
      slot.textContent = (slot.textContent ? slot.textContent + "; " : "") + text;
      form.elements[name]?.setAttribute("aria-invalid", "true");
    } else {
      $("new-error").textContent += (($("new-error").textContent ? "; " : "") + p.message);
    }
  }
}

function renderPlan(plan) {
  $("plan-total").className = "";
  $("plan-total").innerHTML = `predicted total <b id="plan-total-bytes" data-bytes="${plan.total_bytes}">${gib(plan.total_bytes)}</b>
    of ${gib(plan.usable_bytes)} usable on ${esc(plan.gpu)}${plan.num_gpus > 1 ? " ×" + plan.num_gpus : ""}:
    <span class="status ${plan.fits ? "succeeded" : "failed"}" id="plan-verdict">${plan.fits ? "fits" : "does not fit"}</span>
    ${plan.est_seconds_per_epoch != null ? " · about " + duration(plan.est_seconds_per_epoch) + " per epoch" : ""}`;
  $("plan-memory").innerHTML = memoryBar(plan, null);
  $("plan-suggestions").innerHTML = plan.suggestions.map((g, i) => `<li class="suggestion" data-i="${i}">
    ${esc(g.description)}: ${gib(g.plan_total_bytes)} ${g.fits ? "(fits)" : ""}
    <button type="button" class="apply" data-i="${i}">apply</button></li>`).join("");
  $("plan-suggestions").plan = plan;
}

// Debounced: one plan per pause in typing; an answer to a form that has changed since is dropped.
function schedulePlan() {
  clearTimeout(planTimer);
  $("plan-state").textContent = "…";
  const seq = ++planSeq;
  planTimer = setTimeout(async () => {
    try {
      const plan = await postJSON("/plan", formSpec(true));
      if (seq !== planSeq) return;
      showErrors(null);
      renderPlan(plan);
      $("plan-state").textContent = "";
    } catch (e) {
      if (seq !== planSeq) return;
      if (e instanceof AuthError) return showLogin("That key was refused. Paste a valid API key.");
      showErrors(e);
      $("plan-total").className = "muted";  // the last plan drawn is not this form's: not shown as if it were
      $("plan-total").textContent = e.status === 503 ? "No plan: no worker has reported its devices yet; name a GPU to plan for."
        : "No plan: fix the fields marked above.";
      $("plan-memory").innerHTML = $("plan-suggestions").innerHTML = "";
      $("plan-state").textContent = "";
    }
  }, 300);
}
form.addEventListener("input", schedulePlan);
form.addEventListener("change", schedulePlan);

$("plan-suggestions").addEventListener("click", (ev) => {
  const b = ev.target.closest("button.apply");
  if (!b) return;
  const change = $("plan-suggestions").plan.suggestions[Number(b.dataset.i)].change;
  for (const [k, v] of Object.entries(change)) {
    if (form.elements[k]) form.elements[k].value = String(v);
    else extra[k] = v;
  }
  $("new-extra").hidden = !Object.keys(extra).length;
  $("new-extra").textContent = "also applied: " + Object.entries(extra).map(([k, v]) => `${k}=${v}`).join(", ");
  schedulePlan();
});

form.addEventListener("submit", async (ev) => {
  ev.preventDefault();
  $("new-submit").disabled = true;
  try {
    const job = await postJSON("/jobs", formSpec(false));
    choices = null; extra = {};  // the next new job starts from a fresh form
    location.hash = "#/jobs/" + job.id;
  } catch (e) {
    if (e instanceof AuthError) showLogin("That key was refused. Paste a valid API key.");
    else showErrors(e);
  } finally {
    $("new-submit").disabled = false;
  }
});

// A base model as the form lists it: name, family, parameters (a mixture of experts: total and active per
// token) and modality, from GET /models.
function params(n) {
  for (const [unit, v] of [["B", 1e9], ["M", 1e6], ["K", 1e3]]) if (n >= v) return (n / v).toFixed(1) + unit;
  return String(n);
}

function modelLabel(m) {
  const parts = [m.name, m.family || m.model_type];
  if (m.total_params) {
    const moe = m.active_params && m.active_params !== m.total_params;
    parts.push(params(m.total_params) + (moe ? ` (${params(m.active_params)} active)` : ""));
  }
  parts.push(m.modality || "text");
  return parts.join(" · ");
}

function options(select, items, value, label) {
  const keep = select.value;
  select.innerHTML = items.map((x) => `<option value="${esc(value(x))}">${esc(label(x))}</option>`).join("");
  if (items.some((x) => value(x) === keep)) select.value = keep;
}

// Reads the datasets and base models once per visit of the form; the form itself is never redrawn.
async function loadNew() {
  if (choices) return () => {};
  const [page, models] = await Promise.all([getJSON("/datasets?limit=200"), getJSON("/models")]);
  return () => {
    choices = {datasets: page.data.filter((d) => d.status === "valid"), models};
    options($("f-dataset_id"), choices.datasets, (d) => d.id,
      (d) => `${d.filename} · ${d.format} · ${d.num_examples} examples · ${d.id.slice(0, 8)}`);
    options($("f-base_model"), choices.models, (m) => m.name, modelLabel);
    if (!choices.datasets.length) $("new-error").textContent = "No valid dataset yet: upload one (POST /datasets).";
    schedulePlan();
  };
}
