"""The trajectory viewer: one static HTML page of a run's sampled trajectories (`arpo view RUN_DIR`), or of an
evaluation's episodes (`arpo view EVAL_DIR`, read by arpo_cli.eval_view).

Role: turn a run folder into a page a person reads. It reads ``<run>/trajectories/*/record.json`` (written by
the learner's trajectory sample; the record's fields are listed in learner/rollouts/trajectory_sample.py) and
``<run>/metrics.jsonl``, and shows:

- a run summary: steps, policy version, samples by outcome, and success-rate and reward curves against the
  optimizer step, drawn by matplotlib as inline SVG with arpo_cli.curve's panels (the same style as curve.png);
- per episode (newest first): the instruction, outcome, reward, policy versions, timings, and per step the
  screenshot the step acted on with its click / drag / scroll point drawn over it (an SVG overlay whose viewBox
  is the screen in pixels, so the marks follow the image's scaling), the thought and the action text.

Owns: the page's markup, in the jinja2 templates ``templates/view.html.j2`` (the page) and
``templates/marks.svg.j2`` (one step's marks), and the local server of ``arpo view --serve``.

Invariants: templates are rendered with autoescape on, so every text from the run is HTML-escaped; the only
values marked safe are SVG the viewer built itself (matplotlib's curves, the rendered marks template). The page
needs nothing from the network (no CDN, no script); screenshots are linked by relative paths to the sample
folders, so the page is viewed next to them (written into the run folder by default) or through
:func:`make_server`, which serves the page and the sample folders on 127.0.0.1 only.
"""

from __future__ import annotations

import http.server
import io
import json
import os
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jinja2
import matplotlib
from markupsafe import Markup
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from arpo_async.metrics import training_records
from arpo_cli.curve import CurveError, draw_reward, draw_success, load_records, series
from arpo_cli.eval_view import is_eval_dir, load_eval_samples

PAGE_FILE = "view.html"
SAMPLES_DIR = "trajectories"
RECORD_FILE = "record.json"
POINT_KINDS = {"click": "#e6194b", "left_double": "#f58231", "right_single": "#911eb4", "hover": "#4363d8",
               "scroll": "#3cb44b", "drag": "#e6194b"}
"""Action kinds drawn on the screenshot, with their colour."""
CURVE_SIZE = (4.4, 2.8)
"""Each summary curve's size in inches (about 420 x 270 CSS pixels)."""


def _number(value: Any, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


TEMPLATES = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
                               autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
                               lstrip_blocks=True)
"""The page's templates; autoescape on (every value is escaped unless it is a :class:`Markup`)."""
TEMPLATES.filters["number"] = _number


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
    if not (run_dir / SAMPLES_DIR).is_dir() and is_eval_dir(run_dir):
        return load_eval_samples(run_dir)  # an `arpo eval` folder: its episodes, as samples
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


def require_episodes(run_dir: Path) -> int:
    """The number of episodes ``run_dir`` has to show (a run's sampled trajectories, or an `arpo eval` folder's
    episodes), at least 1.

    Raises:
        ViewerError: ``run_dir`` is not a folder, or it has no episode that can be read (the message says where
            episodes come from, and names the first unreadable one, if any).
    """
    samples, problems = load_samples(run_dir)
    if samples:
        return len(samples)
    unreadable = f"; {len(problems)} unreadable, e.g. {problems[0]}" if problems else ""
    raise ViewerError(f"no episodes in {run_dir} (not a run folder, or no trajectory sampled yet: the learner "
                      f"writes {SAMPLES_DIR}/*/{RECORD_FILE} while a run trains, learner.sample_trajectories; "
                      f"nor `arpo eval` results{unreadable})")


def curve_svg(title: str, draw: Callable[[Axes, list[dict[str, Any]], str], None],
              records: list[dict[str, Any]], points: int) -> Markup:
    """One summary curve as inline SVG markup: ``draw`` (arpo_cli.curve's ``draw_success`` or ``draw_reward``:
    trailing means over ``TRAILING_RECORDS`` records) of ``records`` against the optimizer step, titled ``title``.
    ``points``: how many points the curve's metric has; with none, the panel says "no data". Matplotlib's SVG
    backend on a bare Figure (no pyplot state, no display), text kept as text; ids are salted with ``title`` so
    two curves on one page never share one."""
    fig = Figure(figsize=CURVE_SIZE, layout="constrained")
    ax = fig.subplots()
    draw(ax, records, "step")
    ax.set_title(title, fontsize="medium", loc="left")
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if not points:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="#888")
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": title}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = buf.getvalue()
    return Markup(svg[svg.index("<svg"):])  # drop the XML prolog and DOCTYPE: it is inlined in HTML


