// The tree is rendered by the server (the page reads the same without this script); this
// only fetches it again every second, from /flows/<id>/live, until every job has finished.
(function () {
  "use strict";
  const INTERVAL_MS = 1000;

  function poll() {
    const live = document.getElementById("live");
    if (!live || live.dataset.finished === "1") return;
    fetch("/flows/" + encodeURIComponent(live.dataset.job) + "/live", {cache: "no-store"})
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
