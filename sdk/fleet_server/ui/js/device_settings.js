// The device page's settings (GET /api/devices/{id}/settings): each key the server's document
// holds for the device, where it came from and what the device answered (applied, or refused
// with the reason), the generation sent and held, and the keys the device reports holding.

import { badge, h } from "./dom.js";

const DECISION_BADGES = { converged: "ok", send: "warn", wait: "off" };

function shown(value) {
  return Array.isArray(value) ? value.join(", ") : String(value);
}

export function settingsPanel(doc) {
  const reported = doc.reported || {};
  const results = reported.results || {};
  const keys = reported.keys || {};
  const rows = [
    ["Settings", badge(doc.decision.kind, DECISION_BADGES[doc.decision.kind])],
    ["Generation", `sent ${doc.sent ? doc.sent.generation : "–"}, held ${reported.generation ?? "–"}`],
    ...(doc.decision.reason ? [["Why", doc.decision.reason]] : []),
    ...Object.entries(doc.settings).map(([key, value]) =>
      [key, [h("code", {}, shown(value)), ` from ${doc.sources[key]} – `, results[key] || "not reported"]]),
    ...Object.entries(doc.conflicts).map(([key, groups]) => [`Conflict ${key}`, `groups ${groups.join(", ")} disagree`]),
    ["Release keys held", (keys.release || []).join(", ") || "–"],
    ["Operator keys held", (keys.operator || []).join(", ") || "–"],
  ];
  return h("dl", { class: "facts", id: "device-settings" },
    rows.map(([name, value]) => [h("dt", {}, name), h("dd", {}, value)]));
}
