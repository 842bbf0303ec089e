"""OSWorld's own metric functions, called unchanged through a worker process in the OSWorld metrics venv.

:data:`OSWORLD_METRICS` maps each supported metric name to its module in OSWorld's published package
(``desktop_env/evaluators/metrics/<module>.py``, desktop-env 1.0.2). It lists every metric OSWorld's 369 tasks
use; all run with the libraries :mod:`actors.osworld.metric_env` installs (compare_audios with librosa and
fastdtw, compare_videos with OpenCV) except those in :data:`LEFT_OUT_LIBRARY_METRICS` (compare_image_text: OCR),
which fail when a task is evaluated, naming the library. A unit test re-derives this from the package's source.

:class:`MetricWorker` owns one long-lived worker process (:mod:`actors.osworld.metric_worker`): requests go one
at a time as JSON lines; a worker that dies or misses the deadline is killed and restarted on the next call.
Calls are blocking (run them in a thread: :func:`call_metric` does).
"""
from __future__ import annotations

import asyncio
import json
import os
import selectors
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from actors.osworld import metric_env

OSWORLD_METRICS: dict[str, str] = {
    # general.py
    "check_accessibility_tree": "general", "check_csv": "general", "check_direct_json_object": "general",
    "check_json": "general", "check_line_number": "general", "compare_python_pure_text": "general",
    "compare_time_in_speedtest_results": "general", "fuzzy_place_math": "general", "run_sqlite3": "general",
    # basic_os.py
    "check_gnome_favorite_apps": "basic_os", "check_moved_jpgs": "basic_os", "check_text_enlarged": "basic_os",
    "is_in_vm_clickboard": "basic_os", "is_utc_0": "basic_os",
    # chrome.py
    "check_enabled_experiments": "chrome", "check_font_size": "chrome", "check_history_deleted": "chrome",
    "compare_archive": "chrome", "compare_htmls": "chrome", "compare_pdf_images": "chrome",
    "compare_pdfs": "chrome", "is_added_to_steam_cart": "chrome", "is_cookie_deleted": "chrome",
    "is_expected_active_tab": "chrome", "is_expected_bookmarks": "chrome",
    "is_expected_installed_extensions": "chrome", "is_expected_search_query": "chrome",
    "is_expected_tabs": "chrome", "is_expected_url_pattern_match": "chrome", "is_shortcut_on_desktop": "chrome",
    # vlc.py
    "check_global_key_play_pause": "vlc", "check_one_instance_when_started_from_file": "vlc",
    "check_qt_bgcone": "vlc", "check_qt_max_volume": "vlc", "check_qt_minimal_view": "vlc",
    "check_qt_slider_colours": "vlc", "compare_images": "vlc", "is_vlc_fullscreen": "vlc",
    "is_vlc_playing": "vlc", "is_vlc_recordings_folder": "vlc", "compare_audios": "vlc", "compare_videos": "vlc",
    # gimp.py
    "check_brightness_decrease_and_structure_sim": "gimp", "check_config_status": "gimp",
    "check_contrast_increase_and_structure_sim": "gimp", "check_file_exists_and_structure_sim": "gimp",
    "check_green_background": "gimp", "check_image_file_size": "gimp", "check_image_mirror": "gimp",
    "check_image_size": "gimp", "check_palette_and_structure_sim": "gimp",
    "check_saturation_increase_and_structure_sim": "gimp", "check_structure_sim": "gimp",
    "check_structure_sim_resized": "gimp", "check_textbox_on_leftside": "gimp",
    "check_triangle_position": "gimp", "compare_image_list": "gimp",
    # vscode.py
    "check_json_keybindings": "vscode", "check_json_settings": "vscode", "check_python_file_by_test_suite": "vscode",
    "compare_config": "vscode", "compare_result_files": "vscode", "compare_zip_files": "vscode",
    "is_extension_installed": "vscode",
    # docs.py, slides.py, table.py, pdf.py, thunderbird.py, others.py (LibreOffice, Thunderbird, files)
    "check_highlighted_words": "docs", "check_italic_font_size_14": "docs", "check_tabstops": "docs",
    "compare_contains_image": "docs", "compare_docx_files": "docs",
    "compare_docx_files_and_ignore_new_lines": "docs", "compare_docx_images": "docs", "compare_docx_lines": "docs",
    "compare_docx_tables": "docs", "compare_font_names": "docs", "compare_image_text": "docs",
    "compare_line_spacing": "docs",
    "compare_references": "docs", "compare_subscript_contains": "docs", "contains_page_break": "docs",
    "evaluate_colored_words_in_tables": "docs", "evaluate_strike_through_last_paragraph": "docs",
    "find_default_font": "docs", "has_page_numbers_in_footers": "docs", "is_first_line_centered": "docs",
    "check_auto_saving_time": "slides", "check_image_stretch_and_center": "slides", "check_left_panel": "slides",
    "check_page_number_colors": "slides", "check_presenter_console_disable": "slides",
    "check_slide_orientation_Portrait": "slides", "check_transition": "slides", "compare_pptx_files": "slides",
    "evaluate_presentation_fill_to_rgb_distance": "slides",
    "compare_conference_city_in_order": "table", "compare_csv": "table", "compare_table": "table",
    "check_pdf_pages": "pdf",
    "check_thunderbird_filter": "thunderbird", "check_thunderbird_folder": "thunderbird",
    "check_thunderbird_prefs": "thunderbird",
    "check_mp3_meta": "others", "compare_epub": "others",
}
"""Metric name -> module under desktop_env/evaluators/metrics (OSWorld's names; see the module docstring)."""

