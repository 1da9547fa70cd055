// The device page's pipelines (GET /api/devices/{id}: pipelines): each pipeline's figures in the
// device's newest telemetry (docs/fleet-server.md, "Pipelines"). Names and reasons come from the
// device: they go in as text (h()), never as markup.

import { badge, h, number, table } from "./dom.js";

const STATE_BADGES = { running: "ok", finished: "", refused: "off" };
const SOURCE_BADGES = { up: "ok", starting: "warn", down: "off" };

// A source down shows why; a refused pipeline (no source) shows why it was refused.
function sourceCell(pipeline) {
  const source = pipeline.source;
  if (!source) return pipeline.state === "refused" ? "–" : "pushed from Python";
  const state = badge(source.state || "unknown", SOURCE_BADGES[source.state]);
  const counts = ` ${number(source.reconnects)} reconnects, ${number(source.failures)} failures`;
  return source.state === "down" && source.reason
    ? [state, counts, h("div", { class: "source-reason" }, source.reason)] : [state, counts];
}

function eventsText(events) {
  const rules = Object.entries(events || {}).map(([rule, kinds]) =>
    `${rule}: ${Object.entries(kinds).map(([kind, count]) => `${kind} ${number(count)}`).join(", ") || "none"}`);
  return rules.join("; ") || "–";
}

// Each stage's p50 / p95 (its work on a frame), then the frames' whole way; an older agent sends none.
function latencyLine(key, label, figures) {
  return h("div", { class: "stage-latency", "data-stage": key },
    `${label} ${number(figures.p50_ms, 1)} / ${number(figures.p95_ms, 1)} ms`);
}

function latencyCell(pipeline) {
  const lines = (pipeline.stages || []).map((stage) => latencyLine(stage.name, stage.name, stage));
  if (pipeline.end_to_end) lines.push(latencyLine("end_to_end", "end to end", pipeline.end_to_end));
  return lines.length ? lines : "–";
}

function pipelineRow(pipeline) {
  const source = pipeline.source || {};
  return h("tr", { "data-pipeline": pipeline.name, "data-source": source.state || undefined },
    h("td", { class: "name" }, pipeline.name),
    h("td", { class: "state" }, badge(pipeline.state || "unknown", STATE_BADGES[pipeline.state]),
      pipeline.reason ? h("div", { class: "pipeline-reason" }, pipeline.reason) : null),
    h("td", { class: "source detail" }, sourceCell(pipeline)),
    h("td", { class: "frames-in" }, number(source.frames)), h("td", { class: "frames" }, number(pipeline.frames)),
    h("td", { class: "dropped" }, number(pipeline.dropped)), h("td", { class: "fps" }, number(pipeline.fps, 1)),
    h("td", { class: "stage-errors" }, number(pipeline.stage_errors)),
    h("td", { class: "events detail" }, eventsText(pipeline.events)),
    h("td", { class: "latency" }, latencyCell(pipeline)));
}

export function pipelinesPanel(pipelines) {
  return table(["Pipeline", "State", "Source", "Frames in", "Answered", "Dropped", "FPS", "Stage errors", "Events",
    "Latency p50 / p95"],
    pipelines.map(pipelineRow), { id: "device-pipelines", empty: "no pipeline reported" });
}
