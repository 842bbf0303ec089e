"""The separate Python environment that runs OSWorld's published metric functions unchanged.

OSWorld publishes its evaluators as the PyPI package ``desktop-env`` (1.0.2). It pins torch 2.5 and
transformers 4.35, so it cannot share the training environment: :func:`ensure_env` creates a virtualenv under a
cache folder (default ``~/.cache/arpo/osworld-env``, or ``$ARPO_OSWORLD_ENV``), installs ``desktop-env`` there
with ``--no-deps`` and only the pinned libraries in :data:`REQUIREMENTS` that the supported metric modules use
(from PyPI), with :mod:`arpo_async.pinned_venv`. Libraries that the metric modules import but the supported
metrics never call (audio fingerprints, OCR, PDF rendering) are not installed: :mod:`actors.osworld.metric_worker` puts
a placeholder module in their place (:data:`PLACEHOLDER_MODULES`) that raises a clear error if a metric does call
into it.

Build it ahead of time with ``python -m actors.osworld.metric_env`` (a few minutes, ~700 MB); otherwise the first
evaluation that needs an OSWorld metric builds it. A marker file records what was installed; a changed
:data:`REQUIREMENTS` rebuilds. Concurrent builders are serialised by a lock file.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from arpo_async import pinned_venv

OSWORLD_PACKAGE = "desktop-env==1.0.2"
"""OSWorld's published package (its evaluators' source: desktop_env/evaluators/metrics/*.py)."""

REQUIREMENTS: tuple[str, ...] = (
    "numpy==1.26.4", "pillow==11.0.0", "lxml==5.3.0", "cssselect==1.2.0", "xmltodict==0.14.2",
    "openpyxl==3.1.5", "et-xmlfile==2.0.0", "python-docx==1.1.2", "python-pptx==1.0.2", "XlsxWriter==3.2.0",
    "typing_extensions==4.12.2", "pypdf==5.1.0", "PyPDF2==3.0.1", "rapidfuzz==3.10.1", "beautifulsoup4==4.12.3",
    "soupsieve==2.6", "PyYAML==6.0.2", "odfpy==1.4.1", "defusedxml==0.7.1", "mutagen==1.47.0",
    "tldextract==5.1.3", "requests==2.32.3", "requests-file==2.1.0", "idna==3.10", "filelock==3.16.1",
    "urllib3==2.2.3", "certifi==2024.8.30", "charset-normalizer==3.4.0", "pytz==2024.2",
    "pandas==2.2.3", "python-dateutil==2.9.0.post0", "six==1.16.0", "tzdata==2024.2",
    "scipy==1.14.1", "scikit-image==0.24.0", "networkx==3.4.2", "imageio==2.36.0", "tifffile==2024.9.20",
    "lazy_loader==0.4", "packaging==24.2", "ImageHash==4.3.1", "PyWavelets==1.7.0", "PyMuPDF==1.24.14",
    "requests-toolbelt==1.0.0", "python-dotenv==1.0.1",
    "librosa==0.10.2.post1", "fastdtw==0.3.4", "audioread==3.0.1", "decorator==5.1.1", "joblib==1.4.2",
    "msgpack==1.1.0", "numba==0.60.0", "llvmlite==0.43.0", "soundfile==0.12.1", "cffi==1.17.1", "pycparser==2.22",
    "pooch==1.8.2", "platformdirs==4.3.6", "soxr==0.5.0.post1", "scikit-learn==1.5.2", "threadpoolctl==3.5.0",
    "opencv-python-headless==4.10.0.84",
)
"""Pinned libraries (installed ``--no-deps``; wheels where PyPI has them, odfpy is a pure-Python sdist): what
OSWorld's metric modules general, utils, basic_os, chrome, vlc, gimp, vscode, docs, slides, table, pdf,
thunderbird and others import and the supported metrics use; requests-toolbelt and python-dotenv are what
OSWorld's host-side SetupController (desktop_env/controllers/setup.py) imports besides those. librosa and fastdtw
(with librosa's own dependencies: audioread ... threadpoolctl) run vlc.compare_audios; opencv-python-headless
(``cv2``) runs vlc.compare_videos. fastdtw is a source distribution (pure Python when built without Cython)."""

PLACEHOLDER_MODULES: dict[str, str] = {
    "acoustid": "pyacoustid (audio fingerprint metrics)",
    "borb": "borb (PDF comparison metrics)",
    "pdfplumber": "pdfplumber (PDF text metrics)",
    "easyocr": "EasyOCR (OCR-based document metrics)",
    "formulas": "formulas (spreadsheet formula evaluation)",
    "playwright": "playwright (SetupController's chrome_open_tabs, login and other browser steps)",
    "pydrive": "PyDrive (SetupController's googledrive step)",
}
"""Top-level modules OSWorld's metric modules import but :data:`REQUIREMENTS` leaves out, with what needs them.
The worker installs an import hook giving a placeholder for each (and its submodules); calling anything from one
raises ``MissingLibrary`` naming the library, so only the metrics that need it fail, with that reason."""

DEFAULT_ENV_DIR = Path(os.environ.get("ARPO_OSWORLD_ENV") or Path.home() / ".cache" / "arpo" / "osworld-env")
MARKER = "arpo-osworld-env.txt"
BUILD_TIMEOUT_S = 900.0


class MetricEnvError(RuntimeError):
    """The OSWorld metrics environment could not be built (pip failed, PyPI unreachable, no venv module)."""


def _fingerprint() -> str:
    return pinned_venv.fingerprint(OSWORLD_PACKAGE, *REQUIREMENTS)


def env_python(env_dir: Path | None = None) -> Path:
    """The interpreter of the environment at ``env_dir`` (default :data:`DEFAULT_ENV_DIR`); it may not exist."""
    return pinned_venv.env_python(Path(env_dir or DEFAULT_ENV_DIR))


def is_ready(env_dir: Path | None = None) -> bool:
    """True when the environment exists and was built from the current :data:`REQUIREMENTS`."""
    return pinned_venv.is_ready(Path(env_dir or DEFAULT_ENV_DIR), MARKER, _fingerprint())


def ensure_env(env_dir: Path | None = None, *, base_python: str = sys.executable, log=lambda _msg: None) -> Path:
    """Create (once) the OSWorld metrics virtualenv and return its interpreter's path.

    Args:
        env_dir: where the environment lives (default :data:`DEFAULT_ENV_DIR`).
        base_python: the interpreter that creates the venv (its ``venv`` module; Python >= 3.10).
        log: called with each command run (e.g. ``print``).
    Raises:
        MetricEnvError: the venv or a pip install failed (the message has pip's error).
    """
    return pinned_venv.build(Path(env_dir or DEFAULT_ENV_DIR), marker=MARKER, expected=_fingerprint(),
                             installs=(REQUIREMENTS, (OSWORLD_PACKAGE,)), base_python=base_python,
                             error=MetricEnvError, timeout_s=BUILD_TIMEOUT_S, log=log)


if __name__ == "__main__":
    print(ensure_env(log=print))
