// The rollouts page: the list and a form for a new rollout (#/rollouts), and one rollout with
// its waves, every device's job and the pause / resume / abort buttons (#/rollouts/ID).

import { ApiFailure, api, pathId, query } from "./api.js";
import { badge, h, number, replace, table, time, when } from "./dom.js";
import { fleetRollbackCard } from "./fleet_rollback.js";

const ID = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;
const MAX_DEVICE_ROWS = 500;
// Which operator actions each state allows (sdk/fleet_server/rollouts.py TRANSITIONS).
export const ACTIONS = {
  pending: ["pause", "abort"],
  running: ["pause", "abort"],
  paused: ["resume", "abort"],
  succeeded: [],
  failed: [],
  aborted: [],
};
const STATE_KIND = { running: "run", pending: "run", paused: "warn", succeeded: "ok", failed: "off", aborted: "off" };

function stateBadge(state) {
  return badge(state, STATE_KIND[state] || "");
}

// The artifact as version and short sha together: releases of one model share a name, and the
// sha is what the API, the CLI and the audit name.
export function artifactText(artifact) {
  const sha = artifact.sha256 ? ` (${artifact.sha256.slice(0, 12)})` : "";
  return `${artifact.name || "?"} ${artifact.version || ""}${sha}`.trim();
}

function waveText(rollout) {
  return `${Math.min(rollout.wave + 1, rollout.wave_count)} of ${rollout.wave_count}`;
}

function targetText(target) {
  if (target.group) return `group ${target.group}`;
  return target.devices ? `${number(target.devices.length)} devices` : "devices";
}

// ------------------------------------------------------------------ the list and the form

function rolloutRow(rollout) {
  return h("tr", { "data-rollout": rollout.id },
    h("td", {}, h("a", { href: `#/rollouts/${pathId(rollout.id)}` }, rollout.id)), h("td", {}, stateBadge(rollout.state)),
    h("td", {}, artifactText(rollout.artifact)), h("td", {}, waveText(rollout)), h("td", {}, targetText(rollout.target)),
    h("td", {}, rollout.created_by), h("td", {}, when(rollout.created_at)), h("td", {}, rollout.reason || ""));
}

export function parseWaves(text) {
  const parts = text.split(/[\s,]+/).filter(Boolean);
  const waves = parts.map(Number);
  if (!waves.length || waves.some((w) => !Number.isFinite(w) || w <= 0 || w > 100)) {
    throw new Error("waves: percentages between 0 and 100, e.g. 5,25,100");
  }
  return waves;
}

// The gates and signed options the API has beyond waves, soak and share: each left empty keeps
// the server's default; a value out of range is refused here naming the field (and by the API).
export function readGates(values, isGroup) {
  const body = {};
  const numeric = [["health_window_s", values.health_window_s, 0, 86400],
                   ["max_error_rate", values.max_error_rate, 0, 1],
                   ["wave_timeout_s", values.wave_timeout_s, 1, 7 * 86400]];
  for (const [name, text, low, high] of numeric) {
    if (text === "" || text === undefined) continue;
    const value = Number(text);
    if (!Number.isFinite(value) || value < low || value > high) throw new Error(`${name}: a number in ${low}..${high}`);
    body[name] = value;
  }
  if (values.force_downgrade) body.force_downgrade = true;
  if (values.allow_contract_change) body.allow_contract_change = true;
  if (values.exclude_offline && !isGroup) body.exclude_offline = true;
  return body;
}

