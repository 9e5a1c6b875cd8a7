"""`vlrft report RUN_DIR`: one self-contained HTML page and a JSON summary of a run's saved
trajectories and metrics.

The page references nothing outside itself (CSS, script, charts and images are inline), so it
still works when copied elsewhere or opened offline. All model and user text goes through
`esc`: a completion is data, and a completion holding markup must show as text.
"""

from __future__ import annotations

import base64
import json
import math
import mimetypes
import re
from collections import Counter
from pathlib import Path

from vlrft.data.media import MediaFile, MediaPaths, open_media
from vlrft.trajectory.analysis import summarise, zero_variance_group_fraction
from vlrft.trajectory.records import ReportError, load_metrics, load_records
from vlrft.trajectory.svg import esc, histogram, line_chart

DEFAULT_TOP_K = 3
HISTOGRAM_BINS = 20
# The overview's statistics tables side by side at most; fewer where the page is narrow.
STAT_COLUMNS = 3
# A run of one repeated special token (an expanded <|image_pad|>) is shown once with a count.
REPEATED_SPECIAL_TOKEN = re.compile(r"(<\|[A-Za-z0-9_]+\|>)\1+")
HOT_CLASS = ' class="hot"'

STYLE = """
:root { --fg: #1d1f23; --muted: #626873; --line: #dde1e6; --card: #fff; --bg: #f3f5f7; --hot: #ffd166; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif;
       color: var(--fg); background: var(--bg); }
header.top { background: #22303c; color: #fff; padding: 14px 28px; }
header.top h1 { margin: 0; font-size: 20px; }
header.top nav a { color: #cfe3ff; margin-right: 14px; text-decoration: none; }
main { max-width: 1240px; margin: 0 auto; padding: 8px 28px 40px; }
section { background: var(--card); border: 1px solid var(--line); border-radius: 8px;
          padding: 6px 20px 18px; margin: 18px 0; }
h2 { font-size: 18px; border-bottom: 1px solid var(--line); padding-bottom: 6px; }
h3 { font-size: 15px; margin: 18px 0 8px; }
table { border-collapse: collapse; margin: 6px 0; }
th, td { text-align: left; padding: 3px 12px 3px 0; border-bottom: 1px solid #eef0f2; vertical-align: top;
         overflow-wrap: anywhere; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; overflow-wrap: normal; }
.stat-columns { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(100%, 260px), 1fr));
                column-gap: 32px; align-items: start; }
.stat-columns table { width: 100%; margin: 0; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(420px, 1fr)); gap: 14px; }
svg.chart { max-width: 100%; height: auto; background: #fff; }
.controls { margin: 8px 0 4px; display: flex; gap: 18px; }
.controls select { font: inherit; padding: 2px 6px; }
[hidden] { display: none !important; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 12px; }
.card { border: 1px solid var(--line); border-left: 5px solid #2a9d61; border-radius: 6px;
        padding: 8px 12px; background: #fcfdfc; min-width: 0; }
.card.worst { border-left-color: #d1495b; background: #fffcfc; }
.card-head { font-weight: 600; display: flex; flex-wrap: wrap; gap: 4px 14px; }
.badge { text-transform: uppercase; font-size: 11px; letter-spacing: .05em; color: var(--muted); }
.facts { color: var(--muted); font-size: 12.5px; margin: 4px 0; }
.facts b { color: var(--fg); font-weight: 600; }
.images img { min-height: 96px; max-height: 180px; max-width: 100%; border: 1px solid var(--line);
              border-radius: 4px; margin: 4px 6px 4px 0; image-rendering: pixelated; }
.missing { color: #d1495b; font-size: 12px; }
details summary { cursor: pointer; color: var(--muted); font-size: 12.5px; }
pre { font: 12.5px/1.5 ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; white-space: pre-wrap;
      overflow-wrap: anywhere; margin: 4px 0; padding: 8px; border-radius: 4px; background: #f4f6f8;
      max-height: 420px; overflow-y: auto; }
pre.response { background: #f7f7f2; }
pre.response span.hot, .legend-hot { background: var(--hot); border-radius: 2px; }
pre.response span.obs { color: #5a6b85; background: #e8eef8; }
.legend-hot { padding: 0 4px; }
.muted { color: var(--muted); }
"""

