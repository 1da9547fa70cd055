// The device page's actions: rollback to the last good model, re-run the target, ping, hold,
// release (POST /api/devices/{id}/actions/{action}), revoke its credentials (POST
// /api/devices/{id}/revoke: its certificates into the broker's CRL) and decommission (DELETE /api/devices/{id}).
// Every one takes the operator's reason, kept whole in the audit log; the server signs the
// commands and records them, so the answer names the command id, and the job shows up in the
// update history.

import { api, pathId } from "./api.js";
import { h } from "./dom.js";

export const DEVICE_ACTIONS = [
  { action: "rollback", label: "Roll back", confirm: (id) => `Roll ${id} back to its last good model? ` +
      "If its target names the model, the device is also held." },
  { action: "rerun", label: "Re-run target" },
  { action: "ping", label: "Ping" },
  { action: "hold", label: "Hold" },
  { action: "release", label: "Release hold" },
];

// What the server's answer says, in one line.
export function actionResult(done) {
  if (done.command && done.action !== "rerun") {
    return `${done.action}: sent ${done.command}${done.held ? "; the device is held" : ""}`;
  }
  if (done.action === "rerun") return `rerun: target set again (${done.state}${done.why ? `: ${done.why}` : ""})`;
  return `${done.action}: held by ${(done.held_by || []).join(", ") || "nothing"}`;
}

export function actionsPanel(id, shell) {
  const reason = h("input", { id: "device-action-reason", maxlength: 500,
                              placeholder: "reason (kept in the audit log)" });
  const result = h("p", { class: "muted", id: "device-action-result", role: "status" });
  const error = h("p", { class: "error", role: "alert", id: "device-action-error" });
  const buttons = DEVICE_ACTIONS.map((spec) =>
    h("button", { type: "button", id: `device-${spec.action}`, "data-action": spec.action }, spec.label));
  const decommission = h("button", { type: "button", id: "device-decommission", class: "danger",
                                     "data-needs": "device.decommission" }, "Decommission");
  const revoke = h("button", { type: "button", id: "device-revoke", class: "danger", "data-needs": "device.revoke" },
                   "Revoke credentials");

  async function run(spec) {
    error.textContent = "";
    result.textContent = "";
    if (spec.confirm && !window.confirm(spec.confirm(id))) return;
    for (const button of [...buttons, decommission]) button.disabled = true;
    try {
      const text = reason.value.trim();
      const done = await api(`/api/devices/${pathId(id)}/actions/${spec.action}`,
                             { method: "POST", json: text ? { reason: text } : {} });
      result.textContent = actionResult(done);
      result.dataset.command = done.command || "";
      reason.value = "";
    } catch (failure) {
      error.textContent = failure.message;
    } finally {
      for (const button of [...buttons, decommission]) button.disabled = false;
    }
    await shell.refresh();
  }

  async function remove() {
    error.textContent = "";
    const text = reason.value.trim();
    if (!text) {
      error.textContent = "reason: say why the device leaves the fleet";
      return;
    }
    if (!window.confirm(`Decommission ${id}? Its records go, its certificates are revoked and its messages are ` +
                        "dropped until it is enrolled again.")) {
      return;
    }
    try {
      await api(`/api/devices/${pathId(id)}`, { method: "DELETE", json: { reason: text } });
      location.hash = "#/fleet";
    } catch (failure) {
      error.textContent = failure.message;
    }
  }

  async function revokeCredentials() {
    error.textContent = "";
    result.textContent = "";
    const text = reason.value.trim();
    if (!text) {
      error.textContent = "reason: say why its credentials are revoked";
      return;
    }
    if (!window.confirm(`Revoke ${id}'s certificates and broker password? It cannot connect again until it is ` +
                        "enrolled again.")) {
      return;
    }
    try {
      const done = await api(`/api/devices/${pathId(id)}/revoke`, { method: "POST", json: { reason: text } });
      result.textContent = `revoked ${done.revoked.length} certificate(s)` +
        (done.password_removed ? " and the broker password" : "");
      reason.value = "";
    } catch (failure) {
      error.textContent = failure.message;
    }
  }

  DEVICE_ACTIONS.forEach((spec, index) => buttons[index].addEventListener("click", () => run(spec)));
  decommission.addEventListener("click", remove);
  revoke.addEventListener("click", revokeCredentials);
  return h("div", { id: "device-actions", "data-needs": "device.action" },
    h("div", { class: "actions" }, reason, buttons, revoke, decommission), result, error);
}