function gateFields() {
  const number = (id, attrs) => h("input", { id, type: "number", step: "any", ...attrs });
  const inputs = {
    // No min/max attributes: the bounds are checked by readGates, whose message names the field.
    health_window_s: number("new-health-window", { placeholder: "device default" }),
    max_error_rate: number("new-max-error-rate", { placeholder: "not checked" }),
    wave_timeout_s: number("new-wave-timeout", { value: 1800 }),
    force_downgrade: h("input", { id: "new-force-downgrade", type: "checkbox" }),
    allow_contract_change: h("input", { id: "new-allow-contract-change", type: "checkbox" }),
    exclude_offline: h("input", { id: "new-exclude-offline", type: "checkbox" }),
  };
  const elements = [
    h("label", {}, "Health window per device (s) ", inputs.health_window_s),
    h("label", {}, "Largest error rate while soaking (0–1) ", inputs.max_error_rate),
    h("label", {}, "Wave timeout (s) ", inputs.wave_timeout_s),
    h("label", { class: "check" }, inputs.force_downgrade, " force downgrade (signed into the command)"),
    h("label", { class: "check" }, inputs.allow_contract_change, " allow a contract change (inputs or outputs differ)"),
    h("label", { class: "check" }, inputs.exclude_offline, " leave out listed devices that are offline now"),
  ];
  const read = (isGroup) => readGates(Object.fromEntries(Object.entries(inputs).map(([name, input]) =>
    [name, input.type === "checkbox" ? input.checked : input.value.trim()])), isGroup);
  return { elements, read };
}

function newRolloutForm(refreshList) {
  const artifact = h("select", { id: "new-artifact", name: "artifact", required: true });
  const file = h("input", { id: "upload-file", type: "file", accept: ".edgepkg" });
  const upload = h("button", { type: "button", id: "upload", "data-needs": "artifact.upload" }, "Upload");
  const group = h("input", { id: "new-group", name: "group", placeholder: "group", maxlength: 64,
                             pattern: "[A-Za-z0-9][A-Za-z0-9._\\-]{0,63}" });
  const devices = h("textarea", { id: "new-devices", name: "devices", rows: 2,
                                  placeholder: "or device ids, separated by spaces or commas" });
  const waves = h("input", { id: "new-waves", name: "waves", value: "5,25,100", required: true });
  const soak = h("input", { id: "new-soak", name: "soak", type: "number", min: 0, step: "any", value: 60 });
  const share = h("input", { id: "new-share", name: "share", type: "number", min: 0, max: 1, step: "any", value: 1 });
  const rollback = h("input", { id: "new-rollback", name: "rollback", type: "checkbox" });
  const gates = gateFields();
  const message = h("p", { class: "error", role: "alert", id: "new-error" });
  const form = h("form", { id: "new-rollout", class: "stack" },
    h("label", { class: "wide" }, "Artifact ", artifact),
    h("span", { class: "inline wide" }, file, upload),
    h("label", {}, "Group ", group), h("label", {}, "Devices ", devices),
    h("label", {}, "Waves (cumulative %) ", waves), h("label", {}, "Soak per wave (s) ", soak),
    h("label", {}, "Success share a wave needs ", share),
    h("label", { class: "check" }, rollback, " roll back what was updated when a wave fails"),
    gates.elements,
    h("span", { class: "inline wide" }, h("button", { type: "submit", id: "new-submit" }, "Start rollout"), message));

  async function loadArtifacts(select) {
    const doc = await api("/api/artifacts");
    // A release marked bad fleet-wide is listed, marked and not selectable (the server refuses it).
    replace(artifact, doc.artifacts.map((a) => h("option", { value: a.sha256, selected: a.sha256 === select,
                                                             disabled: Boolean(a.bad), class: a.bad ? "bad" : null },
      `${a.name} ${a.version} (${a.sha256.slice(0, 12)}…, signed by ${a.key_id})`,
      a.bad ? ` (marked bad: ${a.bad.reason})` : "")));
  }

  upload.addEventListener("click", async () => {
    message.textContent = "";
    const chosen = file.files && file.files[0];
    if (!chosen) {
      message.textContent = "choose an .edgepkg file first";
      return;
    }
    upload.disabled = true;
    try {
      const stored = await api("/api/artifacts", { method: "POST", body: chosen,
                                                    headers: { "Content-Type": "application/octet-stream" } });
      await loadArtifacts(stored.sha256);
      message.textContent = "";
    } catch (error) {
      message.textContent = `upload refused: ${error.message}`;
    } finally {
      upload.disabled = false;
    }
  });

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    message.textContent = "";
    const body = { artifact: artifact.value, soak_s: Number(soak.value || 0),
                   min_success_share: Number(share.value === "" ? 1 : share.value),
                   rollback_on_failure: rollback.checked };
    try {
      body.waves = parseWaves(waves.value);
      const ids = devices.value.split(/[\s,]+/).filter(Boolean);
      if (Boolean(group.value.trim()) === Boolean(ids.length)) throw new Error("give a group or device ids, not both");
      if (group.value.trim()) body.group = group.value.trim();
      else body.devices = ids;
      for (const id of [body.group, ...(body.devices || [])].filter(Boolean)) {
        if (!ID.test(id)) throw new Error(`${id.slice(0, 64)} is not a valid id`);
      }
      if (!body.artifact) throw new Error("upload or choose an artifact");
      Object.assign(body, gates.read(Boolean(body.group)));
    } catch (error) {
      message.textContent = error.message;
      return;
    }
    const submit = form.querySelector("#new-submit");
    submit.disabled = true;
    try {
      const created = await api("/api/rollouts", { method: "POST", json: body });
      location.hash = `#/rollouts/${pathId(created.id)}`;
    } catch (error) {
      message.textContent = error instanceof ApiFailure ? error.message : String(error);
    } finally {
      submit.disabled = false;
      refreshList();
    }
  });
  return { element: h("details", { class: "card", id: "new-rollout-box", "data-needs": "rollout.create" }, h("summary", {}, "New rollout"), form),
           loadArtifacts };
}