def summary(records: list[dict[str, Any]], samples: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """The summary table's (name, value) rows: the last trained batch's metrics record (not the evaluation record
    a solved run ends with), and the samples by outcome."""
    outcomes: dict[str, int] = {}
    for sample in samples:
        outcomes[sample.get("outcome", "?")] = outcomes.get(sample.get("outcome", "?"), 0) + 1
    trained = training_records(records)
    last = trained[-1] if trained else {}
    rows = [("optimizer steps", last.get("step", "-")), ("policy version", last.get("policy_version", "-")),
            ("training wall time (min)", _number(last.get("wall_s", 0) / 60 if last else None, 1)),
            ("last success rate", _number(last.get("success_rate"))),
            ("sampled episodes", len(samples)),
            ("first successes kept", sum(1 for s in samples if s.get("first_success")))]
    return rows + [(f"sampled {name}", count) for name, count in sorted(outcomes.items())]


@dataclass(frozen=True)
class _Mark:
    """One action point on a screenshot, in screen pixels."""

    kind: str
    colour: str
    x: float
    y: float
    end: tuple[float, float] | None
    """Where a drag ends, or None."""


def _xy(point: Any) -> tuple[float, float] | None:
    ok = isinstance(point, (list, tuple)) and len(point) == 2 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in point)
    return (point[0], point[1]) if ok else None


def marks_svg(actions: list[dict[str, Any]], screen: tuple[int, int]) -> Markup:
    """The SVG overlay of one step (templates/marks.svg.j2): a ring and cross at each action point, an arrow for a
    drag. Coordinates are screen pixels (``screen`` = (width, height) in pixels, the viewBox); "" when nothing
    has a point (an action whose point is not two numbers is not drawn)."""
    width, height = screen
    marks = [_Mark(a["kind"], POINT_KINDS[a["kind"]], *_xy(a.get("point")), _xy(a.get("end_point")))
             for a in actions if a.get("kind") in POINT_KINDS and _xy(a.get("point"))]
    if not marks or width <= 0 or height <= 0:
        return Markup("")
    return Markup(TEMPLATES.get_template("marks.svg.j2").render(
        marks=marks, width=width, height=height, r=max(6.0, min(width, height) / 30)))


def step_view(sample: dict[str, Any], index: int, step: dict[str, Any], link: str) -> dict[str, Any]:
    """What the page shows of one step: number, screenshot ``src`` (None without one) and its ``marks``, version,
    thought, action and timings. ``link``: the sample folder's URL relative to the page."""
    shots, shot = sample.get("screenshots") or [], step.get("screenshot")
    src, marks = None, Markup("")
    if isinstance(shot, int) and 0 <= shot < len(shots):
        size = sample.get("screen_size") or [0, 0]
        src = f"{link}/{urllib.parse.quote(str(shots[shot]))}"
        marks = marks_svg(step.get("actions") or [], (int(size[0]), int(size[1])))
    versions = step.get("versions") or []
    version = f"v{versions[0]}" if versions and versions[0] == versions[-1] else (
        f"v{versions[0]}-{versions[-1]}" if versions else "")
    return {"number": index + 1, "src": src, "marks": marks, "version": version, "thought": step.get("thought"),
            "action": step.get("action") or f"(unparsed) {step.get('text', '')}",
            **{k: step.get(k) for k in ("generate_s", "act_s", "observe_s")}}


def episode_view(sample: dict[str, Any], page_dir: Path, run_dir: Path) -> dict[str, Any]:
    """What the page shows of one sampled episode: the record, its outcome and its steps (:func:`step_view`,
    images linked relative to ``page_dir``)."""
    link = Path(os.path.relpath(run_dir / sample["_folder"], page_dir)).as_posix()
    return {"sample": sample, "outcome": str(sample.get("outcome", "?")),
            "steps": [step_view(sample, i, step, link) for i, step in enumerate(sample["steps"])]}


def render_page(run_dir: Path, page_dir: Path | None = None) -> str:
    """The whole page for ``run_dir`` (templates/view.html.j2), with screenshot links relative to ``page_dir``
    (default: ``run_dir``).

    Raises:
        ViewerError: ``run_dir`` is not a folder.
    """
    run_dir = Path(run_dir)
    samples, problems = load_samples(run_dir)
    page_dir = run_dir if page_dir is None else Path(page_dir)
    try:
        records, metrics_note = load_records(run_dir), ""
    except CurveError as error:
        records, metrics_note = [], str(error)
    counts = {key: len(series(records, lambda r: r.get(key)).value) for key in ("success_rate", "reward_mean")}
    curves = [{"title": "success rate", "svg": curve_svg("success rate", draw_success, records,
                                                          counts["success_rate"])},
              {"title": "reward mean", "svg": curve_svg("reward mean", draw_reward, records, counts["reward_mean"])}]
    return TEMPLATES.get_template("view.html.j2").render(
        run_name=run_dir.name, run_path=str(run_dir.resolve()), metrics_note=metrics_note,
        summary=summary(records, samples), curves=curves, samples_dir=SAMPLES_DIR, problems=problems,
        episodes=[episode_view(s, page_dir, run_dir) for s in samples])


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
    folder or no episode to show (:func:`require_episodes`; nothing is written), 1 the page or the port
    failed), with the reason on stderr."""
    try:
        require_episodes(run_dir)
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
