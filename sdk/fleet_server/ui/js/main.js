// The dashboard's shell: sign-in, the hash router, the refresh loop, the server status line.
//
// Pages live behind the URL's hash (#/fleet, #/devices/ID, #/rollouts, #/rollouts/ID,
// #/audit, #/alerts) so that the server serves one static file set and a page reload keeps its
// place.
// Each page module exports mount(root, route) returning { refresh, title }; the shell calls
// refresh() at once and then every few seconds while the tab is visible, never two at a time.

import { ApiFailure, api, forgetToken, setUnauthorizedHandler, storeToken, token, validToken } from "./api.js";
import { replace } from "./dom.js";
import * as alerts from "./alerts.js";
import { applyRole, forgetIdentity, loadIdentity, watchRole } from "./role.js";
import * as audit from "./audit.js";
import * as device from "./device.js";
import * as fleet from "./fleet.js";
import * as rollouts from "./rollouts.js";

const REFRESH_MS = 5000;
const $ = (id) => document.getElementById(id);

let current = null; // { view, timer, busy, key }

export function parseRoute(hash) {
  const text = hash.replace(/^#\/?/, "");
  const [path, search = ""] = text.split("?", 2);
  const parts = path.split("/").filter(Boolean).map((part) => {
    try {
      return decodeURIComponent(part);
    } catch {
      return "";
    }
  });
  return { parts, params: new URLSearchParams(search), key: `${path}?${search}` };
}

function pageFor(route) {
  const [first, second] = route.parts;
  if (!first || first === "fleet") return { module: fleet, page: "fleet" };
  if (first === "devices" && second) return { module: device, page: "fleet" };
  if (first === "rollouts") return { module: rollouts, page: "rollouts" };
  if (first === "audit") return { module: audit, page: "audit" };
  if (first === "alerts") return { module: alerts, page: "alerts" };
  return null;
}

function showError(error) {
  const box = $("page-error");
  if (!error) {
    box.hidden = true;
    box.textContent = "";
    return;
  }
  box.hidden = false;
  box.textContent = error instanceof ApiFailure ? `${error.message} (HTTP ${error.status || "–"})` : String(error);
}

async function refresh() {
  if (!current || current.busy) return;
  current.busy = true;
  const mine = current;
  try {
    await mine.view.refresh();
    if (mine === current) showError(null);
  } catch (error) {
    if (mine === current && !(error instanceof ApiFailure && error.status === 401)) showError(error);
  } finally {
    mine.busy = false;
    document.body.dataset.loaded = String(Date.now());
  }
}

function stopPage() {
  if (current) {
    clearInterval(current.timer);
    if (current.view.destroy) current.view.destroy();
  }
  current = null;
}

function route() {
  if (!token()) {
    showLogin("");
    return;
  }
  const parsed = parseRoute(location.hash);
  if (current && current.key === parsed.key) return;
  stopPage();
  showError(null);
  $("login").hidden = true;
  $("nav").hidden = false;
  $("logout").hidden = false;
  const found = pageFor(parsed);
  const root = $("page");
  replace(root);
  if (!found) {
    showError(`no page ${location.hash}`);
    return;
  }
  for (const link of document.querySelectorAll("#nav a")) {
    link.classList.toggle("current", link.dataset.page === found.page);
  }
  document.body.dataset.page = parsed.parts[0] === "devices" ? "device"
    : parsed.parts[0] === "rollouts" && parsed.parts[1] ? "rollout" : found.page;
  let view;
  try {
    view = found.module.mount(root, parsed, { refresh: () => refresh() });
  } catch (error) {
    showError(error.message);
    return;
  }
  document.title = `${view.title} · Edgepack fleet`;
  current = { view, key: parsed.key, busy: false, timer: setInterval(() => {
    if (document.visibilityState === "visible") refresh();
  }, REFRESH_MS) };
  refresh();
}

function showLogin(message) {
  stopPage();
  replace($("page"));
  $("nav").hidden = true;
  $("logout").hidden = true;
  $("server-status").textContent = "";
  $("whoami").hidden = true;
  forgetIdentity();
  $("login").hidden = false;
  $("login-error").textContent = message;
  document.body.dataset.page = "login";
  document.title = "Sign in · Edgepack fleet";
  $("token").focus();
}

async function signIn(event) {
  event.preventDefault();
  const text = $("token").value.trim();
  if (!validToken(text)) {
    $("login-error").textContent = "A token is 16 to 512 characters of letters, digits and ._~+/=-";
    return;
  }
  storeToken(text);
  try {
    await api("/api/status");
  } catch (error) {
    forgetToken();
    $("login-error").textContent = error.status === 401 ? "The server does not know this token." : error.message;
    return;
  }
  $("token").value = "";
  await identityLine();
  route();
  statusLine();
}

// The header names the token and its role; the pages hide what the role may not do (role.js).
async function identityLine() {
  if (!token()) return;
  try {
    const me = await loadIdentity();
    $("whoami").textContent = `${me.name} · ${me.role}`;
    $("whoami").hidden = false;
    document.body.dataset.role = me.role;
  } catch {
    $("whoami").hidden = true;
  }
  applyRole($("page"));
}

async function statusLine() {
  if (!token()) return;
  try {
    const status = await api("/api/status");
    const ingest = status.ingest || {};
    const rate = Number.isFinite(ingest.rate_per_s) ? ingest.rate_per_s.toFixed(0) : "–";
    $("server-status").textContent = `${status.server_id} · ${status.database} · ` +
      `${status.leader ? "leader" : "standby"} · ${rate} msg/s`;
  } catch {
    $("server-status").textContent = "";
  }
}

setUnauthorizedHandler(() => {
  forgetToken();
  showLogin("The token was refused (signed out or changed on the server). Sign in again.");
});

$("login-form").addEventListener("submit", signIn);
$("logout").addEventListener("click", () => {
  forgetToken();
  showLogin("Signed out.");
});
window.addEventListener("hashchange", route);
setInterval(() => {
  if (document.visibilityState === "visible") {
    statusLine();
    identityLine();
  }
}, 10000);
watchRole($("page"));
identityLine().finally(route);
statusLine();
