"""The `/dashboard` page: plain HTML + JS in one string, no external asset, no build step.

Kept in a module (not a .html file) so it ships in the wheel without package-data rules. It reads
`DATA_PATH` (an absolute path: a relative `turns.json` resolved against `/dashboard` is
`/turns.json`, a 404) and renders the server line, the latency summary, four charts, the recent
sessions and one table row per turn. Every number is rounded and carries its unit; any string
from a client (session ids) is escaped before it reaches the DOM.
"""

from __future__ import annotations

DATA_PATH = "/dashboard/turns.json"

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>AgentFold dashboard</title>
<style>
body{font:14px system-ui,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:18px;margin:0 0 4px}h2{font-size:14px;margin:0 0 8px}
.grid{display:grid;grid-template-columns:repeat(2,minmax(320px,1fr));gap:16px;margin:16px 0}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:12px;margin:16px 0}
.grid .card{margin:0}svg{width:100%;height:170px}
table{border-collapse:collapse}td,th{padding:2px 10px 2px 0;text-align:left;white-space:nowrap}
td.n,th.n{text-align:right}#status{color:#a33}.muted{color:#777}
</style></head><body>
<h1>AgentFold</h1>
<div id="server" class="muted">loading&hellip;</div>
<div id="status"></div>
<div id="summary" class="card"></div>
<div class="grid">
<div class="card"><h2>Time to first token (ms)</h2><svg id="chart-ttft"></svg></div>
<div class="card"><h2>Decode speed (tok/s)</h2><svg id="chart-tps"></svg></div>
<div class="card"><h2>Tokens per verify pass</h2><svg id="chart-tpp"></svg></div>
<div class="card"><h2>Draft acceptance (%)</h2><svg id="chart-acc"></svg></div>
</div>
<div id="sessions" class="card"></div>
<div class="card"><h2>Turns (newest first)</h2><table id="turns"></table></div>
<script>
const DATA_PATH = "__DATA_PATH__";
const esc = s => String(s ?? '').replace(/[&<>"']/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;',"'":'&#39;'}[c]));
function num(v, digits, unit){
  if(v === null || v === undefined || Number.isNaN(v)) return '&ndash;';
  const text = Number(v).toLocaleString('en-US', {minimumFractionDigits: digits, maximumFractionDigits: digits});
  return unit ? text + '&nbsp;' + unit : text;
}
const pct = v => (v === null || v === undefined) ? '&ndash;' : num(100 * v, 0, '%');
const when = s => new Date(s * 1000).toLocaleTimeString();
function plot(id, values, digits, unit){
  const svg = document.getElementById(id), w = 600, h = 170, left = 70, pad = 16;
  svg.setAttribute('viewBox', `0 0 ${w} ${h}`);
  if(!values.length){ svg.innerHTML = '<text x="10" y="20">no turns yet</text>'; return; }
  const max = Math.max(...values) || 1, step = (w - left - pad) / Math.max(values.length - 1, 1);
  const xy = values.map((v, i) => [left + i * step, h - pad - (v / max) * (h - 2 * pad)]);
  svg.innerHTML = `<polyline fill="none" stroke="#2a6fdb" stroke-width="2" points="${xy.map(p => p.join(',')).join(' ')}"/>` +
    xy.map(([x, y]) => `<circle cx="${x}" cy="${y}" r="2.5" fill="#2a6fdb"/>`).join('') +
    `<line x1="${left}" y1="${pad}" x2="${left}" y2="${h - pad}" stroke="#bbb"/>` +
    `<text x="2" y="${pad + 4}" font-size="12">${num(max, digits, unit)}</text>` +
    `<text x="2" y="${h - pad}" font-size="12">0 ${unit}</text>`;
}
function renderServer(s){
  const d = s.drafting;
  const drafting = d.enabled ? `drafting: ${esc(d.method)} (passes up to ${d.max_width} rows)` : `drafting: off (${esc(d.method)})`;
  document.getElementById('server').innerHTML =
    `model <b id="model">${esc(s.model)}</b> &middot; <span id="exactness">${esc(s.exactness)}</span> &middot; ` +
    `<span id="drafting">${drafting}</span> &middot; ${s.active} decoding, ${s.waiting} waiting ` +
    `&middot; context ${num(s.context_length, 0, 'tokens')}`;
}
function renderSummary(m){
  const rows = [['Turns', num(m.turns, 0)], ['Errors', num(m.errors, 0)],
    ['TTFT p50 / p90 / p99', `${num(m.ttft_p50, 0, 'ms')} / ${num(m.ttft_p90, 0, 'ms')} / ${num(m.ttft_p99, 0, 'ms')}`],
    ['Inter-token p50 / p90 / p99', `${num(m.itl_p50, 1, 'ms')} / ${num(m.itl_p90, 1, 'ms')} / ${num(m.itl_p99, 1, 'ms')}`],
    ['Decode speed (mean)', num(m.decode_tps, 1, 'tok/s')], ['Tokens per pass', num(m.tokens_per_pass, 2)],
    ['Draft acceptance', pct(m.acceptance_rate)], ['Prompt tokens from cache', pct(m.cache_hit_share)],
    ['Audits passed / failed', `${num(m.audits_passed, 0)} / ${num(m.audits_failed, 0)}`]];
  document.getElementById('summary').innerHTML = '<h2>Summary (last turns)</h2><table>' +
    rows.map(([k, v]) => `<tr><td>${k}</td><td class="n">${v}</td></tr>`).join('') + '</table>';
}
function renderSessions(s){
  const head = '<tr><th>session</th><th class="n">turns</th><th>last turn</th><th class="n">prompt</th><th class="n">from cache</th></tr>';
  const rows = s.recent.map(r => `<tr class="session"><td>${esc(r.session_id)}</td><td class="n">${num(r.turns, 0)}</td>` +
    `<td>${when(r.last_turn_at)}</td><td class="n">${num(r.prompt_tokens, 0, 'tok')}</td><td class="n">${pct(r.cache_share)}</td></tr>`);
  document.getElementById('sessions').innerHTML = `<h2>Sessions: <span id="session-count">${s.count}</span></h2>` +
    (rows.length ? '<table>' + head + rows.join('') + '</table>' : '<span class="muted">none yet</span>');
}
function renderTurns(turns){
  const head = '<tr><th>time</th><th>api</th><th>session</th><th class="n">prompt</th><th class="n">cached</th>' +
    '<th class="n">reply</th><th class="n">TTFT</th><th class="n">decode</th><th class="n">drafted / accepted</th><th>finish</th><th>audit</th></tr>';
  const rows = turns.slice().reverse().map(t => `<tr class="turn" data-turn-id="${esc(t.turn_id)}">` +
    `<td>${when(t.started_at)}</td><td>${esc(t.api)}</td><td>${esc(t.session_id ?? '-')}</td>` +
    `<td class="n">${num(t.prompt_tokens, 0, 'tok')}</td><td class="n">${num(t.cached_tokens, 0, 'tok')}</td>` +
    `<td class="n">${num(t.completion_tokens, 0, 'tok')}</td><td class="n">${num(t.ttft_ms, 0, 'ms')}</td>` +
    `<td class="n">${num(t.decode_tps, 1, 'tok/s')}</td><td class="n">${num(t.drafted, 0)} / ${num(t.accepted, 0)}</td>` +
    `<td>${esc(t.finish_reason)}</td><td>${esc(t.audit)}</td></tr>`);
  document.getElementById('turns').innerHTML = head + rows.join('');
}
async function refresh(){
  const status = document.getElementById('status');
  try {
    const response = await fetch(DATA_PATH, {cache: 'no-store'});
    if(!response.ok){ throw new Error(`HTTP ${response.status}`); }
    const data = await response.json();
    renderServer(data.server); renderSummary(data.summary); renderSessions(data.sessions); renderTurns(data.turns);
    plot('chart-ttft', data.turns.map(t => t.ttft_ms || 0), 0, 'ms');
    plot('chart-tps', data.turns.map(t => t.decode_tps || 0), 1, 'tok/s');
    plot('chart-tpp', data.turns.map(t => t.tokens_per_pass || 0), 2, '');
    plot('chart-acc', data.turns.map(t => 100 * (t.acceptance_rate || 0)), 0, '%');
    status.textContent = '';
    document.body.dataset.loaded = 'yes';
  } catch(error) {
    status.textContent = `could not load ${DATA_PATH}: ${error}`;
    console.error(`dashboard: could not load ${DATA_PATH}: ${error}`);  // a failure shows in the console too
  }
}
refresh(); setInterval(refresh, 5000);
</script></body></html>
""".replace("__DATA_PATH__", DATA_PATH)
