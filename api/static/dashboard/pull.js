// ftune dashboard: pulling a base model from the Hub (admins).
"use strict";

// The API keeps the progress in its own process; this page follows the pull it started.
let pulling = null;

function drawPull(p, error) {
  const line = $("pull-progress");
  line.dataset.state = error ? "failed" : p.state;
  if (error) {
    line.innerHTML = `<span class="error">${esc(error.body?.error?.code || "error")}: ${esc(error.message)}</span>`;
    return;
  }
  const what = esc(p.repo) + (p.revision ? "@" + esc(p.revision) : "");
  if (p.state === "failed") {
    line.innerHTML = `<span class="error">pulling ${what} failed: ${esc(p.error.code)}: ${esc(p.error.message)}</span>`;
  } else if (p.state === "succeeded") {
    line.innerHTML = `${p.already_present ? "already here" : "pulled"}: <b>${esc(p.model)}</b> at commit
      ${esc((p.commit_sha || "").slice(0, 12))}${p.already_present ? "" : ` (${p.files_total} files, ${size(p.bytes_total)})`};
      it is in the base model list`;
  } else if (!p.files_total) {
    line.textContent = `pulling ${p.repo}${p.revision ? "@" + p.revision : ""}: ${p.stage}…`;
  } else {
    const pct = p.bytes_total ? Math.floor((100 * p.bytes_done) / p.bytes_total) : 0;
    line.innerHTML = `pulling ${what}: <span class="bar"><div style="width:${pct}%"></div></span>
      ${size(p.bytes_done)} of ${size(p.bytes_total)} (${pct}%) · ${p.files_done}/${p.files_total} files
      ${p.current_file ? "· " + esc(p.current_file) : ""}`;
  }
}

async function followPull(p) {
  pulling = p.id;
  try {
    while (p.state === "running") {
      drawPull(p);
      await new Promise((done) => setTimeout(done, Math.min(INTERVAL, 1000)));
      if (pulling !== p.id) return;
      p = await getJSON("/models/pulls/" + p.id);
    }
    drawPull(p);
    if (p.state === "succeeded") {  // the new model in the form's choices, the current choice kept
      const models = await getJSON("/models");
      const before = $("f-base_model").value;
      if (choices) choices.models = models;
      options($("f-base_model"), models, (m) => m.name, modelLabel);
      if ($("f-base_model").value !== before) schedulePlan();  // the first model: the form changed
    }
  } catch (e) {
    if (e instanceof AuthError) return showLogin("That key was refused. Paste a valid API key.");
    drawPull(p, e);
  } finally {
    if (pulling === p.id) $("pull-submit").disabled = false;
  }
}

$("pull-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const repo = $("pull-repo").value.trim(), revision = $("pull-revision").value.trim();
  $("pull-submit").disabled = true;
  try {
    followPull(await postJSON("/models/pull", revision ? {repo, revision} : {repo}));
  } catch (e) {
    $("pull-submit").disabled = false;
    if (e instanceof AuthError) return showLogin("That key was refused. Paste a valid API key.");
    drawPull(null, e);  // refused at once: 403 (not an admin, or pulls are off), 409, 422
  }
});
