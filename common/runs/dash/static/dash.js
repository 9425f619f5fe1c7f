// The run page polls /api/run/<id>/panels every 2 s and swaps in what changed: the panels (server-drawn
// SVG) when the run's metrics changed since the signature it holds, and the live worker table always.
"use strict";
(function () {
  const head = document.querySelector("[data-run]");
  if (!head) return;
  const run = head.dataset.run;
  const updated = document.getElementById("updated");
  let seen = head.dataset.signature;
  const PERIOD_MS = 2000;

  function swapPanels(panels) {
    const box = document.querySelector(".panels");
    for (const p of panels) {
      const tmp = document.createElement("div");
      tmp.innerHTML = p.html;
      const fresh = tmp.firstElementChild;
      const old = document.getElementById("panel-" + p.id);
      if (old) old.replaceWith(fresh);
      else box.appendChild(fresh);
    }
  }

  async function poll() {
    try {
      const r = await fetch("/api/run/" + encodeURIComponent(run) + "/panels?seen=" + encodeURIComponent(seen),
                            {credentials: "same-origin", cache: "no-store"});
      if (!r.ok) throw new Error("HTTP " + r.status);
      const d = await r.json();
      document.getElementById("live").innerHTML = d.live;
      if (d.panels) {
        swapPanels(d.panels);
        document.getElementById("extras").innerHTML = d.extras;
        seen = d.signature;
      }
      head.dataset.signature = seen;
      updated.textContent = "updated " + new Date().toLocaleTimeString();
      updated.className = "";
    } catch (e) {
      updated.textContent = "dashboard server unreachable (" + e.message + "); retrying";
      updated.className = "stale";
    }
    setTimeout(poll, PERIOD_MS);
  }
  setTimeout(poll, PERIOD_MS);
})();
