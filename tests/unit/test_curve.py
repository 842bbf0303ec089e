"""The learning curve of a run folder (arpo_cli.curve) and `arpo curve RUN_DIR`, and the comparison of several runs
(`arpo curve RUN_DIR RUN_DIR --to FILE`), on real files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from arpo_cli.curve import (CurveError, held_out, load_records, trailing_means, untrained_success,
                            write_comparison, write_curve)
from arpo_async.metrics import MetricsWriter

REPO = Path(__file__).resolve().parents[2]


def record(step: int, success: float, families: dict[str, float]) -> dict:
    return {"step": step, "policy_version": step, "trajectories": 8, "success_rate": success,
            "family_success": families, "reward_mean": 2 * success - 1, "loss": 0.1, "replay_injections": 0,
            "staleness_mean": 0.5, "wall_s": 30.0 * step}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    for step, (success, families) in enumerate([(0.25, {"grid4": 0.5, "dialogs": 0.0}), (0.5, {"grid4": 0.5}),
                                                (0.375, {"grid4": 0.25, "dialogs": 0.5}), (0.75, {})], start=1):
        metrics.write(record(step, success, families))
    metrics.write({**record(5, 0.5, {"grid4": 1.0}), "reward_mean": float("nan")})  # written as null
    metrics.close()
    return tmp_path


def test_write_curve_writes_a_png(run_dir):
    path = write_curve(run_dir)
    assert path == run_dir / "curve.png"
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width > 0 and image.height > 0
    assert sorted(p.name for p in run_dir.iterdir()) == ["curve.png", "metrics.jsonl"]  # no temp file left


def test_held_out_success_is_drawn_at_the_step_whose_weights_were_evaluated(run_dir):
    metrics = MetricsWriter(run_dir / "metrics.jsonl")
    metrics.write({**record(6, 0.5, {}), "eval_success": 0.25, "eval_step": 0, "eval_policy_version": 0})
    metrics.write({**record(7, 0.5, {}), "eval_success": 0.75})  # without eval_step: at its own step
    # a run that stops as solved ends with the evaluation record of its final weights (no training field)
    metrics.write({"step": 7, "policy_version": 7, "wall_s": 240.0, "eval_success": 1.0, "eval_step": 7})
    metrics.close()
    points = held_out(load_records(run_dir))
    assert (points.step, points.value, points.minutes) == ([0, 7, 7], [0.25, 0.75, 1.0], [3.0, 3.5, 4.0])
    with Image.open(write_curve(run_dir)) as image:
        assert image.format == "PNG"


def test_write_curve_replaces_an_older_curve(run_dir):
    (run_dir / "curve.png").write_bytes(b"old")
    write_curve(run_dir)
    with Image.open(run_dir / "curve.png") as image:
        assert image.format == "PNG"


def test_missing_metrics_is_a_curve_error(tmp_path):
    with pytest.raises(CurveError, match="no metrics.jsonl in"):
        write_curve(tmp_path)


def test_empty_metrics_is_a_curve_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(CurveError, match="has no metrics record"):
        write_curve(tmp_path)
    assert not (tmp_path / "curve.png").exists()


def test_trailing_means():
    assert trailing_means([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert trailing_means([], 5) == []
    with pytest.raises(ValueError):
        trailing_means([1.0], 0)


def arpo_curve(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "arpo_cli.cli", "curve", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_cli_draws_the_curve_and_prints_its_path(run_dir):
    done = arpo_curve(run_dir)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(run_dir / "curve.png")
    with Image.open(run_dir / "curve.png") as image:
        assert image.format == "PNG"


def test_cli_without_metrics_exits_2_with_one_line(tmp_path):
    done = arpo_curve(tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("arpo curve: no metrics.jsonl in") and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "curve.png").exists()


def test_cli_takes_the_run_folder_as_its_argument_and_the_old_out_flag_still_works(run_dir):
    """`arpo curve RUN_DIR`, like `arpo view RUN_DIR`; the old `--out RUN_DIR` still draws, with a deprecation
    note; no folder at all is refused with the syntax."""
    assert "usage: arpo curve [-h] RUN_DIR" in arpo_curve("--help").stdout
    old = arpo_curve("--out", run_dir)
    assert old.returncode == 0 and old.stdout.strip() == str(run_dir / "curve.png")
    assert "--out RUN_DIR is deprecated; write `arpo curve RUN_DIR`" in old.stderr
    none = arpo_curve()
    assert none.returncode == 2 and none.stderr.strip() == ("arpo curve: give a run folder: arpo curve RUN_DIR "
                                                            "(or several, with --to FILE)")


def untrained_run(folder: Path, successes: int, episodes: int) -> Path:
    """A run that took no optimizer step: no metrics.jsonl, only the status.json the learner keeps."""
    folder.mkdir()
    (folder / "status.json").write_text(json.dumps({"trajectories": episodes, "wall_s": 300.0,
                                                    "totals": {"SUCCESS": successes, "TRUNCATED": episodes}}))
    return folder


def test_several_runs_are_compared_in_one_picture_an_untrained_one_from_its_status(run_dir, tmp_path):
    none = untrained_run(tmp_path / "none", 0, 1602)
    out = tmp_path / "compare.png"
    done = arpo_curve(run_dir, none, "--to", out)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    with Image.open(out) as image:
        assert image.format == "PNG" and image.width > image.height
    assert untrained_success(none) == (0.0, 1602, 5.0)
    alone_png = write_comparison([run_dir], tmp_path / "alone.png")
    assert alone_png.read_bytes() != out.read_bytes()  # the untrained run is drawn, not skipped
    assert not (run_dir / "curve.png").exists()  # a comparison leaves the runs' own curves alone
    alone = arpo_curve(run_dir, none)
    assert alone.returncode == 2 and "add --to FILE" in alone.stderr


def test_a_folder_with_neither_records_nor_episodes_is_named(run_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CurveError, match="empty"):
        write_comparison([run_dir, empty], tmp_path / "c.png")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "status.json").write_text('{"totals": [], "trajectories": 3, "wall_s": 1}')  # not a run's status
    with pytest.raises(CurveError, match="no readable status.json"):
        write_comparison([broken], tmp_path / "c.png")
    started = untrained_run(tmp_path / "started", 0, 0)
    with pytest.raises(CurveError, match="no episode has come back yet"):
        write_comparison([started], tmp_path / "c.png")
    assert not (tmp_path / "c.png").exists()