LEFT_OUT_LIBRARY_METRICS: dict[str, str] = {"compare_image_text": "easyocr"}
"""Listed metrics whose library the metrics environment leaves out, -> that library. compare_image_text reads text
from an image with EasyOCR, which needs torch and downloads its OCR models from the network on first use: a task
using it loads, and its evaluation fails with the worker's ``MissingLibrary`` error naming EasyOCR."""

WORKER_SCRIPT = Path(__file__).resolve().parent / "metric_worker.py"
CALL_TIMEOUT_S = 120.0
"""Longest one metric call may take (OSWorld's largest-file comparisons take seconds)."""


class MetricError(RuntimeError):
    """An OSWorld metric raised (``error_type`` names its exception), or its worker died or timed out."""

    def __init__(self, message: str, error_type: str = "") -> None:
        super().__init__(message)
        self.error_type = error_type


class _WorkerExited(MetricError):
    """The worker's stdout closed: it died (killed, crashed) before answering."""


class MetricWorker:
    """One worker process in the OSWorld metrics venv, started on first use (building the venv if needed).

    Args:
        env_dir: the venv (default metric_env.DEFAULT_ENV_DIR).
        timeout: seconds one call may take before the worker is killed (MetricError).
    Thread-safe: calls are serialised by a lock.
    """

    def __init__(self, env_dir: Path | None = None, *, timeout: float = CALL_TIMEOUT_S) -> None:
        self.env_dir, self.timeout = env_dir, timeout
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._buffer = b""

    def _start(self) -> subprocess.Popen:
        python = metric_env.ensure_env(self.env_dir)
        args = [str(python), "-I", str(WORKER_SCRIPT),
                *(f"--placeholder={k}={v}" for k, v in metric_env.PLACEHOLDER_MODULES.items())]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
               "TLDEXTRACT_CACHE": str(Path(python).parent.parent / "tldextract-cache")}
        self._buffer = b""
        return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                env=env)

    def _readline(self, proc: subprocess.Popen, deadline: float) -> bytes:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise MetricError(f"OSWorld metric worker: no answer within {self.timeout:g} s")
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise _WorkerExited(f"OSWorld metric worker exited (code {proc.wait()})")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def call(self, name: str, args: list, kwargs: dict, module: str | None = None, *,
             getter_env: dict | None = None) -> Any:
        """Run OSWorld's metric ``name`` (a key of OSWORLD_METRICS; or any function of ``module``) on JSON-able
        ``args``/``kwargs`` and return its value. With ``getter_env`` ({"cache_dir", "files": {desktop path:
        local path}}; {} for None) ``name`` is OSWorld's getter desktop_env.evaluators.getters.<module>.<name>,
        called with a stand-in env first (see metric_worker). Raises KeyError for an unknown name; MetricError
        when the function raises (``error_type`` names its exception; ``MissingLibrary`` when it needs a library
        the venv lacks), times out, or the worker dies twice; MetricEnvError when the venv cannot be built."""
        module = module or OSWORLD_METRICS[name]
        getter = {"getter": True, "env": getter_env or None} if getter_env is not None else {}
        request = json.dumps({"module": module, "func": name, "args": args, "kwargs": kwargs,
                              **getter}).encode() + b"\n"
        with self._lock:
            for attempt in (1, 2):  # a worker found dead is replaced once and the request sent again
                if self._proc is None or self._proc.poll() is not None:
                    self._proc = self._start()
                proc = self._proc
                try:
                    assert proc.stdin is not None
                    proc.stdin.write(request)
                    proc.stdin.flush()
                    line = self._readline(proc, time.monotonic() + self.timeout)
                    break
                except (_WorkerExited, BrokenPipeError) as exc:
                    self._kill()
                    if attempt == 2:
                        raise MetricError(f"{name}: {exc}") from exc
                except (MetricError, OSError) as exc:
                    self._kill()
                    raise MetricError(f"{name}: {exc}") from exc
        answer = json.loads(line)
        if not answer.get("ok"):
            raise MetricError(f"OSWorld metric {name} ({module}.py) raised {answer.get('error_type')}: "
                              f"{answer.get('error')}", answer.get("error_type", ""))
        return answer.get("value")

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """Stop the worker (idempotent)."""
        with self._lock:
            if self._proc is not None and self._proc.stdin is not None:
                self._proc.stdin.close()
            self._kill()


_WORKER: MetricWorker | None = None
_WORKER_LOCK = threading.Lock()


def shared_worker() -> MetricWorker:
    """This process's MetricWorker (created on first use; its process ends with ours: stdin closes)."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = MetricWorker()
        return _WORKER


async def call_metric(name: str, args: list, kwargs: dict, worker: MetricWorker | None = None) -> Any:
    """:meth:`MetricWorker.call` in a thread (default: :func:`shared_worker`)."""
    return await asyncio.to_thread((worker or shared_worker()).call, name, args, kwargs)


async def call_osworld_getter(module: str, name: str, config: dict, env: dict | None = None) -> Any:
    """OSWorld's own getter ``desktop_env.evaluators.getters.<module>.<name>(env, config)`` run in the shared
    worker (a thread waits on it); ``env`` as in :meth:`MetricWorker.call`'s ``getter_env``. Raises MetricError
    when it raises."""
    return await asyncio.to_thread(shared_worker().call, name, [config], {}, module, getter_env=env or {})
