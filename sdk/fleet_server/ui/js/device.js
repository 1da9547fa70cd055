// The device page: what the device reported last, its target and why it is (not) on it, and latency, throughput and errors over
// time from GET /api/devices/{id}/telemetry?since=&step=.

import { api, pathId, query } from "./api.js";
import { lineChart } from "./chart.js";
import { badge, bytes, h, ms, number, percent, replace, table, time, when } from "./dom.js";
import { actionsPanel } from "./device_actions.js";
import { reportCardsPanel } from "./device_cards.js";
import { credentialsPanel } from "./device_credentials.js";
import { logsPanel } from "./device_logs.js";
import { pipelinesPanel } from "./device_pipelines.js";
import { settingsPanel } from "./device_settings.js";
import { artifactText } from "./rollouts.js";

// Range -> bucket step: about 180 points a chart (the API allows 5,000).
export const RANGES = [
  { id: "15m", label: "15 minutes", seconds: 900, step: 5 },
  { id: "1h", label: "1 hour", seconds: 3600, step: 20 },
  { id: "6h", label: "6 hours", seconds: 6 * 3600, step: 120 },
  { id: "24h", label: "24 hours", seconds: 86400, step: 480 },
  { id: "7d", label: "7 days", seconds: 7 * 86400, step: 3600 },
];

// The error kinds charted beside the total: the most frequent over the range (a model answering
// NaN shows as non_finite_output, a crashing one as runtime); the rest stay in the total.
export const MAX_KIND_SERIES = 4;

export function errorKindSeries(points) {
  const totals = new Map();
  for (const point of points) {
    for (const [kind, count] of Object.entries(point.error_kinds || {})) {
      totals.set(kind, (totals.get(kind) || 0) + count);
    }
  }
  const kinds = [...totals.entries()].sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1))
    .slice(0, MAX_KIND_SERIES).map(([kind]) => kind);
  return kinds.map((kind) => ({
    name: kind,
    points: points.map((p) => [p.ts, !p.samples ? null
      : p.error_kinds && Object.hasOwn(p.error_kinds, kind) ? p.error_kinds[kind] : 0]),
  }));
}

function facts(device, artifact) {
  const update = { updating: badge("updating", "warn"), failed: badge("last update failed", "off"),
                   ok: badge("ok", "ok") }[device.update_status] || "–";
  const rows = [
    ["State", device.online ? badge("online", "ok") : badge(device.status || "unknown", "off")],
    ["Reason", device.status_reason || "–"],
    ["Last update", update],
    ["Model", device.model ? device.model.name || "–" : "–"],
    ["Version", device.version || "–"],
    ["Artifact (version and sha256)", artifact],
    ["Model file sha256", device.model && device.model.sha256 ? h("code", {}, device.model.sha256) : "–"],
    ["Provider", device.provider || "–"],
    ["Profile", device.profile || "–"],
    ["Groups", device.groups.join(", ") || "–"],
    ["Groups claimed, not enrolled", (device.unenrolled_groups || []).join(", ") || "–"],
    ["Last seen", when(device.last_seen)],
    ["First seen", time(device.first_seen)],
    ["Latency p50 / p90 / p99", `${ms(device.latency_ms.p50)} / ${ms(device.latency_ms.p90)} / ` +
      `${ms(device.latency_ms.p99)}`],
    ["Throughput", device.throughput_per_s === null ? "–" : `${number(device.throughput_per_s, 2)} /s`],
    ["Inferences / errors", `${number(device.inferences_total)} / ${number(device.errors_total)}`],
    ["Error rate (last interval)", percent(device.error_rate)],
    ["CPU / memory", `${device.cpu_percent === null ? "–" : `${number(device.cpu_percent, 1)} %`} / ` +
      `${bytes(device.memory_rss_bytes)}`],
    ["Temperature", device.temperature_c === null ? "–" : `${number(device.temperature_c, 1)} °C`],
  ];
  const capabilities = Object.entries(device.capabilities || {}).map(([key, value]) =>
    [`capabilities.${key}`, typeof value === "string" ? value : JSON.stringify(value)]);
  return h("dl", { class: "facts", id: "device-facts" },
    [...rows, ...capabilities].map(([name, value]) => [h("dt", {}, name), h("dd", {}, value)]));
}

const OUTCOME_BADGES = { succeeded: "ok", failed: "off", unanswered: "off", cancelled: "warn", in_progress: "warn" };

// One row per job, newest first: what it was (kind, artifact version and sha, rollout), how it
// ended and why (whole), and its states with times in the row's tooltip.
function historyRow(entry) {
  const what = entry.artifact ? artifactText(entry.artifact) : "–";
  const states = entry.states.map((s) => `${time(s.received_at)} ${s.state}${s.final ? " (final)" : ""}` +
                                         `${s.reason ? `: ${s.reason}` : ""}`).join("\n");
  return h("tr", { "data-job": entry.job, "data-outcome": entry.outcome, title: states || undefined },
    h("td", {}, time(entry.started_at)), h("td", {}, entry.kind), h("td", { class: "artifact" }, what),
    h("td", {}, entry.rollout ? h("a", { href: `#/rollouts/${pathId(entry.rollout.id)}` }, entry.rollout.id)
                              : entry.sent_by_server ? `target (${entry.target || "?"})` : "not sent by the server"),
    h("td", {}, badge(entry.outcome, OUTCOME_BADGES[entry.outcome] || "")),
    h("td", { class: "detail" }, entry.reason || "–"));
}