function mountList(root) {
  const list = h("div", { class: "table-wrap" });
  const form = newRolloutForm(() => {});
  const incident = fleetRollbackCard();
  replace(root, h("h1", {}, "Rollouts"), form.element, incident.element, list);
  let artifactsLoaded = false;

  async function refresh() {
    if (!artifactsLoaded) {
      await Promise.all([form.loadArtifacts(""), incident.load()]);
      artifactsLoaded = true;
    }
    const doc = await api(`/api/rollouts${query({ limit: 100 })}`);
    replace(list, table(["Rollout", "State", "Artifact", "Wave", "Target", "By", "Created", "Reason"],
                        doc.rollouts.map(rolloutRow), { id: "rollouts", empty: "no rollout yet" }));
  }
  return { title: "Rollouts", refresh };
}

// ------------------------------------------------------------------ one rollout

export function progress(wave) {
  // A wave that failed its soak may have every job active: the bar must still read failed.
  const failed = wave.state === "failed" || wave.state === "aborted";
  const bar = h("span", { class: failed ? `progress wave-${wave.state}` : "progress",
                          title: `${wave.state}: ${wave.active} active, ${wave.failed} failed, ` +
                                 `${wave.in_progress} in progress, ${wave.not_sent} not sent` });
  for (const part of ["active", "failed", "in_progress"]) {
    if (!wave[part] || !wave.devices) continue;
    const piece = h("span", { class: `part ${part}` });
    piece.style.width = `${((100 * wave[part]) / wave.devices).toFixed(2)}%`; // CSSOM, allowed by the CSP
    bar.append(piece);
  }
  return bar;
}

function waveRows(rollout) {
  return rollout.waves.map((wave) => h("tr", { "data-wave": wave.index },
    h("td", {}, String(wave.index + 1)), h("td", { class: "num" }, wave.percent === null ? "–" : `${wave.percent} %`),
    h("td", {}, badge(wave.state, { passed: "ok", failed: "off", aborted: "off", paused: "warn" }[wave.state] || "")),
    h("td", { class: "num" }, number(wave.devices)), h("td", {}, progress(wave)),
    h("td", { class: "num" }, number(wave.active)), h("td", { class: "num" }, number(wave.failed)),
    h("td", { class: "num" }, number(wave.in_progress)), h("td", { class: "num" }, number(wave.not_sent)),
    h("td", { class: "num" }, number(wave.offline || 0)), h("td", { class: "waits" }, waveWaits(rollout, wave))));
}

