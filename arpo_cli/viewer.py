"""The trajectory viewer: one static HTML page of a run's sampled trajectories (`arpo view RUN_DIR`).

Owns: the page. It reads ``<run>/trajectories/*/record.json`` (written by the learner's trajectory sample; the
record's fields are listed in learner/trajectory_sample.py) and ``<run>/metrics.jsonl``, and shows:

- a run summary: steps, policy version, samples by outcome, and success-rate and reward curves against the
  optimizer step (inline SVG: raw values as dots, the trailing mean of arpo_cli.curve as a line);
- per episode (newest first): the instruction, outcome, reward, policy versions, timings, and per step the
  screenshot the step acted on with its click / drag / scroll point drawn over it (an SVG overlay whose viewBox
  is the screen in pixels, so the marks follow the image's scaling), the thought and the action text.

Invariants: the page needs nothing from the network (no CDN, no script); screenshots are linked by relative
paths to the sample folders, so the page is viewed next to them (written into the run folder by default) or
through :func:`make_server`, which serves the page and the sample folders on 127.0.0.1 only. Every text from
the run is HTML-escaped.
"""

from __future__ import annotations

import html
import http.server
import json
import os
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from arpo_cli.curve import CurveError, TRAILING_STEPS, load_records, series, trailing_means

PAGE_FILE = "view.html"
SAMPLES_DIR = "trajectories"
RECORD_FILE = "record.json"
POINT_KINDS = {"click": "#e6194b", "left_double": "#f58231", "right_single": "#911eb4", "hover": "#4363d8",
               "scroll": "#3cb44b", "drag": "#e6194b"}
"""Action kinds drawn on the screenshot, with their colour."""

CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;background:#fafafa;color:#222}
h1{margin:0 0 .3em} .muted{color:#666} table{border-collapse:collapse} td,th{padding:2px 8px;text-align:left}
.curves{display:flex;flex-wrap:wrap;gap:1em} .curve{background:#fff;border:1px solid #ddd}
.episode{background:#fff;border:1px solid #ccc;border-radius:6px;margin:1em 0;padding:.6em 1em}
.episode>summary{cursor:pointer;font-weight:600}
.outcome{padding:1px 6px;border-radius:4px;color:#fff;background:#777}
.SUCCESS{background:#2a8a3a}.FAILURE{background:#b03030}.TRUNCATED{background:#b07020}
.POLICY_ERROR{background:#8a2a8a}.ENV_ERROR,.ABORTED{background:#555}
.instruction{font-size:1.05em;margin:.4em 0}
.steps{display:flex;flex-wrap:wrap;gap:1em}
.step{margin:0;width:420px} .shot{position:relative;line-height:0;border:1px solid #999}
.shot img{width:100%;height:auto} .shot svg{position:absolute;left:0;top:0;width:100%;height:100%}
.step figcaption{font-size:.85em;margin-top:.3em;white-space:pre-wrap;word-break:break-word}
.action{font-family:monospace;background:#eef;padding:1px 4px}
.error{color:#b03030;font-family:monospace;white-space:pre-wrap}
"""


class ViewerError(ValueError):
    """The folder is not a run folder the viewer can show; the message names it."""


def load_samples(run_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The sampled trajectories of ``run_dir``, newest first, and a note per sample that could not be read.

    Each record gets ``_folder``: its folder's path relative to ``run_dir`` (POSIX form).

    Raises:
        ViewerError: ``run_dir`` is not a directory.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ViewerError(f"{run_dir} is not a folder (expected a run folder such as runs/demo)")
    records, problems = [], []
    for path in sorted((run_dir / SAMPLES_DIR).glob(f"*/{RECORD_FILE}")):
        try:
            record = json.loads(path.read_text())
            if not isinstance(record, dict) or not isinstance(record.get("steps"), list):
                raise ValueError("not a trajectory record")
        except (OSError, ValueError) as error:
            problems.append(f"{path.parent.name}: {error}")
            continue
        record["_folder"] = path.parent.relative_to(run_dir).as_posix()
        records.append(record)
    records.sort(key=lambda r: (r.get("learner_step", 0), r.get("received_at", 0.0)), reverse=True)
    return records, problems


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _number(value: Any, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def curve_svg(title: str, steps: list[int], values: list[float], *, lo: float | None = None,
              hi: float | None = None, width: int = 420, height: int = 220) -> str:
    """An inline SVG chart of ``values`` against ``steps`` (same length): dots per point, a line through their
    trailing mean over ``TRAILING_STEPS`` points. ``lo``/``hi`` fix the y range (default: the data's). Sizes in
    CSS pixels. An empty series gives a chart that says "no data"."""
    pad_l, pad_r, pad_t, pad_b = 44, 10, 24, 28
    parts = [f'<svg class="curve" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}"><text x="{pad_l}" y="16" font-size="13" font-weight="600">'
             f'{_e(title)}</text>']
    if not values:
        parts.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" fill="#888">no data</text></svg>')
        return "".join(parts)
    lo = min(values) if lo is None else lo
    hi = max(values) if hi is None else hi
    lo, hi = (lo - 0.5, hi + 0.5) if hi <= lo else (lo, hi)
    x0, x1 = min(steps), max(steps)
    x1 = x0 + 1 if x1 <= x0 else x1
    plot_w, plot_h = width - pad_l - pad_r, height - pad_t - pad_b

    def xy(step: float, value: float) -> tuple[float, float]:
        return (pad_l + (step - x0) / (x1 - x0) * plot_w,
                pad_t + (1 - (min(max(value, lo), hi) - lo) / (hi - lo)) * plot_h)

    parts.append(f'<rect x="{pad_l}" y="{pad_t}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#bbb"/>')
    for value in (lo, (lo + hi) / 2, hi):
        y = xy(x0, value)[1]
        parts.append(f'<text x="{pad_l - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{value:.2g}</text>')
    parts.append(f'<text x="{pad_l}" y="{height - 8}" font-size="10">step {x0}</text>'
                 f'<text x="{width - pad_r}" y="{height - 8}" font-size="10" text-anchor="end">step {x1}</text>')
    for step, value in zip(steps, values):
        x, y = xy(step, value)
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="#999"/>')
    line = " ".join("%.1f,%.1f" % xy(s, v) for s, v in zip(steps, trailing_means(values, TRAILING_STEPS)))
    parts.append(f'<polyline points="{line}" fill="none" stroke="#1f5fbf" stroke-width="2"/></svg>')
    return "".join(parts)


def summary_html(run_dir: Path, samples: list[dict[str, Any]]) -> str:
    """The run summary: last metrics record, samples by outcome, success-rate and reward curves."""
    try:
        records = load_records(run_dir)
    except CurveError as error:
        records, note = [], f'<p class="muted">{_e(error)}</p>'
    else:
        note = ""
    outcomes: dict[str, int] = {}
    for sample in samples:
        outcomes[sample.get("outcome", "?")] = outcomes.get(sample.get("outcome", "?"), 0) + 1
    last = records[-1] if records else {}
    rows = [("optimizer steps", last.get("step", "-")), ("policy version", last.get("policy_version", "-")),
            ("training wall time (min)", _number(last.get("wall_s", 0) / 60 if last else None, 1)),
            ("last success rate", _number(last.get("success_rate"))),
            ("sampled episodes", len(samples)),
            ("first successes kept", sum(1 for s in samples if s.get("first_success")))]
    rows += [(f"sampled {name}", count) for name, count in sorted(outcomes.items())]
    table = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    success = series(records, lambda r: r.get("success_rate"))
    reward = series(records, lambda r: r.get("reward_mean"))
    curves = (curve_svg("success rate", success.step, success.value, lo=0.0, hi=1.0)
              + curve_svg("reward mean", reward.step, reward.value))
    return (f'<section id="summary"><h2>Run summary</h2>{note}<table>{table}</table>'
            f'<div class="curves">{curves}</div></section>')


def marks_svg(actions: list[dict[str, Any]], screen: tuple[int, int]) -> str:
    """The SVG overlay of one step: a ring and cross at each action point, an arrow for a drag. Coordinates are
    screen pixels (``screen`` = (width, height) in pixels, the viewBox); "" when nothing has a point."""
    width, height = screen
    radius = max(6.0, min(width, height) / 30)
    shapes = []
    for action in actions:
        kind, point, end = action.get("kind", ""), action.get("point"), action.get("end_point")
        if not point or kind not in POINT_KINDS:
            continue
        colour, (x, y) = POINT_KINDS[kind], point
        shapes.append(f'<g class="mark mark-{_e(kind)}" stroke="{colour}" fill="none" stroke-width="{radius / 3:.1f}">'
                      f'<circle cx="{x}" cy="{y}" r="{radius:.1f}"/>'
                      f'<line x1="{x - radius * 1.6:.1f}" y1="{y}" x2="{x + radius * 1.6:.1f}" y2="{y}"/>'
                      f'<line x1="{x}" y1="{y - radius * 1.6:.1f}" x2="{x}" y2="{y + radius * 1.6:.1f}"/>')
        if end:
            shapes.append(f'<line x1="{x}" y1="{y}" x2="{end[0]}" y2="{end[1]}" marker-end="url(#arrow)"/>'
                          f'<circle cx="{end[0]}" cy="{end[1]}" r="{radius / 2:.1f}" fill="{colour}"/>')
        shapes.append("</g>")
    if not shapes or width <= 0 or height <= 0:
        return ""
    arrow = ('<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="4" markerHeight="4" '
             'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#e6194b"/></marker></defs>')
    return (f'<svg class="marks" viewBox="0 0 {width} {height}" '
            f'preserveAspectRatio="none">{arrow}{"".join(shapes)}</svg>')


def step_html(sample: dict[str, Any], index: int, step: dict[str, Any], link: str) -> str:
    """One step: its screenshot with the marks, then thought, action and timings. ``link``: the sample folder's
    URL relative to the page."""
    shots, shot = sample.get("screenshots") or [], step.get("screenshot")
    picture = '<p class="muted">(no screenshot)</p>'
    if isinstance(shot, int) and 0 <= shot < len(shots):
        size = sample.get("screen_size") or [0, 0]
        src = f"{link}/{urllib.parse.quote(str(shots[shot]))}"
        picture = (f'<div class="shot"><img src="{_e(src)}" alt="step {index + 1} screenshot" loading="lazy">'
                   f'{marks_svg(step.get("actions") or [], (int(size[0]), int(size[1])))}</div>')
    versions = step.get("versions") or []
    version = f"v{versions[0]}" if versions and versions[0] == versions[-1] else (
        f"v{versions[0]}-{versions[-1]}" if versions else "")
    thought = f"<div><b>Thought:</b> {_e(step.get('thought'))}</div>" if step.get("thought") else ""
    action = step.get("action") or f"(unparsed) {step.get('text', '')}"
    return (f'<figure class="step">{picture}<figcaption><b>step {index + 1}</b> {_e(version)}{thought}'
            f'<div><b>Action:</b> <span class="action">{_e(action)}</span></div>'
            f'<div class="muted">generate {_number(step.get("generate_s"))} s · act {_number(step.get("act_s"))} s'
            f' · observe {_number(step.get("observe_s"))} s</div></figcaption></figure>')


def episode_html(sample: dict[str, Any], page_dir: Path, run_dir: Path) -> str:
    """One sampled episode as a ``<details class="episode">`` block (images linked relative to ``page_dir``)."""
    link = Path(os.path.relpath(run_dir / sample["_folder"], page_dir)).as_posix()
    outcome = str(sample.get("outcome", "?"))
    timings = " · ".join(f"{_e(k.removesuffix('_s'))} {_number(v)} s"
                         for k, v in (sample.get("timings") or {}).items())
    first = ' <span class="outcome SUCCESS">first success</span>' if sample.get("first_success") else ""
    steps = "".join(step_html(sample, i, step, link) for i, step in enumerate(sample["steps"]))
    error = f'<div class="error">{_e(sample["error"])}</div>' if sample.get("error") else ""
    return (f'<details class="episode" open id="{_e(sample.get("trajectory_id", ""))}" data-outcome="{_e(outcome)}">'
            f'<summary><span class="outcome {_e(outcome)}">{_e(outcome)}</span>{first} {_e(sample.get("task_id"))} '
            f'<span class="muted">reward {_number(sample.get("score"))} · step {_e(sample.get("learner_step"))} · '
            f'policy v{_e(sample.get("policy_version"))} (assigned v{_e(sample.get("assigned_version"))}) · '
            f'{len(sample["steps"])} steps</span></summary>'
            f'<div class="instruction">{_e(sample.get("instruction", ""))}</div>'
            f'<div class="muted">{timings} · actor {_e(sample.get("actor_id"))} · desktop {_e(sample.get("desktop"))}'
            f'</div>{error}<div class="steps">{steps}</div></details>')


def render_page(run_dir: Path, page_dir: Path | None = None) -> str:
    """The whole page for ``run_dir``, with screenshot links relative to ``page_dir`` (default: ``run_dir``).

    Raises:
        ViewerError: ``run_dir`` is not a folder.
    """
    run_dir = Path(run_dir)
    samples, problems = load_samples(run_dir)
    page_dir = run_dir if page_dir is None else Path(page_dir)
    note = ("" if samples else '<p class="muted">No sampled trajectories yet: the learner keeps them in '
            f'{_e(SAMPLES_DIR)}/ (learner.sample_trajectories, learner.sample_disk_mb).</p>')
    skipped = "".join(f'<p class="error">skipped {_e(p)}</p>' for p in problems)
    episodes = "".join(episode_html(s, page_dir, run_dir) for s in samples)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>arpo view: {_e(run_dir.name)}'
            f'</title><style>{CSS}</style></head><body><h1>arpo view: {_e(run_dir.name)}</h1>'
            f'<p class="muted">{_e(run_dir.resolve())}</p>{summary_html(run_dir, samples)}'
            f'<section id="episodes"><h2>Episodes ({len(samples)})</h2>{note}{skipped}{episodes}</section>'
            f'</body></html>')


def write_page(run_dir: Path, out: Path | None = None) -> Path:
    """Write :func:`render_page` to ``out`` (default ``<run_dir>/view.html``) atomically; returns the path.

    Raises:
        ViewerError: ``run_dir`` is not a folder.
        OSError: ``out`` could not be written.
    """
    run_dir = Path(run_dir)
    out = run_dir / PAGE_FILE if out is None else Path(out)
    text = render_page(run_dir, out.resolve().parent)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    return out


class _Handler(http.server.SimpleHTTPRequestHandler):
    """GET / -> the page, freshly rendered; GET /trajectories/... -> sample files; anything else 404."""

    run_dir: Path

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = urllib.parse.urlsplit(self.path).path
        if path in ("/", f"/{PAGE_FILE}"):
            body = render_page(self.run_dir).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif path.startswith(f"/{SAMPLES_DIR}/") and ".." not in path.split("/"):
            super().do_GET()
        else:
            self.send_error(404, "only the page and the trajectory samples are served")

    def do_HEAD(self) -> None:  # noqa: N802
        self.send_error(405)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per image is noise
        pass


def make_server(run_dir: Path, port: int = 8765, host: str = "127.0.0.1") -> http.server.ThreadingHTTPServer:
    """An HTTP server for ``run_dir``'s page (re-rendered on each load, so a running run's new samples show) and
    its sample folders; call ``serve_forever()`` on it. ``port`` 0 picks a free one (``server.server_port``).

    Raises:
        ViewerError: ``run_dir`` is not a folder, or ``host`` is not a loopback address (the page shows what the
            agent saw; it is not published beyond this machine).
        OSError: the port is taken.
    """
    run_dir = Path(run_dir).resolve()
    if not run_dir.is_dir():
        raise ViewerError(f"{run_dir} is not a folder (expected a run folder such as runs/demo)")
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ViewerError(f"arpo view serves on the loopback interface only, not {host!r}")
    handler = type("RunHandler", (_Handler,), {"run_dir": run_dir})

    def factory(*args: Any, **kwargs: Any) -> _Handler:
        return handler(*args, directory=str(run_dir), **kwargs)

    return http.server.ThreadingHTTPServer((host, port), factory)


def view_main(run_dir: Path, *, out: Path | None = None, serve: bool = False, port: int = 8765) -> int:
    """`arpo view RUN_DIR [--out FILE] [--serve [--port P]]`: write the page and print its path; with ``serve``,
    also serve it on http://127.0.0.1:PORT/ until interrupted. Returns the exit status (0 ok, 2 not a run
    folder, 1 the page or the port failed), with the reason on stderr."""
    try:
        print(write_page(run_dir, out))
        if not serve:
            return 0
        server = make_server(run_dir, port)
    except ViewerError as error:
        print(f"arpo view: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"arpo view: {error}", file=sys.stderr)
        return 1
    print(f"serving http://127.0.0.1:{server.server_port}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
