// Building the page without HTML strings.
//
// Device ids, model versions, providers, job reasons and audit details are written by devices
// or operators, i.e. by whoever controls them. They go into the page as text nodes (h() turns
// every string child into one) and as attribute values set with setAttribute, never through
// innerHTML, insertAdjacentHTML or document.write, so markup in them stays characters on the
// screen. h() refuses event-handler attributes and links that leave the dashboard.

const SAFE_HREF = /^(#|\/(?!\/))/;

export function h(tag, attrs = {}, ...children) {
  const element = tag.startsWith("svg:")
    ? document.createElementNS("http://www.w3.org/2000/svg", tag.slice(4))
    : document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (/^on/i.test(name) || name === "style" || name === "srcdoc") {
      throw new Error(`h(): attribute ${name} is not allowed`);
    }
    if ((name === "href" || name === "src" || name === "action") && !SAFE_HREF.test(String(value))) {
      throw new Error(`h(): ${name} must stay inside the dashboard`);
    }
    element.setAttribute(name, value === true ? "" : String(value));
  }
  append(element, children);
  return element;
}

export function append(parent, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    parent.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return parent;
}

export function clear(element) {
  element.replaceChildren();
  return element;
}

export function replace(element, ...children) {
  element.replaceChildren();
  return append(element, children);
}

// ------------------------------------------------------------------ formatting

export function ms(value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "–";
  if (value >= 1000) return `${(value / 1000).toFixed(2)} s`;
  if (value >= 100) return `${value.toFixed(0)} ms`;
  if (value >= 10) return `${value.toFixed(1)} ms`;
  return `${value.toFixed(2)} ms`;
}

export function percent(share, digits = 2) {
  if (share === null || share === undefined || !Number.isFinite(share)) return "–";
  return `${(share * 100).toFixed(digits)} %`;
}

export function number(value, digits = 0) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "–";
  return value.toLocaleString("en", { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

export function bytes(value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let amount = value;
  let unit = 0;
  while (amount >= 1024 && unit < units.length - 1) {
    amount /= 1024;
    unit += 1;
  }
  return `${amount.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}

// "2025-01-31 14:02:07" in the browser's time zone; the full ISO time goes into a title.
export function time(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  const date = new Date(seconds * 1000);
  const pad = (n) => String(n).padStart(2, "0");
  return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ` +
    `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
}

export function ago(seconds, now = Date.now() / 1000) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "never";
  const age = Math.max(0, now - seconds);
  if (age < 60) return `${Math.round(age)} s ago`;
  if (age < 3600) return `${Math.round(age / 60)} min ago`;
  if (age < 86400) return `${(age / 3600).toFixed(1)} h ago`;
  return `${(age / 86400).toFixed(1)} d ago`;
}

// A <time> showing "12 s ago", the exact time on hover.
export function when(seconds) {
  const attrs = Number.isFinite(seconds) ? { datetime: new Date(seconds * 1000).toISOString(), title: time(seconds) }
    : {};
  return h("time", attrs, ago(seconds));
}

export function badge(text, kind) {
  return h("span", { class: `badge ${kind || ""}` }, text);
}

export function table(headers, rows, { empty = "nothing yet", id } = {}) {
  const head = h("thead", {}, h("tr", {}, headers.map((text) => h("th", { scope: "col" }, text))));
  const body = h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { colspan: headers.length, class: "muted" },
                                                                    empty)));
  return h("table", { class: "grid", id }, head, body);
}
