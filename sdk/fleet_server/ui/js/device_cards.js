// The device page's report cards (GET /api/devices/{id}: report_cards): what the device measured
// of each model it serves at activation, on its own hardware (docs/agent.md, "Report cards").

import { bytes, h, ms, number, table, time } from "./dom.js";

function share(card) {
  if (card.accelerated_share === null) return "–";
  const nodes = card.nodes === null ? "" : ` (${number(card.accelerated_nodes)} of ${number(card.nodes)} nodes)`;
  return `${number(card.accelerated_share * 100, 0)} %${nodes}`;
}

function cardRow(card) {
  return h("tr", { "data-model": card.name },
    h("td", {}, card.name), h("td", {}, card.version || "–"), h("td", {}, card.provider),
    h("td", { class: "p50" }, ms(card.p50_ms)), h("td", { class: "p99" }, ms(card.p99_ms)),
    h("td", {}, `${number(card.runs)}${card.budget_hit ? " (time budget)" : ""}`),
    h("td", {}, ms(card.first_inference_ms)), h("td", {}, bytes(card.peak_rss_bytes)),
    h("td", { class: "share" }, share(card)), h("td", {}, time(card.measured_at)));
}

export function reportCardsPanel(cards) {
  return table(["Model", "Version", "Provider", "p50", "p99", "Runs", "First inference", "Peak RSS",
                "Accelerated", "Measured"], cards.map(cardRow), { id: "device-report-cards", empty: "no report card" });
}
