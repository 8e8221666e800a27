"""The main job as one page: every recorded table as HTML, the chapter's figures beside ours,
and the plots each table declared, in one self-contained file (no network, no extra files).
Every plot names its axes with their units; where the chapter gives a comparable figure (a
ratio, a byte count, a perplexity) it is drawn on the plot as a marker labelled "chapter". The
navigation wraps on a narrow window, and wide tables scroll inside their own box.

Reads the tables the scripts recorded (DIR/tables/<script>.json, see _table.py), writes
DIR/tables.json (all of them, in order) and DIR/index.html. Plots are drawn by matplotlib when it
is installed (the 'report' extra) and embedded as base64 PNG; without it the page says so and
still has every table. A plot only ever draws columns of the table it sits under.
"""
import base64
import html
import io
import json
import math
from pathlib import Path

STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; max-width: 1100px; margin: 2em auto;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.2em; margin-top: 2.2em;
       border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: .6em 0; font: 13px/1.3 ui-monospace, monospace; }
th, td { padding: 2px 9px; border-bottom: 1px solid #e4e4e4; text-align: right; }
th { background: #f3f3f3; } .text { text-align: left; }
tr.warn td { background: #fff0f0; } .warning { color: #b00; font-weight: bold; }
.header, .note { color: #555; margin: .15em 0; font-size: 13px; }
.chapter { background: #eef5ff; border-left: 4px solid #4a7fd6; padding: .4em .8em;
           margin: .6em 0; font-size: 13.5px; }
.plot img { max-width: 100%; height: auto; }
nav { display: flex; flex-wrap: wrap; gap: .25em .9em; font-size: 13.5px; }
nav a { white-space: nowrap; }
.scroll { overflow-x: auto; max-width: 100%; }
@media (max-width: 900px) { body { margin: 1em auto; } table { font-size: 12px; } }
"""


def write_report(directory: Path, title: str) -> Path:
    """DIR/tables/*.json -> DIR/tables.json and DIR/index.html; returns the page's path."""
    tables = []
    for path in sorted((directory / "tables").glob("*.json"), key=order):
        tables += json.loads(path.read_text())
    (directory / "tables.json").write_text(json.dumps(tables, indent=1))
    plotter = matplotlib_or_none()
    sections, nav = [], []
    for i, table in enumerate(tables):
        anchor = f"t{i}"
        nav.append(f'<a href="#{anchor}">{html.escape(short(table))}</a>')
        sections.append(section(table, anchor, plotter))
    missing = "" if plotter else (
        "<p class='warning'>plots need matplotlib: pip install -e '.[report]'; "
        "the tables are all here</p>")
    page = ("<!doctype html><html><head><meta charset='utf-8'><meta name='viewport' "
            f"content='width=device-width, initial-scale=1'><title>{html.escape(title)}"
            f"</title><style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p class='note'>Each table as its script printed it, the chapter's figure under "
            f"it (Qwen2.5-0.5B on a laptop GPU) and why ours differs. Every table is also in "
            f"tables.json.</p>{missing}<nav>{''.join(nav)}</nav>{''.join(sections)}"
            "</body></html>")
    out = directory / "index.html"
    out.write_text(page)
    return out


def order(path):
    """run_all's summary last; the experiments by name (exp01 ... exp24)."""
    return (path.stem == "run_all", path.stem)


def short(table):
    """The navigation's name of a table: its title up to the first colon, cut at a word."""
    name = table["title"].split(":")[0]
    return name if len(name) <= 40 else name[:40].rsplit(" ", 1)[0] + "..."


def section(table, anchor, plotter) -> str:
    parts = [f"<h2 id='{anchor}'>{html.escape(table['title'])}</h2>"]
    parts += [f"<p class='header'>{html.escape(h)}</p>" for h in table["header"]]
    if table["columns"]:
        parts.append(f"<div class='scroll'>{html_table(table)}</div>")
    parts += [f"<p class='note'>{html.escape(n)}</p>" for n in table["notes"]]
    if table["chapter"]:
        parts.append(f"<div class='chapter'><b>{html.escape(table['chapter'])}</b><br>"
                     f"{html.escape(table['differs'])}</div>")
    for spec in table["plots"]:
        if plotter:
            parts.append(f"<div class='plot'><img alt='{html.escape(spec['title'])}' "
                         f"src='data:image/png;base64,{plot_png(plotter, table, spec)}'></div>")
    return "".join(parts)


def html_table(table) -> str:
    text = [all(isinstance(r[i], str) for r in table["rows"]) and bool(table["rows"])
            for i in range(len(table["columns"]))]
    head = "".join(f"<th class='{'text' if t else ''}'>{html.escape(c)}</th>"
                   for c, t in zip(table["columns"], text, strict=True))
    rows = []
    for i, cells in enumerate(table["cells"]):
        warning = table["warnings"].get(str(i))
        tds = "".join(f"<td class='{'text' if t else ''}'>{html.escape(c)}</td>"
                      for c, t in zip(cells, text, strict=True))
        if warning:
            tds += f"<td class='text warning'>WARNING: {html.escape(warning)}</td>"
        rows.append(f"<tr class='{'warn' if warning else ''}'>{tds}</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def matplotlib_or_none():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def plot_png(plt, table, spec) -> str:
    """One declared plot of the table's own columns -> base64 PNG: axes labelled with their
    units, the chapter's comparable figures as markers labelled "chapter"."""
    columns = table["columns"]
    x = [r[columns.index(spec["x"])] for r in table["rows"]]
    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=100)
    ax.set_yscale("log" if spec["logy"] else "linear")
    chapter = spec.get("chapter") or []
    if spec["kind"] == "bar":
        width = 0.8 / len(spec["ys"])
        for k, name in enumerate(spec["ys"]):
            y = [number(r[columns.index(name)]) for r in table["rows"]]
            ax.bar([i + k * width for i in range(len(x))], y, width, label=name)
        middle = width * (len(spec["ys"]) - 1) / 2
        ax.set_xticks([i + middle for i in range(len(x))])
        ax.set_xticklabels([str(v) for v in x], rotation=20, ha="right", fontsize=8)
        points = [(x.index(a) + middle, b) for a, b, _ in chapter if a in x]
    else:
        for name in spec["ys"]:
            points = [(number(a), number(r[columns.index(name)]))
                      for a, r in zip(x, table["rows"], strict=True)]
            points = [(a, b) for a, b in points if math.isfinite(a) and math.isfinite(b)]
            ax.plot(*zip(*points, strict=True), marker="o", label=name)
        ax.set_xscale("log" if spec["logx"] else "linear")
        points = [(number(a), number(b)) for a, b, _ in chapter]
    if points:
        ax.scatter(*zip(*points, strict=True), marker="*", s=160, color="black", zorder=5,
                   label="chapter")
        shown = [c for c in chapter if spec["kind"] != "bar" or c[0] in x]
        for (a, b), (_, _, printed) in zip(points, shown, strict=True):
            ax.annotate(printed, (a, b), textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.set_xlabel(spec.get("xlabel") or spec["x"])
    ax.set_ylabel(spec.get("ylabel") or ", ".join(spec["ys"]))
    if spec.get("hline"):
        label, value = spec["hline"]
        ax.axhline(value, color="gray", linestyle="--", label=label)
    ax.set_title(spec["title"], fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def number(value) -> float:
    """A table cell's raw value as a float (inf for 'inf'), NaN when it is not a number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