// Seconds as "1 h 02 min", "4 min 05 s", "42 s".
export function duration(seconds) {
  const s = Math.max(0, Math.round(seconds));
  if (s >= 3600) return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`;
  if (s >= 60) return `${Math.floor(s / 60)} min ${String(s % 60).padStart(2, "0")} s`;
  return `${s} s`;
}

// What the running wave waits for, counted down at each refresh: the soak's end, else the
// wave's deadline (offline devices are waited for until then).
export function waveWaits(rollout, wave, now = Date.now() / 1000) {
  if (wave.index !== rollout.wave || rollout.state !== "running") return "";
  if (wave.state === "soaking" && rollout.soak_started_at !== null && rollout.soak_started_at !== undefined) {
    const left = rollout.soak_started_at + rollout.gates.soak_s - now;
    return h("span", { id: "soak-countdown", "data-left": Math.round(left) }, `soak ends in ${duration(left)}`);
  }
  if (wave.deadline) {
    const offline = wave.offline ? `${wave.offline} offline; ` : "";
    return h("span", { id: "wave-deadline" }, `${offline}times out in ${duration(wave.deadline - now)} ` +
                                              `(${time(wave.deadline)})`);
  }
  return "";
}

function jobKind(job) {
  if (job.undo) return "warn";
  if (job.final) return job.state === "active" ? "ok" : "off";
  return job.state === "not_sent" ? "" : "run";
}

// A job the rollout undid (a rollback or cancel after a failed wave) never reads "active
// (final)": the device is not on the rollout's artifact any more.
export function jobText(job) {
  if (job.undo) return `undone: ${job.undo.kind} ${job.undo.state}`;
  return job.final ? `${job.state} (final)` : job.state;
}

function deviceRows(devices) {
  return devices.slice(0, MAX_DEVICE_ROWS).map((job) => h("tr", { "data-device": job.device },
    h("td", {}, h("a", { href: `#/devices/${pathId(job.device)}` }, job.device)), h("td", {}, String(job.wave + 1)),
    h("td", {}, badge(jobText(job), jobKind(job))), h("td", {}, job.reason || ""),
    h("td", {}, when(job.sent_at)), h("td", {}, when(job.updated_at)),
    h("td", {}, job.undo ? `${job.undo.kind}: ${job.undo.state}${job.undo.reason ? ` (${job.undo.reason})` : ""}`
      : "")));
}

// Every transition with its own reason (the rollout's reason is only the newest), waves 1-based.
function transitionRow(step) {
  return h("tr", { "data-event": step.event },
    h("td", {}, time(step.at)), h("td", {}, step.event), h("td", {}, step.from || "–"), h("td", {}, step.to),
    h("td", { class: "num" }, String(step.wave)), h("td", {}, step.actor), h("td", { class: "detail" }, step.reason || "–"));
}

function gates(rollout) {
  const g = rollout.gates;
  return h("dl", { class: "facts" },
    h("dt", {}, "Success share a wave needs"), h("dd", {}, String(g.min_success_share)),
    h("dt", {}, "Soak per wave"), h("dd", {}, `${g.soak_s} s`),
    h("dt", {}, "Wave timeout"), h("dd", {}, `${g.wave_timeout_s} s`),
    h("dt", {}, "Largest error rate while soaking"), h("dd", {}, g.max_error_rate === null ? "–" : String(g.max_error_rate)),
    h("dt", {}, "Roll back on failure"), h("dd", {}, g.rollback_on_failure ? "yes" : "no"));
}