// The artifact the device runs as the server knows it: that of its newest deploy that succeeded.
function runningArtifact(history) {
  const done = history.entries.find((e) => e.kind === "deploy" && e.outcome === "succeeded" && e.artifact);
  return done ? h("span", { id: "device-artifact" }, artifactText(done.artifact)) : "–";
}

// The desired state (GET /api/devices/{id}/target): what the device should run, what it
// reports, the difference and why it persists.
const TARGET_BADGES = { converged: "ok", send: "warn", wait: "off" };

function target(doc) {
  const models = Object.entries(doc.effective.models);
  const rows = [
    ["Target state", badge(doc.state, TARGET_BADGES[doc.state])],
    ["Why", doc.state === "converged" ? "on target" : doc.reason || "–"],
    ...models.map(([model, wanted]) =>
      [`Target ${model}`, [h("code", {}, wanted.artifact.slice(0, 12)), ` from ${wanted.source}`]]),
    ...Object.entries(doc.difference).map(([model, what]) => [`Differs: ${model}`, what]),
    ["Held by", doc.effective.held_by.join(", ") || "–"],
    ...Object.entries(doc.reported.rejected || {}).map(([sha, rejection]) =>
      [`Rejected ${sha.slice(0, 12)}`, `${rejection.stage}: ${rejection.reason}`]),
  ];
  if (!models.length && !doc.effective.held_by.length) rows.splice(1, 1, ["Why", "no target for this device"]);
  return h("dl", { class: "facts", id: "device-target" },
    rows.map(([name, value]) => [h("dt", {}, name), h("dd", {}, value)]));
}

export function mount(root, route, shell) {
  const id = route.parts[1];
  const chosen = RANGES.find((r) => r.id === route.params.get("range")) || RANGES[0];
  const select = h("select", { id: "range" }, RANGES.map((r) =>
    h("option", { value: r.id, selected: r === chosen }, r.label)));
  select.addEventListener("change", () => {
    location.hash = `#/devices/${pathId(id)}${query({ range: select.value })}`;
  });
  const header = h("div");
  const desired = h("div");
  const settings = h("div");
  const credentials = h("div");
  const cards = h("div", { class: "table-wrap" });
  const pipelines = h("div", { class: "table-wrap" });
  const charts = h("div", { class: "charts", id: "charts" });
  const updates = h("div", { class: "table-wrap" });
  const logs = logsPanel(id);
  replace(root,
    h("p", { class: "crumbs" }, h("a", { href: "#/fleet" }, "Fleet"), " / ", id),
    h("h1", { id: "device-id" }, id), actionsPanel(id, shell), header, h("h2", {}, "Report cards"), cards,
    h("h2", {}, "Pipelines"), pipelines,
    h("h2", {}, "Target"), desired,
    h("h2", {}, "Settings"), settings,
    h("h2", {}, "Credentials"), credentials,
    h("h2", {}, "Update history"), updates, logs.node,
    h("div", { class: "row" }, h("h2", {}, "Over time"), h("label", {}, "Range ", select)),
    charts);

  async function refresh() {
    const now = Math.floor(Date.now() / 1000);
    const since = now - chosen.seconds;
    const [device, wanted, series, history, held, issued] = await Promise.all([
      api(`/api/devices/${pathId(id)}`),
      api(`/api/devices/${pathId(id)}/target`),
      api(`/api/devices/${pathId(id)}/telemetry${query({ since, until: now + 1, step: chosen.step })}`),
      api(`/api/devices/${pathId(id)}/history${query({ limit: 50 })}`),
      api(`/api/devices/${pathId(id)}/settings`),
      api(`/api/devices/${pathId(id)}/credentials`),
    ]);
    replace(settings, settingsPanel(held));
    replace(credentials, credentialsPanel(issued, Date.now() / 1000));
    replace(header, facts(device, runningArtifact(history)));
    replace(cards, reportCardsPanel(device.report_cards || []));
    replace(pipelines, pipelinesPanel(device.pipelines || []));
    replace(desired, target(wanted));
    replace(updates, table(["Started", "Kind", "Artifact", "Rollout", "Outcome", "Reason"],
                           history.entries.map(historyRow), { id: "device-history", empty: "no update recorded" }));
    const pick = (key) => series.points.map((p) => [p.ts, p[key]]);
    // The x axis starts where the device's history does (a device first seen a minute ago gets a
    // minute-wide chart, not a line squeezed against the right edge of a 15-minute one).
    const first = Number.isFinite(device.first_seen) ? Math.floor(device.first_seen / series.step) * series.step : 0;
    const frame = { since: Math.max(series.since, first), until: series.until, step: series.step };
    replace(charts,
      lineChart({ ...frame, title: "Latency (ms)", format: (v) => ms(v),
                  series: [{ name: "p50", points: pick("latency_p50_ms") },
                           { name: "p99", points: pick("latency_p99_ms") }] }),
      lineChart({ ...frame, title: "Throughput (inferences/s)", format: (v) => number(v, 1),
                  series: [{ name: "throughput", points: pick("throughput_per_s") }] }),
      lineChart({ ...frame, title: `Errors (per ${series.step} s)`, format: (v) => number(v, 1),
                  series: [{ name: "errors", points: pick("errors") }, ...errorKindSeries(series.points)] }),
      h("p", { class: "muted", id: "telemetry-meta" },
        `${series.points.length} points of ${series.step} s since ${time(frame.since)}`));
  }

  return { title: id, refresh, destroy: logs.destroy };
}
