// The audit log: every write the API accepted or refused, newest first: who, what, when.

import { api, query } from "./api.js";
import { badge, h, replace, table, time } from "./dom.js";

const PAGE = 100;
const ACTIONS = ["", "artifact.upload", "rollout.create", "rollout.pause", "rollout.resume", "rollout.abort",
                 "command.sent", "command.external"];

function detailText(detail) {
  if (!detail || typeof detail !== "object") return "";
  return Object.entries(detail).map(([key, value]) =>
    `${key}=${typeof value === "string" ? value : JSON.stringify(value)}`).join(" ");
}

function entryRow(entry) {
  return h("tr", { "data-entry": entry.id },
    h("td", {}, time(entry.ts)), h("td", {}, entry.actor), h("td", {}, entry.action), h("td", { class: "clip", title: entry.target }, entry.target),
    h("td", {}, badge(entry.outcome, entry.outcome === "ok" ? "ok" : "off")),
    h("td", { class: "detail" }, detailText(entry.detail)), h("td", {}, entry.remote));
}

export function mount(root, route) {
  const before = Number.parseInt(route.params.get("before") || "", 10);
  const chosen = ACTIONS.includes(route.params.get("action") || "") ? route.params.get("action") || "" : "";
  const action = h("select", { id: "audit-action" }, ACTIONS.map((name) =>
    h("option", { value: name, selected: name === chosen }, name || "every action")));
  action.addEventListener("change", () => {
    location.hash = `#/audit${query({ action: action.value })}`;
  });
  const list = h("div", { class: "table-wrap" });
  const pager = h("p", { class: "pager" });
  replace(root, h("h1", {}, "Audit log"), h("form", { class: "filters" }, h("label", {}, "Action ", action)),
          list, pager);

  async function refresh() {
    const doc = await api(`/api/audit${query({ limit: PAGE, action: chosen,
                                               before: Number.isFinite(before) && before > 0 ? before : "" })}`);
    replace(list, table(["When", "Who", "What", "Target", "Outcome", "Detail", "From"], doc.entries.map(entryRow),
                        { id: "audit", empty: "no write recorded yet" }));
    const oldest = doc.entries.length ? doc.entries[doc.entries.length - 1].id : null;
    replace(pager,
      Number.isFinite(before) ? h("a", { href: `#/audit${query({ action: chosen })}` }, "Newest") : null, " ",
      doc.entries.length === PAGE && oldest !== null
        ? h("a", { href: `#/audit${query({ action: chosen, before: oldest })}`, id: "audit-older" }, "Older") : null);
  }
  return { title: "Audit log", refresh };
}
