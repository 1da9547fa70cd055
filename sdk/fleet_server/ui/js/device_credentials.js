// The device page's credentials (GET /api/devices/{id}/credentials): the newest certificate the
// fleet CA issued the device (serial, validity in UTC, how long it has left) and whether it holds
// a broker password, so an operator rotating certificates sees which devices lag. The warning
// starts at the certificate's renewal_from, the moment the server itself starts rotating it (the
// server's rule, sent in the document: docs/enrollment.md, "Rotation"), not a threshold of our own.
// Serials come from the server's database: they go in as text (h()), never as markup.

import { badge, h } from "./dom.js";

// valid | renewal (due for rotation: warn) | expired | revoked, at unix time `now`. Pure; the
// boundaries are the server's renewal_due: renewal from renewal_from inclusive, expired from
// not_after inclusive.
export function certificateState(cert, now) {
  if (cert.revoked_at !== null && cert.revoked_at !== undefined) return "revoked";
  if (now >= cert.not_after) return "expired";
  if (Number.isFinite(cert.renewal_from) && now >= cert.renewal_from) return "renewal";
  return "valid";
}

// A duration as `edgepack device show` writes it: 59s, 59m, 23h 59m, 29d 3h (never negative).
export function span(seconds) {
  const whole = Math.max(0, Math.floor(seconds));
  if (whole < 60) return `${whole}s`;
  if (whole < 3600) return `${Math.floor(whole / 60)}m`;
  if (whole < 86400) return `${Math.floor(whole / 3600)}h ${Math.floor((whole % 3600) / 60)}m`;
  return `${Math.floor(whole / 86400)}d ${Math.floor((whole % 86400) / 3600)}h`;
}

// "2026-02-27 14:02:07 UTC": certificates are read against other machines' clocks, so UTC.
export function utc(seconds) {
  if (!Number.isFinite(seconds)) return "–";
  return `${new Date(seconds * 1000).toISOString().slice(0, 19).replace("T", " ")} UTC`;
}

const STATES = {
  valid: ["valid", "ok"], renewal: ["renewal due", "warn"], expired: ["expired", "off"], revoked: ["revoked", "off"],
};

function expiry(cert, state, now) {
  if (state === "revoked") return `revoked ${span(now - cert.revoked_at)} ago`;
  if (state === "expired") return `expired ${span(now - cert.not_after)} ago`;
  return `in ${span(cert.not_after - now)}`;
}

function certificateRows(cert, now) {
  const state = certificateState(cert, now);
  const [text, kind] = STATES[state];
  return [
    ["Certificate", h("code", { class: "serial" }, cert.serial)],
    ["Certificate state", badge(text, kind)],
    ["Valid from", utc(cert.not_before)],
    ["Valid until", utc(cert.not_after)],
    ["Expires", h("span", { class: "expires" }, expiry(cert, state, now))],
    ["Rotation from", utc(cert.renewal_from)],
  ];
}

function holds(doc) {
  const what = [doc.certificates.length ? "certificate" : null, doc.password ? "password" : null].filter(Boolean);
  return what.join(" and ") || "none on record";
}

// The panel at unix time `now`; the newest certificate is the current one (the list is newest first).
export function credentialsPanel(doc, now) {
  const cert = doc.certificates[0];
  const state = cert ? certificateState(cert, now) : "none";
  const rows = [["Credentials", h("span", { class: "holds" }, holds(doc))],
                ...(cert ? certificateRows(cert, now) : [])];
  return h("dl", { class: `facts credentials-${state}`, id: "device-credentials", "data-state": state },
    rows.map(([name, value]) => [h("dt", {}, name), h("dd", {}, value)]));
}
