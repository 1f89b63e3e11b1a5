// The tree is rendered by the server (the page reads the same without this script); this
// only fetches it again every second, from /flows/<id>/live (the counts and the page in
// view), until the flow has finished.
(function () {
  "use strict";
  const INTERVAL_MS = 1000;

  function poll() {
    const live = document.getElementById("live");
    if (!live || live.dataset.finished === "1") return;
    // The page in view: its filter and cursor (the counts and that page, never the tree).
    const query = live.dataset.query ? "?" + live.dataset.query : "";
    fetch("/flows/" + encodeURIComponent(live.dataset.job) + "/live" + query, {cache: "no-store"})
      .then(function (response) { return response.text(); })
      .then(function (html) {
        const next = new DOMParser().parseFromString(html, "text/html").getElementById("live");
        if (next) live.replaceWith(next);
        setTimeout(poll, INTERVAL_MS);
      })
      .catch(function () { setTimeout(poll, INTERVAL_MS * 3); });
  }
  setTimeout(poll, INTERVAL_MS);
})();
