// A small SVG line chart for the device page (time on x, one or more series on y).
//
// Why hand-written and not a charting library: the dashboard must load nothing from the
// internet and have no build step; the charts need lines with gaps, a time axis and a hover
// readout, about 150 lines, less than vendoring and reviewing a library.

import { h, time } from "./dom.js";

const WIDTH = 460;
const HEIGHT = 200;
const PAD = { left: 62, right: 14, top: 12, bottom: 26 };

// 1, 2, 2.5, 5 x 10^k at or above `value`: round axis maxima.
export function niceCeiling(value) {
  if (!(value > 0) || !Number.isFinite(value)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const factor of [1, 2, 2.5, 5, 10]) {
    if (factor * power >= value) return factor * power;
  }
  return 10 * power;
}

// Runs of consecutive defined points; a bucket missing (gap over 1.5 steps) breaks the line.
export function segments(points, step) {
  const runs = [];
  let run = [];
  let previous = null;
  for (const [t, v] of points) {
    if (v === null || v === undefined || !Number.isFinite(v)) {
      if (run.length) runs.push(run);
      run = [];
      previous = null;
      continue;
    }
    if (previous !== null && t - previous > 1.5 * step && run.length) {
      runs.push(run);
      run = [];
    }
    run.push([t, v]);
    previous = t;
  }
  if (run.length) runs.push(run);
  return runs;
}

function clockLabel(seconds, span) {
  const text = time(seconds);
  if (span > 2 * 86400) return text.slice(5, 16);
  return span > 1800 ? text.slice(11, 16) : text.slice(11, 19);
}

export function lineChart({ title, series, since, until, step, format }) {
  const x0 = PAD.left;
  const x1 = WIDTH - PAD.right;
  const y0 = HEIGHT - PAD.bottom;
  const y1 = PAD.top;
  const values = series.flatMap((s) => s.points.map((p) => p[1]).filter((v) => v !== null && Number.isFinite(v)));
  const top = niceCeiling(Math.max(0, ...values) * 1.05);
  const span = Math.max(1, until - since);
  const sx = (t) => x0 + ((t - since) / span) * (x1 - x0);
  const sy = (v) => y0 - (v / top) * (y0 - y1);

  const svg = h("svg:svg", { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, class: "chart", role: "img",
                             "aria-label": title, "data-count": values.length });
  for (let i = 0; i <= 4; i += 1) {
    const value = (top * i) / 4;
    const y = sy(value);
    svg.append(h("svg:line", { x1: x0, x2: x1, y1: y, y2: y, class: i ? "grid" : "axis" }),
               h("svg:text", { x: x0 - 6, y: y + 4, class: "tick", "text-anchor": "end" }, format(value)));
  }
  for (let i = 0; i <= 4; i += 1) {
    const t = since + (span * i) / 4;
    svg.append(h("svg:text", { x: sx(t), y: HEIGHT - 8, class: "tick",
                               "text-anchor": i === 0 ? "start" : i === 4 ? "end" : "middle" },
                 clockLabel(t, span)));
  }
  series.forEach((s, index) => {
    for (const run of segments(s.points, step)) {
      if (run.length === 1) {
        svg.append(h("svg:circle", { cx: sx(run[0][0]), cy: sy(run[0][1]), r: 2.5, class: `dot s${index}` }));
      } else {
        const d = run.map(([t, v], i) => `${i ? "L" : "M"}${sx(t).toFixed(1)},${sy(v).toFixed(1)}`).join("");
        svg.append(h("svg:path", { d, class: `line s${index}` }));
      }
    }
  });

  const cursor = h("svg:line", { x1: 0, x2: 0, y1: y1, y2: y0, class: "cursor", visibility: "hidden" });
  const readout = h("p", { class: "readout muted" }, "\u00a0");
  const hit = h("svg:rect", { x: x0, y: y1, width: x1 - x0, height: y0 - y1, class: "hit" });
  svg.append(cursor, hit);
  const times = [...new Set(series.flatMap((s) => s.points.map((p) => p[0])))].sort((a, b) => a - b);
  hit.addEventListener("mousemove", (event) => {
    if (!times.length) return;
    const box = svg.getBoundingClientRect();
    const t = since + ((event.clientX - box.left) * (WIDTH / box.width) - x0) / (x1 - x0) * span;
    const nearest = times.reduce((best, candidate) => (Math.abs(candidate - t) < Math.abs(best - t) ? candidate : best));
    cursor.setAttribute("x1", sx(nearest));
    cursor.setAttribute("x2", sx(nearest));
    cursor.setAttribute("visibility", "visible");
    const parts = series.map((s) => {
      const found = s.points.find((p) => p[0] === nearest);
      return `${s.name} ${found && found[1] !== null ? format(found[1]) : "–"}`;
    });
    readout.textContent = `${time(nearest)}: ${parts.join(", ")}`;
  });
  hit.addEventListener("mouseleave", () => {
    cursor.setAttribute("visibility", "hidden");
    readout.textContent = "\u00a0";
  });

  const legend = h("ul", { class: "legend" }, series.map((s, index) => {
    const last = [...s.points].reverse().find((p) => p[1] !== null && Number.isFinite(p[1]));
    return h("li", {}, h("span", { class: `swatch s${index}` }), `${s.name}: ${last ? format(last[1]) : "–"}`);
  }));
  return h("figure", { class: "chart-box" }, h("figcaption", {}, title), svg, legend, readout);
}
