// Draw a flow's tree from /api/flows/<id> (the JSON of `celery echomq show --json`) and
// redraw it every second until every job in it has finished.
(function () {
  "use strict";
  const tree = document.getElementById("tree");
  const jobId = tree.dataset.job;
  const INTERVAL_MS = 1000;

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function short(value) {
    let text;
    try { text = JSON.stringify(value); } catch (e) { text = String(value); }
    return text.length > 80 ? text.slice(0, 79) + "…" : text;
  }

  function jobLine(job) {
    const li = el("li", "job");
    li.id = "job-" + job.id;
    li.dataset.state = job.state;
    const link = el("a", "id", (job.flow ? "flow " : "") + job.id);
    link.href = "/flows/" + encodeURIComponent(job.id);
    li.appendChild(link);
    li.appendChild(el("span", "task", job.task || "?"));
    li.appendChild(el("span", "state " + job.state, job.state));
    li.appendChild(el("span", "attempts", "attempts=" + job.attempts));
    if (job.policy && !job.policy_is_default) li.appendChild(el("span", "policy", "policy=" + job.policy));
    if (job.flow) {
      const f = job.flow;
      li.appendChild(el("span", "counter", "credited=" + f.credited + "/" + f.total +
        " outstanding=" + (f.outstanding === null ? "expired" : f.outstanding)));
    }
    if (job.has_value) li.appendChild(el("span", "value", "value=" + short(job.value)));
    if (job.error) li.appendChild(el("span", "error", job.error));
    if (job.outcome && job.outcome !== "credited") li.appendChild(el("span", "outcome", "[" + job.outcome + "]"));
    if (job.children.length) {
      const ul = el("ul");
      job.children.forEach(function (child) { ul.appendChild(jobLine(child)); });
      li.appendChild(ul);
    }
    return li;
  }

  function allFinished(job) {
    return job.finished && job.children.every(allFinished);
  }

  function draw(root) {
    const ul = el("ul", "tree");
    ul.appendChild(jobLine(root));
    tree.replaceChildren(ul);
    const kids = root.children;
    const settled = kids.filter(function (c) { return c.finished; }).length;
    const active = kids.filter(function (c) { return c.state === "active"; }).length;
    const summary = document.getElementById("summary");
    summary.textContent = "parent " + root.state + " · " + settled + "/" + kids.length +
      " children finished" + (active ? ", " + active + " active" : "");
    summary.dataset.state = root.state;
    const pct = kids.length ? (100 * settled / kids.length) : (root.finished ? 100 : 0);
    document.getElementById("bar-fill").style.width = pct + "%";
  }

  function poll() {
    fetch("/api/flows/" + encodeURIComponent(jobId), {cache: "no-store"})
      .then(function (response) {
        return response.json().then(function (body) { return {ok: response.ok, body: body}; });
      })
      .then(function (r) {
        if (!r.ok) {
          tree.replaceChildren(el("p", "error", r.body.error || "cannot read the flow"));
          return;
        }
        draw(r.body);
        if (!allFinished(r.body)) setTimeout(poll, INTERVAL_MS);
      })
      .catch(function () { setTimeout(poll, INTERVAL_MS * 3); });
  }
  poll();
})();
