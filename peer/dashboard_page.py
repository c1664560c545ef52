"""The dashboard's page (peer/dashboard.py serves it at /): HTML, CSS and an inline script that
draws /api/status as plain SVG every 2 s. It loads no asset from anywhere else."""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>hivetrain</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px system-ui,sans-serif;margin:16px;background:#fafafa;color:#222}
h1{font-size:18px;margin:0 0 4px} #head{color:#555;margin-bottom:12px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:12px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 10px}
.card h2{font-size:13px;margin:0 0 6px;color:#333} svg{width:100%;height:180px}
table{border-collapse:collapse;font-size:12px;width:100%} td,th{padding:2px 6px;text-align:right}
td:first-child,th:first-child{text-align:left;font-family:monospace} .off{color:#b00}
.legend span{margin-right:10px;font-size:12px} .none{color:#999;font-size:12px}
tr.you td{background:#fff4e0;font-weight:600} .tag{color:#c05800;font-weight:600}
#you{margin-bottom:12px} #you dl{display:flex;flex-wrap:wrap;gap:4px 24px;margin:0}
#you dt{font-size:11px;color:#666} #you dd{margin:0;font-size:16px;font-weight:600}
</style></head><body>
<h1>hivetrain</h1><div id="head">loading&hellip;</div>
<div id="join" class="none" hidden>join with: <code id="join-line"></code></div>
<div class="card" id="you" hidden><h2>you: <span id="you-id"></span> (totals since this peer started)</h2><dl id="you-totals"></dl></div>
<div class="grid">
<div class="card"><h2>loss by round</h2><svg id="loss"></svg><div class="legend" id="loss-legend"></div></div>
<div class="card"><h2>tokens/s per peer</h2><svg id="speed"></svg></div>
<div class="card"><h2>peers over time</h2><svg id="peers"></svg></div>
<div class="card"><h2>MB sent per round (you)</h2><svg id="bytes"></svg></div>
<div class="card"><h2>utilization per round (you)</h2><svg id="util"></svg></div>
<div class="card"><h2>reachability</h2><svg id="reach"></svg></div>
</div>
<div class="card" style="margin-top:12px"><h2>peers</h2><table id="table"></table></div>
<script>
"use strict";
const COLORS=["#1f77b4","#d62728","#2ca02c","#ff7f0e","#9467bd","#8c564b"],YOU="#ff7f0e";
const NS="http://www.w3.org/2000/svg";
function el(tag,attrs,parent){const e=document.createElementNS(NS,tag);for(const k in attrs)e.setAttribute(k,attrs[k]);if(parent)parent.appendChild(e);return e;}
function fmt(v){return Number.isInteger(+v)||Math.abs(v)>=1000?Math.round(v).toLocaleString():(+v).toPrecision(3);}
function frame(svg){svg.innerHTML="";const w=svg.clientWidth||400,h=svg.clientHeight||180;return {w,h,l:48,r:8,t:8,b:22};}
function axes(svg,f,x0,x1,y0,y1,xl){
  el("line",{x1:f.l,y1:f.h-f.b,x2:f.w-f.r,y2:f.h-f.b,stroke:"#999"},svg);
  el("line",{x1:f.l,y1:f.t,x2:f.l,y2:f.h-f.b,stroke:"#999"},svg);
  for(const [v,y] of [[y1,f.t+8],[y0,f.h-f.b]]){const t=el("text",{x:f.l-4,y:y,"text-anchor":"end","font-size":10},svg);t.textContent=fmt(v);}
  for(const [v,x,a] of [[x0,f.l,"start"],[x1,f.w-f.r,"end"]]){const t=el("text",{x:x,y:f.h-6,"text-anchor":a,"font-size":10},svg);t.textContent=xl?xl(v):fmt(v);}
}
function empty(svg,msg){const f=frame(svg);const t=el("text",{x:f.w/2,y:f.h/2,"text-anchor":"middle",class:"none"},svg);t.textContent=msg;}
function lines(id,series,xl,range){
  const svg=document.getElementById(id);const pts=series.flatMap(s=>s.points);
  if(pts.length<1){empty(svg,"no data yet");return;}
  const f=frame(svg);let x0=Math.min(...pts.map(p=>p[0])),x1=Math.max(...pts.map(p=>p[0]));
  let y0=Math.min(...pts.map(p=>p[1])),y1=Math.max(...pts.map(p=>p[1]));
  if(range){y0=range[0];y1=range[1];}
  if(x1===x0)x1=x0+1; if(y1===y0){y1=y0+Math.abs(y0||1)*0.05;y0=y0-Math.abs(y0||1)*0.05;}
  axes(svg,f,x0,x1,y0,y1,xl);
  const X=x=>f.l+(x-x0)/(x1-x0)*(f.w-f.l-f.r),Y=y=>f.h-f.b-(y-y0)/(y1-y0)*(f.h-f.t-f.b);
  series.forEach((s,i)=>{if(!s.points.length)return;
    el("polyline",{points:s.points.map(p=>X(p[0])+","+Y(p[1])).join(" "),fill:"none",stroke:s.color||COLORS[i],"stroke-width":s.width||1.8,"stroke-opacity":s.opacity||1},svg);
    for(const p of s.points)el("circle",{cx:X(p[0]),cy:Y(p[1]),r:2.2,fill:s.color||COLORS[i]},svg);});
}
function bars(id,items){
  const svg=document.getElementById(id);if(!items.length){empty(svg,"no data yet");return;}
  const f=frame(svg);const y1=Math.max(...items.map(b=>b[1]),1e-9);axes(svg,f,0,items.length,0,y1,()=>"");
  const bw=(f.w-f.l-f.r)/items.length;
  items.forEach((b,i)=>{const h=(b[1]/y1)*(f.h-f.t-f.b);
    el("rect",{x:f.l+i*bw+bw*0.15,y:f.h-f.b-h,width:bw*0.7,height:h,fill:b[2]||COLORS[0]},svg);
    if(items.length<=12){const t=el("text",{x:f.l+i*bw+bw/2,y:f.h-f.b+11,"text-anchor":"middle","font-size":9},svg);t.textContent=b[0];}});
}
function duration(s){s=Math.round(s);const h=Math.floor(s/3600),m=Math.floor(s%3600/60);return h?`${h} h ${m} min`:m?`${m} min ${s%60} s`:`${s} s`;}
function drawYou(you){
  const card=document.getElementById("you");card.hidden=!you;if(!you)return;
  document.getElementById("you-id").textContent=you.peer_id;
  const items=[["tokens trained",fmt(you.tokens),"tokens"],["rounds completed",fmt(you.rounds_completed),"rounds-completed"],
    ["rounds void",fmt(you.rounds_void),"rounds-void"],["MB sent",(you.bytes_sent/1e6).toFixed(2),"bytes-sent"],
    ["share of the tokens of your rounds",you.share==null?"-":(you.share*100).toFixed(1)+" %","share"],
    ["time contributed",duration(you.seconds),"seconds"]];
  document.getElementById("you-totals").innerHTML=items.map(([k,v,id])=>`<div><dt>${k}</dt><dd id="you-${id}">${v}</dd></div>`).join("");
  for(const [key,name] of [["tokens","tokens"],["rounds_completed","roundsCompleted"],["rounds_void","roundsVoid"],["bytes_sent","bytesSent"],["seconds","seconds"]])card.dataset[name]=String(you[key]);
}
function draw(d){
  const run=d.run,rounds=d.rounds||[],you=d.you||null,mine=p=>!!(you&&p.you);
  if(run){const s=run.spec;
    document.getElementById("head").textContent=`run ${run.run}: ${s.model}, H=${s.sync_every}, ${s.compression} | round ${run.round} | ${run.peers.length} peers, ${Math.round(run.agreement*100)}% on state ${(run.state_hash||"-").slice(0,12)} | ${fmt(run.tokens_per_s)} tokens/s | held-out ${run.eval_loss==null?"-":run.eval_loss.toFixed(4)}`;
  }else document.getElementById("head").textContent="waiting for the run's records...";
  // the run's join string, fresh from its live peers' heartbeats (peer/join.py): for the next volunteer
  document.getElementById("join").hidden=!(run&&run.join);
  if(run&&run.join)document.getElementById("join-line").textContent=`peer start --join ${run.join}`;
  drawYou(you);
  const ok=rounds.filter(r=>!r.void);
  // held-out losses by the round of the state they were measured at: the run's samples name the state's
  // round, a round record the round it ended (its state is state_round = round + 1)
  const runLoss=d.samples.filter(s=>s.eval_loss!=null).map(s=>[s.round,s.eval_loss]);
  const series=[{name:"held-out (run)",points:runLoss,color:COLORS[2],width:5,opacity:0.4},  // (wide, under yours)
    {name:"train (you)",points:ok.filter(r=>r.train_loss!=null).map(r=>[r.round,r.train_loss]),color:COLORS[0]},
    {name:"held-out (you)",points:ok.filter(r=>r.eval_loss!=null).map(r=>[r.state_round,r.eval_loss]),color:COLORS[1]}];
  lines("loss",series);
  document.getElementById("loss-legend").innerHTML=series.filter(s=>s.points.length).map(s=>`<span style="color:${s.color}">&#9632; ${s.name}</span>`).join("");
  bars("speed",run?run.peers.map(p=>[mine(p)?"you":p.peer_id.slice(-6),p.tokens_per_s,mine(p)?YOU:COLORS[0]]):[]);
  lines("peers",[{points:d.samples.map(s=>[s.t,s.peers])}],v=>new Date(v*1000).toLocaleTimeString(),
        [0,Math.max(1,...d.samples.map(s=>s.peers))]);
  bars("bytes",rounds.slice(-40).map(r=>[r.round,(r.bytes_sent||0)/1e6,r.void?"#d62728":COLORS[0]]));
  lines("util",[{points:ok.filter(r=>r.utilization!=null).map(r=>[r.round,r.utilization])}],null,[0,1]);
  const myReach=run&&you?(run.peers.find(mine)||{}).reachability:undefined;
  bars("reach",run?Object.entries(run.reachability).map(([m,n])=>[m===myReach?m+" (you)":m,n,m===myReach?YOU:COLORS[0]]):[]);
  const t=document.getElementById("table");
  t.innerHTML="<tr><th>peer</th><th>round</th><th>state</th><th>tokens/s</th><th>train</th><th>held-out</th><th>seen</th><th>reach</th></tr>"+
    (run?run.peers.map(p=>`<tr class="${p.state_hash===run.state_hash?"":"off"}${mine(p)?" you":""}"><td>${p.peer_id.slice(-16)}${mine(p)?' <span class="tag">you</span>':""}</td><td>${p.round}</td><td>${p.state_hash.slice(0,12)}</td><td>${fmt(p.tokens_per_s)}</td><td>${p.train_loss==null?"-":p.train_loss.toFixed(3)}</td><td>${p.eval_loss==null?"-":p.eval_loss.toFixed(3)}</td><td>${Math.round(p.last_seen_s)}s</td><td>${p.reachability}</td></tr>`).join(""):"");
  document.body.dataset.rounds=String(Math.max(rounds.length,new Set(d.samples.map(s=>s.round)).size));
}
async function tick(){try{const r=await fetch("/api/status",{cache:"no-store"});draw(await r.json());}catch(e){document.getElementById("head").textContent="dashboard unreachable: "+e;}}
tick();setInterval(tick,2000);
</script></body></html>
"""
