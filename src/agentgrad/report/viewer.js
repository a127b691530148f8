// The trajectory viewer of `agentgrad report`: reads the JSON the page embeds, renders with textContent only
// (trajectories hold model output, never trusted as markup). No library, no network.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("agentgrad-data").textContent);
  const trajs = data.trajectories;
  const pieces = data.pieces; // token id -> text piece
  const byId = new Map(trajs.map((t) => [t.id, t]));
  const groups = new Map();
  for (const t of trajs) {
    if (!groups.has(t.group)) groups.set(t.group, []);
    groups.get(t.group).push(t);
  }
  const MAX_ROWS = 500;
  let selected = null;

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  const $ = (id) => document.getElementById(id);
  const fmt = (x) => (x === null || x === undefined ? "–" : Number(x).toFixed(3).replace(/\.?0+$/, ""));

  function fillSelect(select, values) {
    for (const v of values) select.appendChild(Object.assign(el("option", null, v), { value: String(v) }));
  }
  fillSelect($("f-step"), [...new Set(trajs.map((t) => t.step))].sort((a, b) => a - b));
  fillSelect($("f-stage"), [...new Set(trajs.map((t) => t.stage))]);

  function matches(t) {
    const task = $("f-task").value.trim().toLowerCase();
    const outcome = $("f-outcome").value;
    const step = $("f-step").value;
    const stage = $("f-stage").value;
    if (task && !(t.task.toLowerCase().includes(task) || t.prompt.toLowerCase().includes(task))) return false;
    if (outcome === "success" && !t.success) return false;
    if (outcome === "failure" && t.success) return false;
    if (step && String(t.step) !== step) return false;
    if (stage && t.stage !== stage) return false;
    return true;
  }

  function renderList() {
    const body = $("traj-rows");
    body.replaceChildren();
    const shown = trajs.filter(matches);
    for (const t of shown.slice(0, MAX_ROWS)) {
      const tr = el("tr", "traj-row" + (t.success ? " ok" : " fail") + (selected && selected.id === t.id ? " selected" : ""));
      tr.dataset.id = t.id;
      for (const v of [t.step, t.stage, t.task, t.success ? "✓" : "✗", fmt(t.reward), t.stop, t.turns.length]) {
        tr.appendChild(el("td", null, v));
      }
      tr.addEventListener("click", () => select(t.id));
      body.appendChild(tr);
    }
    $("f-count").textContent = shown.length > MAX_ROWS
      ? `showing ${MAX_ROWS} of ${shown.length} matching (narrow the filters)`
      : `${shown.length} matching of ${trajs.length}`;
  }

  function turnBlock(turn, i) {
    const box = el("div", "turn turn-" + turn.kind);
    const head = el("div", "turn-head", `Turn ${i + 1}`);
    if (turn.reward !== null && turn.reward !== undefined) head.appendChild(el("span", "turn-reward", `turn reward ${fmt(turn.reward)}`));
    if (turn.env_reward) head.appendChild(el("span", "turn-reward", `env reward ${fmt(turn.env_reward)}`));
    box.appendChild(head);
    box.appendChild(el("div", "label", "policy text"));
    box.appendChild(el("pre", "turn-text", turn.text));
    if (turn.kind === "tool") {
      box.appendChild(el("div", "label", "tool call"));
      box.appendChild(el("pre", "tool-call", `${turn.tool}(${turn.args})`));
    } else if (turn.kind === "answer") {
      box.appendChild(el("div", "label", "final answer"));
      box.appendChild(el("pre", "final-answer", turn.answer));
    } else {
      box.appendChild(el("div", "label", "invalid action"));
      box.appendChild(el("pre", "invalid", turn.error));
    }
    if (turn.obs !== null && turn.obs !== undefined) {
      const status = turn.tool_error ? ` (${turn.tool_error})` : turn.tool_ok === false ? " (failed)" : "";
      box.appendChild(el("div", "label", "observation" + status));
      box.appendChild(el("pre", "observation", turn.obs));
    }
    return box;
  }

  function tokenView(t) {
    const box = el("div", "tokens");
    t.ids.forEach((id, i) => {
      const trained = t.mask[i] === "1";
      const span = el("span", "tok " + (trained ? "m1" : "m0"), pieces[id] !== undefined ? pieces[id] : `⟨${id}⟩`);
      span.title = `token ${i} · id ${id}` + (trained ? ` · logprob ${t.lp[i]}` : " · not trained (mask 0)");
      box.appendChild(span);
    });
    return box;
  }

  function renderDetail(t) {
    const d = $("detail");
    d.replaceChildren();
    d.appendChild(el("h3", null, `${t.task} · ${t.success ? "success" : "failure"} · reward ${fmt(t.reward)}`));
    const meta = el("div", "meta");
    meta.appendChild(el("div", null, `prompt: ${t.prompt}`));
    meta.appendChild(el("div", null, `answer: ${t.answer}`));
    meta.appendChild(el("div", null, `step ${t.step} · ${t.stage} · stop: ${t.stop} · outcome reward ${fmt(t.outcome)}` +
      (t.masked ? ` · reward masked (${t.reason})` : "") + ` · record ${t.id}`));
    d.appendChild(meta);
    t.turns.forEach((turn, i) => d.appendChild(turnBlock(turn, i)));
    d.appendChild(el("h4", null, "Tokens and loss mask"));
    const legend = el("div", "legend");
    legend.appendChild(el("span", "tok m1", "trained (loss mask 1)"));
    legend.appendChild(el("span", "tok m0", "context: prompt, observations (mask 0)"));
    d.appendChild(legend);
    d.appendChild(tokenView(t));
  }

  function siblingCard(t) {
    const card = el("div", "sibling" + (selected && t.id === selected.id ? " selected" : ""));
    card.appendChild(el("div", "sib-head", `record ${t.id} · reward ${fmt(t.reward)} · ${t.stop}`));
    for (const turn of t.turns) {
      const what = turn.kind === "tool" ? `${turn.tool}(${turn.args})` : turn.kind === "answer" ? `answer: ${turn.answer}` : `invalid: ${turn.error}`;
      card.appendChild(el("div", "sib-turn", what));
      if (turn.obs) card.appendChild(el("div", "sib-obs", `→ ${turn.obs}`));
    }
    card.addEventListener("click", () => select(t.id));
    return card;
  }

  function renderSiblings(t) {
    const sibs = groups.get(t.group) || [t];
    $("sib-title").textContent = `Group ${t.group}: ${sibs.length} samples of this task in this step`;
    for (const [id, keep, label] of [["sib-success", true, "Succeeded"], ["sib-failure", false, "Failed"]]) {
      const col = $(id);
      col.replaceChildren();
      const members = sibs.filter((s) => s.success === keep);
      col.appendChild(el("h4", null, `${label} (${members.length})`));
      members.forEach((s) => col.appendChild(siblingCard(s)));
    }
  }

  function select(id) {
    selected = byId.get(id);
    if (!selected) return;
    renderDetail(selected);
    renderSiblings(selected);
    for (const row of document.querySelectorAll(".traj-row")) row.classList.toggle("selected", Number(row.dataset.id) === id);
  }

  for (const id of ["f-task", "f-outcome", "f-step", "f-stage"]) $(id).addEventListener("input", renderList);
  renderList();
  if (trajs.length) {
    // Open on a group with both outcomes when there is one: the comparison a person looks for first.
    const mixed = [...groups.values()].find((g) => g.some((s) => s.success) && g.some((s) => !s.success));
    select((mixed ? mixed.find((s) => s.success) : trajs[0]).id);
  }
  document.body.dataset.viewerReady = "1";
})();
