// ftune dashboard: charts, the memory bar and the data box, drawn as SVG and HTML.
"use strict";

function lineChart(title, series, fmt) {
  const W = 420, H = 190, L = 56, R = 10, T = 22, B = 22;
  const pts = series.flatMap((s) => s.points);
  if (!pts.length) return `<svg width="${W}" height="${H}"><text x="${L}" y="${H / 2}">${esc(title)}: no data yet</text></svg>`;
  const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.05 || 1; y1 += Math.abs(y1) * 0.05 || 1; }
  const X = (x) => (L + (W - L - R) * (x - x0) / (x1 - x0)).toFixed(1);
  const Y = (y) => (H - B - (H - T - B) * (y - y0) / (y1 - y0)).toFixed(1);
  const lines = series.filter((s) => s.points.length).map((s) => {
    const coords = s.points.map(([x, y]) => `${X(x)},${Y(y)}`).join(" ");
    const dot = s.points.length === 1 ? `<circle cx="${X(s.points[0][0])}" cy="${Y(s.points[0][1])}" r="3" fill="${s.color}"/>` : "";
    return `<polyline data-series="${esc(s.name)}" data-points="${s.points.length}" points="${coords}"
      fill="none" stroke="${s.color}" stroke-width="2"/>${dot}`;
  }).join("");
  const legend = series.map((s, i) =>
    `<text x="${L + 110 * i}" y="14" style="fill:${s.color}">■ ${esc(s.name)}</text>`).join("");
  return `<svg width="${W}" height="${H}" role="img" aria-label="${esc(title)}">
    <text x="${W - R}" y="14" text-anchor="end">${esc(title)}</text>${legend}
    <line x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}" stroke="#ccd"/><line x1="${L}" y1="${T}" x2="${L}" y2="${H - B}" stroke="#ccd"/>
    <text x="${L - 4}" y="${T + 4}" text-anchor="end">${fmt(y1)}</text>
    <text x="${L - 4}" y="${H - B}" text-anchor="end">${fmt(y0)}</text>
    <text x="${L}" y="${H - 6}">step ${x0}</text><text x="${W - R}" y="${H - 6}" text-anchor="end">step ${x1}</text>
    ${lines}</svg>`;
}

function memoryBar(plan, job) {  // job: null for a plan of a job not created yet (no measured peak)
  if (!plan) return `<p class="muted">No plan: this job was admitted before any worker reported its devices.
    Measured peak: ${gib(job.peak_mem_bytes)}.</p>`;
  const W = 760, L = 130, barW = W - L - 20;
  const scale = Math.max(plan.total_bytes, job?.peak_mem_bytes || 0, 1);
  const px = (b) => barW * b / scale;
  let x = L;
  const segs = plan.breakdown.filter((t) => t.bytes > 0).map((t, i) => {
    const w = px(t.bytes), seg = `<rect class="term" x="${x.toFixed(1)}" y="10" width="${w.toFixed(1)}" height="26"
      fill="${COLORS[i % COLORS.length]}"><title>${esc(t.name)}: ${gib(t.bytes)} — ${esc(t.note)}</title></rect>`;
    x += w;
    return seg;
  }).join("");
  const alloc = L + px(plan.allocated_bytes);
  const measured = job?.peak_mem_bytes
    ? `<rect id="measured-bar" x="${L}" y="50" width="${px(job.peak_mem_bytes).toFixed(1)}" height="26" fill="#1d2330"/>` : "";
  const legend = plan.breakdown.filter((t) => t.bytes > 0).map((t, i) =>
    `<span style="color:${COLORS[i % COLORS.length]}">■</span> ${esc(t.name)} ${gib(t.bytes)}`).join(" &nbsp; ");
  const peak = job ? `<text x="0" y="68">measured ${gib(job.peak_mem_bytes)}</text>${measured}` : "";
  return `<svg width="${W}" height="${job ? 90 : 48}" role="img" aria-label="memory">
      <text x="0" y="28">predicted ${gib(plan.total_bytes)}</text>${segs}
      <line x1="${alloc}" y1="4" x2="${alloc}" y2="${job ? 82 : 44}" stroke="#b00020" stroke-dasharray="4 3"><title>predicted allocated: ${gib(plan.allocated_bytes)}</title></line>
      ${peak}</svg>
    <p class="muted">on ${esc(plan.gpu)} (usable ${gib(plan.usable_bytes)}); dashed line: predicted allocated
      ${gib(plan.allocated_bytes)}, the number comparable with the measured peak.<br>${legend}</p>`;
}

// The job's token statistics: computed when it was created, or at training start (no batch figures then).
function dataBox(ts) {
  if (!ts) return `<p class="muted">No token statistics: this job is older than them.</p>`;
  if (ts.status === "pending") return `<p class="muted">Counting tokens against the base model's tokenizer…</p>`;
  if (ts.status === "failed") return `<p class="error">${esc(ts.error.code)}: ${esc(ts.error.message)}</p>`;
  const fate = ts.over_length === "drop" ? "dropped" : "truncated";
  const over = ts.over_max_seq_len
    ? `<span class="error">${esc(ts.over_max_seq_len)} (${fate})</span>` : `0 (${esc(ts.over_length)})`;
  const rows = [
    ["examples", esc(ts.count)],
    ["tokens p50 / p95 / max", esc(`${ts.p50} / ${ts.p95} / ${ts.max}`)],
    [`longer than max_seq_len ${ts.max_seq_len ?? ""}`, over],
    ["not trained on", ts.dropped ? `<span class="error">${esc(ts.dropped)}</span>` : esc(ts.dropped ?? "-")],
  ];
  if (ts.steps_per_epoch != null) rows.push(
    [`${ts.packing ? "packed" : "padded"} micro-batches per epoch`, esc(ts.micro_batches_per_epoch)],
    ["examples per micro-batch (mean)", esc(ts.examples_per_micro_batch)],
    ["optimizer steps per epoch", esc(ts.steps_per_epoch)]);
  if (ts.run_epochs != null) rows.push(["epochs in the run", esc(ts.run_epochs)]);
  return `<table id="token-stats">${rows.map(([k, val]) => `<tr><td>${esc(k)}</td><td>${val}</td></tr>`).join("")}</table>`;
}
