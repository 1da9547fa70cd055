// Fleet-wide rollback, for incidents: set the fleet's (or a group's) target back to an earlier
// artifact with a reason (PUT /api/targets/fleet or /api/targets/groups/{group}). The server
// signs the downgrade because the operator chose it, and the reconciler converges every device
// that needs it; devices already on it count as converged. Two clicks and a reason: "Roll
// back…" (the earlier artifact is chosen already), then "Confirm rollback".

import { api, pathId } from "./api.js";
import { h, replace } from "./dom.js";

// Versions compared part by part, numbers as numbers ("1.10.0" after "1.9.0").
export function compareVersions(a, b) {
  const pa = String(a).split(/[.+-]/);
  const pb = String(b).split(/[.+-]/);
  for (let i = 0; i < Math.max(pa.length, pb.length); i += 1) {
    const [x, y] = [pa[i] ?? "", pb[i] ?? ""];
    const [nx, ny] = [Number(x), Number(y)];
    const order = Number.isFinite(nx) && Number.isFinite(ny) && x !== "" && y !== "" ? nx - ny : x < y ? -1 : x > y ? 1 : 0;
    if (order) return Math.sign(order);
  }
  return 0;
}

// The artifact to go back to: the newest build of the same model older than the current one
// (else any other build of it), never one marked bad; null when there is none.
export function earlierArtifact(artifacts, current) {
  const same = artifacts.filter((a) => a.name === current.name && a.sha256 !== current.sha256 && !a.bad);
  const older = same.filter((a) => compareVersions(a.version, current.version) < 0);
  const pool = older.length ? older : same;
  return pool.sort((a, b) => compareVersions(b.version, a.version))[0] || null;
}

function scopes(targets) {
  const found = [["fleet", "", targets.fleet]];
  for (const [group, target] of Object.entries(targets.groups || {})) found.push(["group", group, target]);
  return found.flatMap(([scope, name, target]) => Object.entries(target.models || {})
    .filter(([, sha]) => sha !== "absent").map(([model, sha]) => ({ scope, name, model, sha })));
}

const label = (entry) => (entry.scope === "fleet" ? "fleet" : `group ${entry.name}`);

export function fleetRollbackCard() {
  const which = h("select", { id: "rollback-scope" });
  const to = h("select", { id: "rollback-artifact" });
  const reason = h("input", { id: "rollback-reason", maxlength: 500, placeholder: "reason (kept in the audit log)" });
  const start = h("button", { type: "button", id: "rollback-start", "data-action": "abort" }, "Roll back…");
  const confirmBox = h("p", { id: "rollback-confirm", hidden: true });
  const message = h("p", { class: "muted", id: "rollback-result", role: "status" });
  const note = h("p", { class: "muted", id: "rollback-none", hidden: true },
                 "No fleet or group target yet: set one (edgepack target set, PUT /api/targets/...) and it can be set " +
                 "back here.");
  const error = h("p", { class: "error", role: "alert", id: "rollback-error" });
  let entries = [];
  let artifacts = [];

  function chosen() {
    return entries[Number(which.value)] || null;
  }

  function fillArtifacts() {
    const entry = chosen();
    const current = entry && artifacts.find((a) => a.sha256 === entry.sha);
    const others = entry ? artifacts.filter((a) => a.name === entry.model && a.sha256 !== entry.sha) : [];
    const pick = current ? earlierArtifact(artifacts, current) : others[0];
    replace(to, others.map((a) => h("option", { value: a.sha256, selected: pick && a.sha256 === pick.sha256,
                                                disabled: Boolean(a.bad), class: a.bad ? "bad" : null },
      `${a.name} ${a.version} (${a.sha256.slice(0, 12)})`, a.bad ? ` (marked bad: ${a.bad.reason})` : "")));
  }

  async function load() {
    const [targets, stored] = await Promise.all([api("/api/targets"), api("/api/artifacts")]);
    artifacts = stored.artifacts;
    const before = which.value;
    entries = scopes(targets);
    replace(which, entries.map((entry, index) => {
      const current = artifacts.find((a) => a.sha256 === entry.sha);
      return h("option", { value: index }, `${label(entry)}: ${entry.model} now ` +
               `${current ? current.version : "?"} (${entry.sha.slice(0, 12)})`);
    }));
    if (before !== "" && Number(before) < entries.length) which.value = before;
    fillArtifacts();
    start.disabled = !entries.length;
    note.hidden = entries.length > 0;
  }

  which.addEventListener("change", fillArtifacts);
  start.addEventListener("click", () => {
    error.textContent = "";
    const entry = chosen();
    const artifact = artifacts.find((a) => a.sha256 === to.value);
    if (!reason.value.trim()) {
      error.textContent = "reason: say why the fleet goes back";
      return;
    }
    if (!entry || !artifact) {
      error.textContent = "no earlier artifact of this model is uploaded";
      return;
    }
    const go = h("button", { type: "button", id: "rollback-go", "data-action": "abort" }, "Confirm rollback");
    go.addEventListener("click", () => apply(entry, artifact));
    replace(confirmBox, `Set the ${label(entry)} target of ${entry.model} to ${artifact.version} ` +
                        `(${artifact.sha256.slice(0, 12)})? Every device it covers is sent it, signed. `, go);
    confirmBox.hidden = false;
  });

  async function apply(entry, artifact) {
    confirmBox.hidden = true;
    const path = entry.scope === "fleet" ? "/api/targets/fleet" : `/api/targets/groups/${pathId(entry.name)}`;
    try {
      await api(path, { method: "PUT", json: { models: { [entry.model]: artifact.sha256 },
                                               reason: reason.value.trim() } });
      message.textContent = `${label(entry)}: ${entry.model} set back to ${artifact.version}; the devices converge ` +
                            "(see each device's target)";
      reason.value = "";
      await load();
    } catch (failure) {
      error.textContent = failure.message;
    }
  }

  const element = h("details", { class: "card", id: "fleet-rollback-box", "data-needs": "target.set" },
    h("summary", {}, "Fleet rollback"),
    h("div", { class: "actions" }, h("label", {}, "Target ", which), h("label", {}, "back to ", to)),
    h("div", { class: "actions" }, reason, start), note, confirmBox, message, error);
  // Read again each time the box is opened: the targets may have changed since the page loaded.
  element.addEventListener("toggle", () => {
    if (element.open) load().catch((failure) => { error.textContent = failure.message; });
  });
  return { element, load };
}
