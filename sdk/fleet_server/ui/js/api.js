// The REST API as the dashboard sees it: the bearer token and one fetch wrapper.
//
// Why sessionStorage and the Authorization header, not a cookie: the API authenticates by
// `Authorization: Bearer` only, a header no other site can make this browser send, so there
// is no ambient credential for a cross-site request (CSRF) to ride on and the server needs no
// CSRF tokens or cookie handling. sessionStorage is per tab and cleared when the tab closes.
// Its weakness is script running in this origin (XSS), which the page shuts out twice: the
// Content-Security-Policy allows only this server's own script files (no inline script, no
// eval, nothing from elsewhere), and every value that came from a device is put into the page
// as text (dom.js), never as HTML.

const TOKEN_KEY = "edgepack.fleet.token";
const TOKEN_PATTERN = /^[A-Za-z0-9._~+/=-]{16,512}$/;

export class ApiFailure extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

let onUnauthorized = () => {};

export function setUnauthorizedHandler(handler) {
  onUnauthorized = handler;
}

export function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function validToken(text) {
  return TOKEN_PATTERN.test(text);
}

export function storeToken(text) {
  sessionStorage.setItem(TOKEN_KEY, text);
}

export function forgetToken() {
  sessionStorage.removeItem(TOKEN_KEY);
}

// `path` is built by the callers from constants and encodeURIComponent'd values only.
export async function api(path, { method = "GET", json, body, headers = {}, signal } = {}) {
  const sent = { Accept: "application/json", ...headers };
  const current = token();
  if (current) sent.Authorization = `Bearer ${current}`;
  let payload = body;
  if (json !== undefined) {
    payload = JSON.stringify(json);
    sent["Content-Type"] = "application/json";
  }
  let response;
  try {
    response = await fetch(path, { method, headers: sent, body: payload, signal, credentials: "omit",
                                   cache: "no-store", redirect: "error" });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiFailure(0, "network", `the server did not answer (${err.message})`);
  }
  let doc = null;
  if ((response.headers.get("content-type") || "").includes("json")) {
    try {
      doc = await response.json();
    } catch {
      doc = null;
    }
  }
  if (!response.ok) {
    const error = doc && typeof doc.error === "object" && doc.error ? doc.error : {};
    const failure = new ApiFailure(response.status, String(error.code || "error"),
                                   String(error.message || `HTTP ${response.status}`));
    if (response.status === 401) onUnauthorized(failure);
    throw failure;
  }
  return doc;
}

// A query string from an object, skipping empty values.
export function query(params) {
  const search = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    if (value !== undefined && value !== null && value !== "") search.set(key, String(value));
  }
  const text = search.toString();
  return text ? `?${text}` : "";
}

export function pathId(id) {
  return encodeURIComponent(id);
}