function mountDetail(root, id, shell) {
  const state = h("span", { id: "rollout-state" });
  const facts = h("div");
  const reason = h("input", { id: "action-reason", maxlength: 500, placeholder: "reason (kept in the audit log)" });
  const buttons = Object.fromEntries(["pause", "resume", "abort"].map((name) =>
    [name, h("button", { type: "button", id: `rollout-${name}`, "data-action": name, disabled: true },
             name[0].toUpperCase() + name.slice(1))]));
  const actionError = h("p", { class: "error", role: "alert", id: "action-error" });
  const waves = h("div", { class: "table-wrap" });
  const devices = h("div", { class: "table-wrap" });
  const deviceNote = h("p", { class: "muted" });
  const history = h("div", { class: "table-wrap" });
  let latest = null;
  replace(root,
    h("p", { class: "crumbs" }, h("a", { href: "#/rollouts" }, "Rollouts"), " / ", id),
    h("h1", {}, "Rollout ", h("span", { id: "rollout-id" }, id), " ", state),
    h("div", { class: "actions", "data-needs": "rollout.pause" }, reason, buttons.pause, buttons.resume, buttons.abort),
    actionError,
    facts, h("h2", {}, "Waves"), waves, h("h2", {}, "Devices"), deviceNote, devices,
    h("h2", {}, "History"), history);

  async function act(name) {
    actionError.textContent = "";
    if (name === "abort" && !window.confirm(`Abort rollout ${id}? Devices already updated keep the new model ` +
                                            "unless it rolls back on failure.")) {
      return;
    }
    for (const button of Object.values(buttons)) button.disabled = true;
    try {
      const text = reason.value.trim();
      await api(`/api/rollouts/${pathId(id)}/${name}`, { method: "POST", json: text ? { reason: text } : {} });
      reason.value = "";
    } catch (error) {
      actionError.textContent = error.message;
    }
    await shell.refresh();
  }
  for (const [name, button] of Object.entries(buttons)) button.addEventListener("click", () => act(name));

  async function refresh() {
    const rollout = await api(`/api/rollouts/${pathId(id)}`);
    latest = rollout;
    replace(state, stateBadge(rollout.state));
    state.dataset.state = rollout.state;
    for (const [name, button] of Object.entries(buttons)) {
      button.disabled = !(ACTIONS[rollout.state] || []).includes(name);
    }
    replace(facts, h("dl", { class: "facts", id: "rollout-facts" },
      h("dt", {}, "Artifact"), h("dd", {}, `${rollout.artifact.name} ${rollout.artifact.version} `,
                                 h("code", {}, rollout.artifact.sha256.slice(0, 16)), "…"),
      h("dt", {}, "Target"), h("dd", {}, targetText(rollout.target)),
      h("dt", {}, "Wave"), h("dd", {}, waveText(rollout)),
      h("dt", {}, "Reason"), h("dd", {}, rollout.reason || "–"),
      h("dt", {}, "Created"), h("dd", {}, `${time(rollout.created_at)} by ${rollout.created_by}`),
      h("dt", {}, "Started"), h("dd", {}, time(rollout.started_at)),
      h("dt", {}, "Finished"), h("dd", {}, time(rollout.finished_at))), gates(rollout));
    replace(waves, table(["Wave", "Up to", "State", "Devices", "Progress", "Active", "Failed", "In progress",
                          "Not sent", "Offline", "Waiting for"], waveRows(rollout), { id: "waves" }));
    replace(deviceNote, rollout.devices.length > MAX_DEVICE_ROWS
      ? `the first ${MAX_DEVICE_ROWS} of ${number(rollout.devices.length)} devices (GET /api/rollouts/${id} has all)`
      : `${number(rollout.devices.length)} devices: ${rollout.counts.active} active, ${rollout.counts.failed} ` +
        `failed, ${rollout.counts.in_progress} in progress, ${rollout.counts.not_sent} not sent`);
    replace(devices, table(["Device", "Wave", "Job", "Reason", "Sent", "Updated", "Undo"],
                           deviceRows(rollout.devices), { id: "rollout-devices" }));
    replace(history, table(["When", "Event", "From", "To", "Wave", "Who", "Reason"],
                           (rollout.transitions || []).map(transitionRow), { id: "rollout-transitions" }));
  }
  return { title: `Rollout ${id}`, refresh, latest: () => latest };
}

export function mount(root, route, shell) {
  const id = route.parts[1];
  if (id === undefined) return mountList(root);
  if (!ID.test(id)) throw new Error("not a rollout id");
  return mountDetail(root, id, shell);
}
