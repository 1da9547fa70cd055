// Alerts: every open alert, then the newest fired, resolved and rollout notices (GET /api/alerts).

import { api } from "./api.js";
import { badge, h, replace, table, time } from "./dom.js";

const STATE_BADGE = { open: "off", resolved: "ok", notice: "run" };

function subjectCell(alert) {
  if (alert.kind === "rollout") return h("a", { href: `#/rollouts/${encodeURIComponent(alert.subject)}` }, alert.subject);
  return h("a", { href: `#/devices/${encodeURIComponent(alert.subject)}` }, alert.subject);
}

function alertRow(alert) {
  return h("tr", { "data-alert": alert.id, "data-key": alert.key },
    h("td", {}, time(alert.opened_at)), h("td", {}, badge(alert.state, STATE_BADGE[alert.state] || "")),
    h("td", {}, alert.kind), h("td", {}, subjectCell(alert)), h("td", { class: "detail" }, alert.summary),
    h("td", {}, alert.state === "resolved" ? time(alert.resolved_at) : ""));
}

export function mount(root) {
  const open = h("div", { class: "table-wrap" });
  const recent = h("div", { class: "table-wrap" });
  replace(root, h("h1", {}, "Alerts"), h("h2", {}, "Open"), open, h("h2", {}, "Recent"), recent);
  const headers = ["Since", "State", "Kind", "Device or rollout", "What", "Resolved"];

  async function refresh() {
    const doc = await api("/api/alerts?limit=100");
    replace(open, table(headers, doc.open.map(alertRow), { id: "alerts-open", empty: "no open alert" }));
    replace(recent, table(headers, doc.recent.map(alertRow), { id: "alerts-recent", empty: "no alert yet" }));
  }
  return { title: "Alerts", refresh };
}
