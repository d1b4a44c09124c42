"""`/dashboard`: one self-contained page (no external assets) plotting the recent turns.

The page fetches `/dashboard/turns.json` (the telemetry rows, oldest first) and draws four small
SVG line charts: time to first token, decode tok/s, tokens per pass and acceptance per turn,
plus the latency summary. It refreshes every five seconds.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route

FIELDS = ("turn_id", "session_id", "api", "started_at", "ttft_ms", "decode_tps", "tokens_per_pass",
          "acceptance_rate", "completion_tokens", "cached_tokens", "prompt_tokens", "draft_method", "audit")

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>AgentFold dashboard</title>
<style>
body{font:14px system-ui,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:18px}.grid{display:grid;grid-template-columns:repeat(2,minmax(320px,1fr));gap:16px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:12px}
.card h2{font-size:14px;margin:0 0 8px}svg{width:100%;height:160px}
table{border-collapse:collapse}td{padding:2px 10px 2px 0}
</style></head><body>
<h1>AgentFold &mdash; recent turns</h1>
<div id="summary" class="card"></div><br>
<div class="grid">
<div class="card"><h2>Time to first token (ms)</h2><svg id="ttft_ms"></svg></div>
<div class="card"><h2>Decode tok/s</h2><svg id="decode_tps"></svg></div>
<div class="card"><h2>Tokens per verify pass</h2><svg id="tokens_per_pass"></svg></div>
<div class="card"><h2>Draft acceptance</h2><svg id="acceptance_rate"></svg></div>
</div>
<script>
function plot(id, values){
  const svg=document.getElementById(id), w=600, h=160, pad=30;
  svg.setAttribute('viewBox', `0 0 ${w} ${h}`);
  if(!values.length){svg.innerHTML='<text x="10" y="20">no turns yet</text>';return;}
  const max=Math.max(...values)||1, step=(w-2*pad)/Math.max(values.length-1,1);
  const pts=values.map((v,i)=>`${pad+i*step},${h-pad-(v/max)*(h-2*pad)}`).join(' ');
  svg.innerHTML=`<polyline fill="none" stroke="#2a6fdb" stroke-width="2" points="${pts}"/>`+
    values.map((v,i)=>`<circle cx="${pad+i*step}" cy="${h-pad-(v/max)*(h-2*pad)}" r="2.5" fill="#2a6fdb"/>`).join('')+
    `<text x="2" y="${pad}" font-size="11">${max.toFixed(2)}</text><text x="2" y="${h-pad}" font-size="11">0</text>`;
}
async function refresh(){
  const data=await (await fetch('turns.json')).json();
  for(const key of ['ttft_ms','decode_tps','tokens_per_pass','acceptance_rate'])
    plot(key, data.turns.map(t=>t[key]||0));
  const s=data.summary, rows=Object.entries(s).map(([k,v])=>`<tr><td>${k}</td><td>${v===null?'-':v}</td></tr>`);
  document.getElementById('summary').innerHTML='<table>'+rows.join('')+'</table>';
}
refresh(); setInterval(refresh, 5000);
</script></body></html>
"""


def dashboard_routes(telemetry: Any, limit: int = 200) -> list[Route]:
    """The page and its data, for `create_app(extra_routes=...)`."""

    async def page(request: Request) -> HTMLResponse:
        return HTMLResponse(PAGE)

    async def turns(request: Request) -> JSONResponse:
        rows = list(reversed(telemetry.list_turns(limit=limit)))
        return JSONResponse({"turns": [{k: row.get(k) for k in FIELDS} for row in rows],
                             "summary": telemetry.latency_summary(last_n=limit)})

    return [Route("/dashboard", page, methods=["GET"]), Route("/dashboard/turns.json", turns, methods=["GET"])]
