// ftune dashboard: routing and the refresh loop: loaded last, it starts the page.
"use strict";

function route() {
  const m = location.hash.match(/^#\/jobs\/([0-9a-f]+)$/);
  const creating = location.hash === "#/new";
  $("list-view").hidden = !!m || creating; $("job-view").hidden = !m; $("new-view").hidden = !creating;
  if (!creating) choices = null;  // the next visit reads the datasets again
  return m ? m[1] : creating ? "new" : null;
}

let busy = false;
async function tick() {
  if (busy) return;
  busy = true;
  try {
    if (!localStorage.getItem(KEY)) return showLogin("");
    // Rows first, counts second, drawn together: a finished job stays finished, so the counts, read
    // after the rows, include every finished row (a live status that moves on in between is redrawn
    // at the next refresh).
    const id = route();
    const draw = await (id === "new" ? loadNew() : id ? loadJob(id) : loadList());
    summary = await getJSON("/dashboard/summary");
    $("login").hidden = true; $("app").hidden = false; $("signout").hidden = false;
    renderSummary();
    draw();
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    if (e instanceof AuthError) showLogin("That key was refused (missing, revoked or mistyped). Paste a valid API key.");
    else $("updated").innerHTML = `<span class="error">error: ${esc(e.message)}</span>`;
  } finally {
    busy = false;
  }
}

$("jobs").addEventListener("click", (ev) => {
  const tr = ev.target.closest("tr.job");
  if (tr && !ev.target.closest("a")) location.hash = "#/jobs/" + tr.dataset.id;
});
$("filter").addEventListener("change", tick);
window.addEventListener("hashchange", () => { route(); tick(); });
tick();
setInterval(tick, INTERVAL);
