// The device page's logs: what the device sent in answer to fetch-logs commands
// (GET /api/devices/{id}/logs), with a live tail while the page is open: every few seconds the
// page asks the device for the records since the newest one shown (POST .../logs/fetch, an
// operator's action; the device limits how often it answers) and reads what arrived. The tail
// stops when the page closes (destroy). Records are text nodes: markup a device logged stays text.

import { api, pathId, query } from "./api.js";
import { h, replace } from "./dom.js";
import { can } from "./role.js";

export const TAIL_MS = 5000;
export const MAX_SHOWN = 2000;

export function logLine(record) {
  const when = new Date(record.ts * 1000).toISOString().replace("T", " ").replace("Z", "");
  return h("div", { class: `log-line log-${record.level}`, "data-seq": record.seq },
    `${when} ${record.level.toUpperCase().padEnd(8)} ${record.logger}: ${record.message}`);
}

export function logsPanel(id) {
  const box = h("div", { class: "logs", id: "device-logs", role: "log", "aria-live": "polite" });
  const status = h("p", { class: "muted", id: "device-logs-status" }, "asking the device for its logs…");
  let newest = null;
  let shown = 0;
  let timer = null;
  let busy = false;

  async function read() {
    const doc = await api(`/api/devices/${pathId(id)}/logs${query({ limit: 1000, since: newest })}`);
    if (!shown && doc.records.length) replace(box);
    for (const record of doc.records) box.append(logLine(record));
    shown += doc.records.length;
    while (shown > MAX_SHOWN && box.firstChild) {
      box.firstChild.remove();
      shown -= 1;
    }
    if (doc.newest !== null) newest = doc.newest;
    if (!shown) replace(box, h("p", { class: "muted" }, "no log record received from this device yet"));
  }

  async function tick() {
    if (busy || document.visibilityState !== "visible") return;
    busy = true;
    try {
      if (!can("logs.fetch")) {
        status.textContent = "showing the records stored; asking the device for newer ones needs the operator role";
      } else {
        try {
          await api(`/api/devices/${pathId(id)}/logs/fetch`,
                    { method: "POST", json: newest === null ? { lines: 200 } : { since: newest, lines: 1000 } });
          status.textContent = "live: asking for newer records every few seconds while this page is open";
        } catch (failure) {
          status.textContent = `live tail paused: ${failure.message}`;
        }
      }
      await read();
    } catch (failure) {
      status.textContent = `logs: ${failure.message}`;
    } finally {
      busy = false;
    }
  }

  tick();
  timer = setInterval(tick, TAIL_MS);
  return {
    node: h("section", { id: "device-logs-section" }, h("h2", {}, "Logs"), status, box),
    destroy() {
      clearInterval(timer);
      timer = null;
    },
  };
}
