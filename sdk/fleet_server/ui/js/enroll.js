// The fleet page's "Enroll a device" form (admins: POST /api/devices/{id}/enrollment): a device
// id, its groups and, for devices that cannot hold a certificate, a broker password instead. The
// one-time token is shown once, with the command that redeems it on the device
// (docs/enrollment.md); the server keeps only its hash.

import { api, pathId } from "./api.js";
import { h, replace } from "./dom.js";

const ID = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;

// The groups typed as "a, b c": split, each one checked like the server does.
export function parseGroups(text) {
  return text.split(/[\s,]+/).filter(Boolean);
}

export function enrollPanel() {
  const device = h("input", { id: "enroll-device", maxlength: 64, placeholder: "device id", required: true });
  const groups = h("input", { id: "enroll-groups", placeholder: "groups (comma-separated)" });
  const password = h("input", { id: "enroll-password", type: "checkbox" });
  const submit = h("button", { type: "submit", id: "enroll-submit" }, "Make a one-time token");
  const result = h("div", { id: "enroll-result", role: "status" });
  const error = h("p", { class: "error", role: "alert", id: "enroll-error" });
  const form = h("form", { class: "filters", id: "enroll-form" },
    h("label", {}, "Device ", device), h("label", {}, "Groups ", groups),
    h("label", {}, password, " a broker password instead of a certificate"), submit);

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.textContent = "";
    replace(result);
    const id = device.value.trim();
    const names = parseGroups(groups.value);
    const bad = [id, ...names].find((name) => !ID.test(name));
    if (bad !== undefined) {
      error.textContent = `${bad || "device"}: 1 to 64 letters, digits, '.', '_' or '-'`;
      return;
    }
    submit.disabled = true;
    try {
      const done = await api(`/api/devices/${pathId(id)}/enrollment`,
                             { method: "POST", json: { groups: names, password: password.checked } });
      const line = `edgepack-agent enroll --server ${location.origin} --token ${done.token} --config agent.yaml`;
      replace(result,
        h("p", {}, `One use, until ${new Date(done.expires_at * 1000).toISOString()}; shown once. On ${id}:`),
        h("pre", {}, h("code", { id: "enroll-command", "data-token": done.token }, line)));
      device.value = "";
    } catch (failure) {
      error.textContent = failure.message;
    } finally {
      submit.disabled = false;
    }
  });
  return h("details", { class: "card", id: "enroll-box", "data-needs": "device.enroll_identity" },
    h("summary", {}, "Enroll a device"), form, result, error);
}
