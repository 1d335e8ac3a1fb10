// Envex admin: refreshes the overview's live figures from /admin/live every 2 s. Nothing else; no external code.
"use strict";
(function () {
  if (!document.getElementById("live")) return;
  function duration(s) {
    s = Math.round(s);
    if (s < 60) return s + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
    return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  }
  function show(data) {
    document.querySelectorAll("[data-live]").forEach(function (el) {
      var key = el.getAttribute("data-live");
      if (key === "uptime" && typeof data.uptime_s === "number") {
        el.textContent = duration(data.uptime_s);
      } else if (key in data) {
        el.textContent = String(data[key]);
      }
    });
  }
  function poll() {
    fetch("/admin/live", { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (data) { if (data) show(data); })
      .catch(function () {});
  }
  setInterval(poll, 2000);
})();
