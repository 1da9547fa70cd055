// Who is signed in and what the role may do (GET /api/whoami), and the page's controls for the
// actions the role may not do hidden: an element marked data-needs="rollout.create" is shown only
// to a role the server's table (sdk/fleet_server/roles.py) allows that action. The server refuses
// those actions all the same (403); this only spares a viewer buttons that cannot work.

import { api } from "./api.js";

let me = null; // { name, role, source, actions }

export async function loadIdentity() {
  me = await api("/api/whoami");
  return me;
}

export function forgetIdentity() {
  me = null;
}

// The shell loads the identity before it draws a page; should whoami fail, everything is shown
// (the server still decides).
export function can(action) {
  return !me || !Array.isArray(me.actions) || me.actions.includes(action);
}

export function applyRole(root) {
  for (const element of root.querySelectorAll("[data-needs]")) {
    element.hidden = !can(element.dataset.needs);
  }
}

// Keep applying it to whatever the pages draw into `root` (they redraw on each refresh).
export function watchRole(root) {
  new MutationObserver(() => applyRole(root)).observe(root, { childList: true, subtree: true });
}