# Shows the sample groups matching both selects. The controls start hidden, so a reader with
# scripts off sees every sample and no dead controls.
SCRIPT = """
(() => {
  const step = document.getElementById("step-filter");
  const source = document.getElementById("source-filter");
  const show = () => {
    for (const group of document.querySelectorAll(".sample-group")) {
      group.hidden = (step.value !== "all" && group.dataset.step !== step.value) ||
        (source.value !== "all" && group.dataset.source !== source.value);
    }
  };
  step.addEventListener("change", show);
  source.addEventListener("change", show);
  document.getElementById("sample-controls").hidden = false;
  show();
})();
"""


def number(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def json_safe(value):
    """`value` with NaN/inf floats replaced by None: strict JSON (jq, JavaScript) has neither."""
    if isinstance(value, dict):
        return {key: json_safe(v) for key, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def last_metric_values(metrics: list[dict]) -> dict[str, float]:
    """Each metric's value on the last line that logged it."""
    last: dict[str, float] = {}
    for line in metrics:
        last |= {name: v for name, v in line.items()
                 if name != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return dict(sorted(last.items()))


def metric_series(metrics: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """metric name -> (step, value) points over the lines that carry a step."""
    series: dict[str, list[tuple[float, float]]] = {}
    for line in metrics:
        if not isinstance(line.get("step"), (int, float)):
            continue
        for name, value in line.items():
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(name, []).append((line["step"], value))
    return dict(sorted(series.items()))


def run_events(metrics: list[dict]) -> list[tuple[float, str, str]]:
    """(step, kind, what) of the guards' events in metrics.jsonl: a collapse or plateau warning
    (guards/collapse, guards/plateau) and a rollback (guards/rollback), to mark on the curves."""
    events = []
    for line in metrics:
        step = line.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            continue
        for kind in ("collapse", "plateau"):
            if line.get(f"guards/{kind}") == 1:
                events.append((step, kind, f"{kind} warning at step {number(step)}"))
        if line.get("guards/rollback") == 1:
            to = line.get("guards/rollback_to_step")
            back = f" to the checkpoint of step {number(to)}" if isinstance(to, (int, float)) else ""
            events.append((step, "rollback", f"rolled back at step {number(step)}{back}"))
    return events


def report_summary(records_by_step: dict[int, list[dict]], metrics: list[dict]) -> dict:
    """The report.json content: statistics per step, over the whole run, last metric values."""
    every = [r for records in records_by_step.values() for r in records]
    overall = summarise(every)
    # Group ids are only unique within a step (a prompt drawn again later reuses its id), so
    # over the run a group is a (step, group_id) pair, not a bare id.
    overall["zero_variance_group_frac"] = zero_variance_group_fraction(
        [r["reward"] for r in every], [(step, r["group_id"]) for step, rs in records_by_step.items() for r in rs])
    return {"steps": {step: summarise(records) for step, records in records_by_step.items()},
            "overall": overall, "metrics": last_metric_values(metrics)}


def step_series(step_stats: dict[int, dict], keys: dict[str, str]) -> dict[str, list[tuple[float, float]]]:
    """legend label -> (step, statistic) for each summarise() key, over the steps that have it."""
    return {label: [(step, stats[key]) for step, stats in step_stats.items() if key in stats]
            for label, key in keys.items()}


def keys_like(step_stats: dict[int, dict], prefix: str, suffix: str) -> dict[str, str]:
    """label -> key for every summarise() key of the form prefix<name>suffix in any step."""
    found = sorted({k for stats in step_stats.values() for k in stats if k.startswith(prefix) and k.endswith(suffix)})
    return {key[len(prefix):len(key) - len(suffix)]: key for key in found}


def stats_table(stats: dict[str, float]) -> str:
    # <wbr> after each "/": a long metric name wraps at its path separators first.
    rows = "".join(f'<tr><th>{esc(k).replace("/", "/<wbr>")}</th><td class="num">{esc(number(v))}</td></tr>'
                   for k, v in stats.items())
    return f"<table>{rows}</table>"


def stat_columns(stats: dict[str, float]) -> str:
    """`stats` as up to STAT_COLUMNS tables side by side, read top to bottom then left to right.
    Each column is a table of its own in a grid cell: one table flowed through CSS columns
    ran its rows past the column when a name was long, values under the next column's names."""
    items = list(stats.items())
    per_column = max(1, math.ceil(len(items) / STAT_COLUMNS))
    tables = "".join(stats_table(dict(items[i:i + per_column])) for i in range(0, len(items), per_column))
    return f'<div class="stat-columns">{tables}</div>'


def overview_section(run_dir: Path, records_by_step: dict[int, list[dict]], summary: dict) -> str:
    steps = list(records_by_step)
    every = [r for records in records_by_step.values() for r in records]
    ranks = sorted({r.get("rank") for r in every if r.get("rank") is not None})
    sources = sorted({r["data_source"] for r in every})
    facts = {"run directory": str(run_dir.resolve()), "saved steps": f"{len(steps)} ({', '.join(map(str, steps))})",
             "samples": str(len(every)), "ranks": ", ".join(map(str, ranks)) or "unknown",
             "data sources": ", ".join(sources)}
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in facts.items())
    metrics = (f'<h3>Last logged metrics (metrics.jsonl)</h3>'
               f'{stat_columns(summary["metrics"])}'
               if summary["metrics"] else '<p class="muted">No metrics.jsonl in this run directory.</p>')
    return (f'<section id="overview"><h2>Overview</h2><table>{rows}</table><h3>All saved samples</h3>'
            f'{stat_columns(summary["overall"])}{metrics}</section>')


def curves_section(step_stats: dict[int, dict], metrics: list[dict]) -> str:
    """Every curve over steps, with the guards' events (run_events) marked on each."""
    components = {"total reward": "reward/mean"} | keys_like(step_stats, "component/", "/mean")
    sources = {"all sources": "accuracy"} | keys_like(step_stats, "source/", "/accuracy")
    events = run_events(metrics)

    def chart(series, title, y_label):
        return line_chart(series, title, "step", y_label, events)

    charts = [
        chart(step_series(step_stats, components), "Reward mean by component", "mean"),
        chart(step_series(step_stats, sources), "Accuracy by data source", "accuracy"),
        chart(step_series(step_stats, {"mean": "length/mean", "p90": "length/p90"}), "Response length", "tokens"),
        chart(step_series(step_stats, {"truncated": "truncated_frac"}), "Truncation rate", "fraction"),
        chart(step_series(step_stats, {"zero-variance groups": "zero_variance_group_frac"}),
              "Groups with equal rewards (no group-relative signal)", "fraction"),
        chart(step_series(step_stats, {"repetition": "repetition_mean"}), "Repeated 3-grams per response", "fraction"),
    ]
    if any("entropy/mean" in stats for stats in step_stats.values()):
        charts.append(chart(step_series(step_stats, {"mean": "entropy/mean", "p90": "entropy/p90"}),
                            "Token entropy", "nats"))
    logged = [chart({name: points}, name, name.rsplit("/", 1)[-1]) for name, points in metric_series(metrics).items()]
    logged_html = ('<h3>Logged metrics (metrics.jsonl)</h3><div class="charts">' + "".join(logged) + "</div>"
                   if logged else '<p class="muted">No metrics.jsonl in this run directory.</p>')
    return (f'<section id="curves"><h2>Curves over steps</h2><h3>From saved trajectories</h3>'
            f'<div class="charts">{"".join(charts)}</div>{logged_html}</section>')


def histograms_section(step: int, records: list[dict]) -> str:
    charts = [histogram([r["response_length"] for r in records], HISTOGRAM_BINS, "Response length", "tokens"),
              histogram([r["reward"] for r in records], HISTOGRAM_BINS, "Reward", "reward")]
    entropies = [h for r in records for h in (r["entropy"] or [])]
    if entropies:
        charts.append(histogram(entropies, HISTOGRAM_BINS, "Token entropy (all response tokens)", "nats"))
    return (f'<section id="histograms"><h2>Distributions at step {step} (last saved)</h2>'
            f'<div class="charts">{"".join(charts)}</div></section>')


def per_source_section(records_by_step: dict[int, list[dict]], summary: dict) -> str:
    counts = Counter(r["data_source"] for records in records_by_step.values() for r in records)
    last_step = list(records_by_step)[-1]
    overall, last = summary["overall"], summary["steps"][last_step]
    rows = []
    for source, count in sorted(counts.items()):
        values = [overall[f"source/{source}/reward_mean"], overall[f"source/{source}/reward_std"],
                  overall[f"source/{source}/accuracy"]]
        last_accuracy = last.get(f"source/{source}/accuracy")
        cells = "".join(f'<td class="num">{esc(number(v))}</td>' for v in values)
        rows.append(f'<tr><th>{esc(source)}</th><td class="num">{count}</td>{cells}'
                    f'<td class="num">{esc(number(last_accuracy)) if last_accuracy is not None else "–"}</td></tr>')
    head = ("<tr><th>data source</th><th>samples</th><th>reward mean</th><th>reward std</th><th>accuracy</th>"
            f"<th>accuracy at step {last_step}</th></tr>")
    return (f'<section id="per-source"><h2>Per data source (all saved steps)</h2>'
            f'<table>{head}{"".join(rows)}</table></section>')


def reward_rank(record: dict) -> float:
    # A NaN reward sorts as the lowest, so broken samples show up among the worst.
    return -math.inf if math.isnan(record["reward"]) else record["reward"]


def best_and_worst(records: list[dict], top_k: int) -> list[tuple[str, dict]]:
    """(label, record) for the `top_k` highest then the `top_k` lowest rewards. With fewer
    than 2 * top_k records the upper half counts as best and the rest as worst, so each record
    shows once and a low reward is never labelled best."""
    ranked = sorted(records, key=reward_rank, reverse=True)
    n_best = min(top_k, math.ceil(len(ranked) / 2))
    best, worst = ranked[:n_best], ranked[n_best:][::-1][:top_k]
    return [(f"best {i}", r) for i, r in enumerate(best, 1)] + [(f"worst {i}", r) for i, r in enumerate(worst, 1)]


def run_file(trajectory_dir: Path, relative) -> MediaFile | None:
    """The file a record names (relative to `trajectory_dir`) when it resolves, symlinks
    followed, inside the run directory; else None. A record is data: one naming /etc/hostname
    or ../../x must not get that file pasted into a page that is meant to be shared. The file
    is later read with `open_media`, beneath the run directory with no symlink on the way, so a
    link put in its place after this check is not followed either."""
    if not isinstance(relative, str) or not relative:
        return None
    try:
        return MediaPaths((str(trajectory_dir.parent),)).resolve(trajectory_dir / relative)
    except (OSError, ValueError):  # a NUL byte, a name too long: not a file of the run
        return None


def image_data_uri(path: MediaFile, cache: dict[str, str | None]) -> str | None:
    """`path` as a data: URI (None when it is missing or cannot be opened as it was checked);
    `cache` holds each file once, as the responses of a prompt share its images."""
    if path not in cache:
        try:
            with open_media(path) as file:
                data = file.read()
        except (OSError, ValueError):
            data = None
        mime = mimetypes.guess_type(path)[0] or "application/octet-stream"
        cache[path] = f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}" if data is not None else None
    return cache[path]


def response_html(record: dict, hot_threshold: float | None) -> str:
    """The response token by token with entropies as tooltips, tokens above `hot_threshold`
    highlighted, and a multi-turn record's observation tokens marked as such; the plain text
    when the record has neither per-token entropies nor turns."""
    tokens, entropy, trained = record.get("response_tokens"), record["entropy"], record.get("trained")
    scored = bool(tokens) and bool(entropy) and len(tokens) == len(entropy) and hot_threshold is not None
    if not tokens or (not scored and trained is None):
        return esc(record["response_text"])
    spans = []
    for i, token in enumerate(tokens):
        if trained is not None and not trained[i]:
            spans.append(f'<span class="obs" title="observation (not trained)">{esc(token)}</span>')
        elif scored and entropy[i] is not None:
            spans.append(f'<span{HOT_CLASS if entropy[i] > hot_threshold else ""} title="entropy {entropy[i]:.3g}">{esc(token)}</span>')
        else:
            spans.append(esc(token))
    return "".join(spans)


def sample_card(label: str, record: dict, trajectory_dir: Path, hot_threshold: float | None,
                image_cache: dict[str, str | None]) -> str:
    kind = label.split()[0]
    components = ", ".join(f"{esc(name)} <b>{esc(number(v))}</b>" for name, v in sorted(record["components"].items()))
    facts = {"advantage": number(record["advantage"]), "length": number(record["response_length"]),
             "truncated": number(bool(record["truncated"])), "correct": number(record["correct"])}
    if "turns" in record:  # multi-turn: the turn count, the environment's rewards and failures
        turns = record["turns"]
        facts |= {"turns": str(len(turns)), "environment reward": number(sum(t["reward"] for t in turns))}
        facts |= {f"turn {i + 1} error": t["error"] for i, t in enumerate(turns) if "error" in t}
    fact_html = " · ".join(f"{k} <b>{esc(v)}</b>" for k, v in facts.items())
    images = []
    for k, relative in enumerate(record["images"] + record.get("observation_images", [])):
        path = run_file(trajectory_dir, relative)
        uri = image_data_uri(path, image_cache) if path is not None else None
        title = str(relative) if k < len(record["images"]) else f"shown by the environment: {relative}"
        missing = "image not found" if path is not None else "image outside the run directory, not shown"
        images.append(f'<img src="{esc(uri)}" alt="{esc(title)}" title="{esc(title)}">' if uri
                      else f'<span class="missing">{missing}: {esc(str(relative))}</span>')
    prompt = REPEATED_SPECIAL_TOKEN.sub(lambda m: f"{m[1]}×{len(m[0]) // len(m[1])}", record["prompt_text"])
    return (f'<div class="card {kind}" data-source="{esc(record["data_source"])}">'
            f'<div class="card-head"><span class="badge">{esc(label)}</span>'
            f'<span>reward {esc(number(record["reward"]))}</span>'
            f'<span>{esc(record["data_source"])}</span><span class="muted">group {esc(record["group_id"])} · '
            f'id {esc(record["id"])}</span></div>'
            f'<div class="facts">{fact_html}</div>'
            f'<div class="facts">components: {components or "none"}</div>'
            f'<div class="images">{"".join(images)}</div>'
            f'<details><summary>prompt ({len(record["prompt_text"])} characters)</summary>'
            f'<pre class="prompt">{esc(prompt)}</pre></details>'
            f'<pre class="response">{response_html(record, hot_threshold)}</pre></div>')


def samples_section(run_dir: Path, records_by_step: dict[int, list[dict]], step_stats: dict[int, dict],
                    top_k: int) -> str:
    trajectory_dir = run_dir / "trajectories"
    image_cache: dict[str, str | None] = {}
    sources = sorted({r["data_source"] for records in records_by_step.values() for r in records})
    last_step = list(records_by_step)[-1]
    step_options = "".join(f'<option value="{step}"{" selected" if step == last_step else ""}>step {step}</option>'
                           for step in records_by_step)
    source_options = "".join(f'<option value="{esc(s)}">{esc(s)}</option>' for s in sources)
    groups = []
    for step, records in records_by_step.items():
        # Highlight threshold: the step's 90th percentile of token entropy, so "hot" means
        # the top 10% of that step's tokens, comparable across the cards of the step.
        hot_threshold = step_stats[step].get("entropy/p90")
        for source in sources:
            of_source = [r for r in records if r["data_source"] == source]
            if not of_source:
                continue
            cards = "".join(sample_card(label, r, trajectory_dir, hot_threshold, image_cache)
                            for label, r in best_and_worst(of_source, top_k))
            groups.append(f'<div class="sample-group" data-step="{step}" data-source="{esc(source)}">'
                          f'<h3>Step {step} · {esc(source)} <span class="muted">({len(of_source)} responses; best and '
                          f'worst {top_k} by reward)</span></h3><div class="cards">{cards}</div></div>')
    return (f'<section id="samples"><h2>Samples</h2>'
            f'<p class="muted">Response tokens on a <span class="legend-hot">yellow</span> background have an '
            f'entropy in the top 10% of their step (hover a token for its entropy): the places where the policy '
            f'was least sure.</p>'
            f'<div class="controls" id="sample-controls" hidden>'
            f'<label>Step <select id="step-filter"><option value="all">all steps</option>{step_options}'
            f'</select></label>'
            f'<label>Data source <select id="source-filter"><option value="all" selected>all sources</option>'
            f'{source_options}</select></label></div>{"".join(groups)}</section>')


def render_report(run_dir: Path, records_by_step: dict[int, list[dict]], metrics: list[dict], summary: dict,
                  top_k: int) -> str:
    """The whole page as one HTML string."""
    last_step = list(records_by_step)[-1]
    sections = [overview_section(run_dir, records_by_step, summary),
                curves_section(summary["steps"], metrics),
                histograms_section(last_step, records_by_step[last_step]),
                per_source_section(records_by_step, summary),
                samples_section(run_dir, records_by_step, summary["steps"], top_k)]
    nav = "".join(f'<a href="#{anchor}">{name}</a>' for anchor, name in
                  (("overview", "Overview"), ("curves", "Curves"), ("histograms", "Histograms"),
                   ("per-source", "Per source"), ("samples", "Samples")))
    title = f"vlrft report: {run_dir.resolve().name}"
    # The empty data: icon stops the browser from asking for /favicon.ico.
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<link rel="icon" href="data:,"><title>{esc(title)}</title><style>{STYLE}</style></head>'
            f'<body><header class="top"><h1>{esc(title)}</h1><nav>{nav}</nav></header>'
            f'<main>{"".join(sections)}</main><script>{SCRIPT}</script></body></html>\n')


def write_report(run_dir: str | Path, out_path: str | Path | None = None,
                 top_k: int = DEFAULT_TOP_K) -> tuple[Path, Path]:
    """Write the HTML report (to `out_path`, default RUN_DIR/report.html) and the JSON summary
    next to it (same name, .json); return both paths. `top_k`: best and worst samples shown per
    step and data source."""
    if top_k < 1:
        raise ReportError(f"top_k must be at least 1, got {top_k}")
    run_dir = Path(run_dir)
    records_by_step = load_records(run_dir)
    if not records_by_step:
        raise ReportError(f"no trajectories in {run_dir / 'trajectories'} (expected step_NNNNNN.rankR.jsonl files)")
    html_path = Path(out_path) if out_path is not None else run_dir / "report.html"
    json_path = html_path.with_suffix(".json")
    if json_path == html_path:
        raise ReportError(f"report path {html_path} ends in .json, where the JSON summary goes; name the HTML file")
    metrics = load_metrics(run_dir)
    summary = report_summary(records_by_step, metrics)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(render_report(run_dir, records_by_step, metrics, summary, top_k), encoding="utf-8")
    json_path.write_text(json.dumps(json_safe(summary), indent=1) + "\n", encoding="utf-8")
    return html_path, json_path
