"""Screen recording for the controller: ffmpeg x11grab into one file, stopped and handed back on request.

Facts mirrored from OSWorld desktop_env/server/main.py (routes /start_recording, /end_recording): one recording
at a time into /tmp/recording.mp4 (an older file is deleted first), ``ffmpeg -y -f x11grab -draw_mouse 1
-s WxH -i DISPLAY -c:v libx264 -r 30 FILE``; starting while one runs is an error (400); stopping sends SIGINT so
ffmpeg finalises the file (SIGKILL after 15 s), and answers the file's bytes; stopping with none running is an
error (400); an empty or missing file is an error (500).

Ours: the file is capped at the controller's file limit (ffmpeg ``-fs``, so /end_recording can always send it);
ffmpeg runs in its own session with oom_score_adj 1000; start waits until ffmpeg has opened its output (or
died: its last stderr lines are the error) instead of a fixed 2 s; :meth:`Recorder.stop_quietly` (called by
/reset) ends a recording without keeping the file. Where ffmpeg is not installed (the default image) start
raises :class:`NoFfmpeg` naming the image that has it.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time

from processes import deprioritise

RECORDING_PATH = "/tmp/recording.mp4"
START_DEADLINE_S = 10.0
STOP_DEADLINE_S = 15.0
STDERR_TAIL = 4096
_READY_MARKERS = (b"Output #0", b"frame=")


class NoFfmpeg(RuntimeError):
    """ffmpeg is not installed in this desktop image."""


class RecordingError(RuntimeError):
    """A recording request that cannot be served; ``status`` is the HTTP status OSWorld answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Recorder:
    """The desktop's one screen recording (thread-safe).

    Args:
        display: the X display to grab, e.g. ":0".
        max_bytes: largest file ffmpeg may write (its ``-fs``); the recording stops there.
    """

    def __init__(self, display: str, max_bytes: int) -> None:
        self.display = display
        self.max_bytes = max_bytes
        self._proc: subprocess.Popen | None = None
        self._stderr = bytearray()
        self._ready = threading.Event()
        self._lock = threading.Lock()

    def start(self, width: int, height: int) -> None:
        """Start recording the ``width`` x ``height`` screen into RECORDING_PATH.

        Raises:
            NoFfmpeg: ffmpeg is missing.
            RecordingError: 400 when a recording is already running; 500 when ffmpeg exits before it records
                (its stderr tail is the message).
        """
        exe = shutil.which("ffmpeg")
        if exe is None:
            raise NoFfmpeg("ffmpeg is not installed in this desktop image; the osworld image has it "
                           "(`arpo desktop build --profile osworld`, actors.image_profile = \"osworld\")")
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                raise RecordingError(400, "Recording is already in progress.")
            try:
                os.remove(RECORDING_PATH)
            except FileNotFoundError:
                pass
            self._stderr, self._ready = bytearray(), threading.Event()
            cmd = [exe, "-y", "-nostdin", "-f", "x11grab", "-draw_mouse", "1", "-s", f"{width}x{height}",
                   "-i", self.display, "-c:v", "libx264", "-r", "30", "-fs", str(self.max_bytes), RECORDING_PATH]
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, start_new_session=True)
            deprioritise(self._proc.pid)
            threading.Thread(target=self._drain, args=(self._proc, self._stderr, self._ready), daemon=True).start()
            proc, ready = self._proc, self._ready
        deadline = time.monotonic() + START_DEADLINE_S
        while not ready.wait(0.05):
            if proc.poll() is not None or time.monotonic() > deadline:
                self.stop_quietly()
                tail = bytes(self._stderr[-1500:]).decode("utf-8", "replace")
                raise RecordingError(500, "Failed to start recording. ffmpeg terminated unexpectedly. "
                                          f"Error: {tail}")

    @staticmethod
    def _drain(proc: subprocess.Popen, tail: bytearray, ready: threading.Event) -> None:
        """Read ffmpeg's stderr to its end (it would block on a full pipe), keep the last STDERR_TAIL bytes, and
        set ``ready`` once ffmpeg reports its output open."""
        assert proc.stderr is not None
        while True:
            chunk = proc.stderr.read1(65536)
            if not chunk:
                break
            tail += chunk
            del tail[:-STDERR_TAIL]
            if not ready.is_set() and any(m in tail for m in _READY_MARKERS):
                ready.set()
        proc.stderr.close()

    def stop(self) -> str:
        """Stop the recording and return the path of the finished file.

        Raises:
            RecordingError: 400 when none is running; 500 when ffmpeg had to be killed or left no file.
        """
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            raise RecordingError(400, "No recording in progress to stop.")
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RecordingError(500, "Recording process was unresponsive and had to be killed. Stderr: "
                                 + bytes(self._stderr[-1500:]).decode("utf-8", "replace")) from None
        if not os.path.exists(RECORDING_PATH) or os.path.getsize(RECORDING_PATH) == 0:
            raise RecordingError(500, "Recording failed. The output file is missing or empty. ffmpeg stderr: "
                                 + bytes(self._stderr[-1500:]).decode("utf-8", "replace"))
        return RECORDING_PATH

    def stop_quietly(self) -> None:
        """Kill a running recording, if any, without keeping its file (for /reset)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
