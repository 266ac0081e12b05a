// ftune dashboard: the page's common parts: helpers, the API called with the key, the login.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "ftune.apiKey";
const INTERVAL = Number(new URLSearchParams(location.search).get("interval")) || 2000;
const COLORS = ["#3b7ddd", "#e8793a", "#3aa76d", "#9b59b6", "#d64545", "#c9a227", "#2bb3c0", "#7f8c8d"];
let summary = null;   // last /dashboard/summary
let view = null;      // the job page's state: {id, steps: Map, evals: Map, lastStep, lastEvent, plan, job}

class AuthError extends Error {}

function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
function duration(s) {
  if (s == null) return "";
  s = Math.max(0, Math.round(s));
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
  return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
}
function gib(bytes) { return bytes == null ? "-" : (bytes / 2 ** 30).toFixed(2) + " GiB"; }
function size(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (bytes >= 1024 && i < units.length - 1) { bytes /= 1024; i++; }
  return (i ? bytes.toFixed(1) : bytes) + " " + units[i];
}
function num(x, digits) { return x == null ? "-" : Number(x).toFixed(digits); }

// --- the API, with the key -------------------------------------------------------------------------
async function api(path, init = {}) {
  const headers = {Authorization: "Bearer " + (localStorage.getItem(KEY) || "")};
  if (init.body) headers["Content-Type"] = "application/json";
  const r = await fetch(path, {...init, headers});
  if (r.status === 401) throw new AuthError("the API refused this key");
  if (!r.ok) {
    const body = await r.json().catch(() => null);
    const err = new Error(body?.error?.message || path + ": HTTP " + r.status);
    err.status = r.status;
    err.body = body;  // {"error": {code, message, param, details}}: a 422's details name each field
    throw err;
  }
  return r;
}
const getJSON = async (path) => (await api(path)).json();
const postJSON = async (path, data) => (await api(path, {method: "POST", body: JSON.stringify(data)})).json();

function showLogin(message) {
  $("app").hidden = true; $("signout").hidden = true; $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("key-input").focus();
}
$("login-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const key = $("key-input").value.trim();
  if (!key) return;
  localStorage.setItem(KEY, key);
  $("key-input").value = "";
  tick();
});
$("signout").addEventListener("click", (ev) => {
  ev.preventDefault(); localStorage.removeItem(KEY); showLogin("");
});
