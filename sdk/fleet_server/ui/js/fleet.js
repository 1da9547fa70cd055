// The fleet page: every device (online or not, model and version, provider, latency, error
// rate, last seen), the counts by version and provider, filters by group, state and version.

import { api, pathId, query } from "./api.js";
import { badge, h, ms, number, percent, replace, table, when } from "./dom.js";
import { enrollPanel } from "./enroll.js";

const PAGE = 500;
const knownGroups = new Set();
const knownVersions = new Set();

function filtersOf(params) {
  const offset = Number.parseInt(params.get("offset") || "0", 10);
  return {
    group: params.get("group") || "",
    online: ["true", "false"].includes(params.get("online")) ? params.get("online") : "",
    version: params.get("version") || "",
    offset: Number.isFinite(offset) && offset > 0 ? offset : 0,
  };
}

function go(filters) {
  location.hash = `#/fleet${query(filters)}`;
}

function options(select, values, chosen, allLabel) {
  const list = [...new Set([...values, chosen].filter(Boolean))].sort();
  replace(select, h("option", { value: "" }, allLabel),
          list.map((value) => h("option", { value, selected: value === chosen }, value)));
}

function countBars(title, counts, id) {
  const entries = Object.entries(counts).sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
  const total = entries.reduce((sum, [, n]) => sum + n, 0) || 1;
  return h("section", { class: "card", id },
    h("h2", {}, title),
    h("ul", { class: "bars" }, entries.map(([name, n]) => {
      const bar = h("span", { class: "bar" });
      bar.style.width = `${((100 * n) / total).toFixed(1)}%`; // CSSOM: allowed by the CSP, unlike style=""
      return h("li", {}, h("span", { class: "bar-label" }, name), h("span", { class: "bar-track" }, bar),
               h("span", { class: "bar-count" }, number(n)));
    })));
}

// A cell for text a device wrote: clipped by the style sheet, whole in the tooltip.
function clipped(text) {
  return h("td", { class: "clip", title: text || undefined }, text || "–");
}

function deviceRow(device) {
  const link = h("a", { href: `#/devices/${pathId(device.id)}` }, device.id);
  const state = device.online ? badge("online", "ok") : badge(device.status === "online" ? "silent" : "offline",
                                                                "off");
  return h("tr", { "data-device": device.id },
    h("td", {}, link, updateBadge(device.update_status)), h("td", {}, state),
    clipped(device.model ? device.model.name : null), clipped(device.version), clipped(device.provider),
    h("td", { class: "num" }, ms(device.latency_ms.p50)), h("td", { class: "num" }, ms(device.latency_ms.p99)),
    h("td", { class: "num" }, percent(device.error_rate)),
    h("td", {}, when(device.last_seen)), groupsCell(device));
}

// The newest deploy job the device reported: still running, or ended failed (rejected, rolled back).
function updateBadge(status) {
  if (status === "updating") return [" ", h("span", { class: "badge warn update", "data-update": status }, "updating")];
  if (status === "failed") {
    return [" ", h("span", { class: "badge off update", "data-update": status }, "last update failed")];
  }
  return null;
}

// The groups the server enrolled; those the device claims beyond them are shown apart (ignored
// by rollouts until an operator enrolls them with PUT /api/devices/{id}/groups).
function groupsCell(device) {
  const claimed = device.unenrolled_groups || [];
  return h("td", { class: "groups" }, device.groups.join(", ") || "–",
    claimed.length ? [" ", h("span", { class: "badge warn unenrolled",
                                       title: "claimed by the device, not enrolled by the server: ignored" },
                             `claims ${claimed.join(", ")}`)] : null);
}

export function mount(root, route) {
  const filters = filtersOf(route.params);
  const group = h("select", { id: "filter-group", name: "group" });
  const online = h("select", { id: "filter-online", name: "online" },
    h("option", { value: "" }, "online and offline"),
    h("option", { value: "true", selected: filters.online === "true" }, "online"),
    h("option", { value: "false", selected: filters.online === "false" }, "offline"));
  const version = h("select", { id: "filter-version", name: "version" });
  options(group, knownGroups, filters.group, "all groups");
  options(version, knownVersions, filters.version, "all versions");
  for (const select of [group, online, version]) {
    select.addEventListener("change", () => go({ group: group.value, online: online.value, version: version.value }));
  }
  const summary = h("div", { class: "cards" });
  const counts = h("div", { class: "cards" });
  const list = h("div", { class: "table-wrap" });
  const pager = h("p", { class: "pager" });
  replace(root,
    h("h1", {}, "Fleet"),
    h("form", { class: "filters", id: "fleet-filters" },
      h("label", {}, "Group ", group), h("label", {}, "State ", online), h("label", {}, "Version ", version)),
    summary, counts, enrollPanel(), list, pager);

  async function refresh() {
    const doc = await api(`/api/devices${query({ group: filters.group, online: filters.online,
                                                 version: filters.version, limit: PAGE,
                                                 offset: filters.offset || "" })}`);
    for (const device of doc.devices) {
      device.groups.forEach((g) => knownGroups.add(g));
      if (device.version) knownVersions.add(device.version);
    }
    Object.keys(doc.counts.by_version).forEach((v) => v !== "none" && knownVersions.add(v));
    if (document.activeElement !== group) options(group, knownGroups, filters.group, "all groups");
    if (document.activeElement !== version) options(version, knownVersions, filters.version, "all versions");
    replace(summary,
      h("section", { class: "card stat" }, h("h2", {}, "Devices"), h("p", { id: "count-total" }, number(doc.total))),
      h("section", { class: "card stat" }, h("h2", {}, "Online"),
        h("p", { id: "count-online", class: "ok-text" }, number(doc.counts.online))),
      h("section", { class: "card stat" }, h("h2", {}, "Offline"),
        h("p", { id: "count-offline", class: doc.counts.offline ? "off-text" : "" }, number(doc.counts.offline))));
    replace(counts, countBars("By version", doc.counts.by_version, "by-version"),
            countBars("By provider", doc.counts.by_provider, "by-provider"));
    replace(list, table(["Device", "State", "Model", "Version", "Provider", "p50", "p99", "Errors", "Last seen",
                         "Groups"], doc.devices.map(deviceRow), { id: "devices", empty: "no device matches" }));
    const first = doc.total ? doc.offset + 1 : 0;
    const last = doc.offset + doc.devices.length;
    replace(pager, `${number(first)}–${number(last)} of ${number(doc.total)}`,
      doc.offset > 0 ? h("button", { type: "button", id: "page-prev" }, "Previous") : null,
      last < doc.total ? h("button", { type: "button", id: "page-next" }, "Next") : null);
    const prev = pager.querySelector("#page-prev");
    const next = pager.querySelector("#page-next");
    if (prev) prev.addEventListener("click", () => go({ ...filters, offset: Math.max(0, doc.offset - PAGE) }));
    if (next) next.addEventListener("click", () => go({ ...filters, offset: doc.offset + PAGE }));
  }

  return { title: "Fleet", refresh };
}
