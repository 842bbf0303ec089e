"""Smoke runs of the throughput benchmarks, so none of them silently stops working.

Each runs in its smallest mode as a user would (`python -m bench.<name> ...`, from the repository root) and must
exit 0 and end with the key=value figures line it exists for. Figures are not checked (tests check behaviour, not
timings).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent

pytestmark = pytest.mark.docker


def run_bench(name: str, *args: str, timeout: float) -> dict[str, str]:
    """Run ``python -m bench.<name>`` with ``args``; its last line's key=value figures. Fails with the output's
    tail."""
    proc = subprocess.run([sys.executable, "-m", f"bench.{name}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    figures = dict(item.split("=", 1) for item in last.split() if "=" in item)
    assert figures and len(figures) == len(last.split()), f"last line is not key=value figures: {last!r}"
    return figures


def test_bench_transport_quick():
    figures = run_bench("bench_transport", "--quick", timeout=300)
    assert {"traj_per_s", "ratio", "actor_cpu_ms_per_traj", "learner_cpu_ms_per_traj", "encode_ms",
            "decode_validate_ms"} <= set(figures)


def test_bench_prompt_prefix_quick():
    figures = run_bench("bench_prompt_prefix", "--quick", timeout=300)
    assert {"h2_saved_frac", "h15_saved_frac", "h2_prefix_pack_us", "h15_prefix_unpack_us"} <= set(figures)
    assert 0 < float(figures["h2_saved_frac"]) < float(figures["h15_saved_frac"]) < 1


def test_bench_actor_loop_quick():
    """One configuration (128 actors, 0.5 s latency), with and without the PromptEncoder, and its reference run:
    every part of the benchmark, not the default grid of four."""
    figures = run_bench("bench_actor_loop", "--quick", "--actors", "128", "--latency", "0.5", timeout=600)
    ratios = [k for k in figures if k.startswith("ratio_")]
    assert ratios and all(f"settle_p50_{k[len('ratio_'):]}" in figures for k in ratios), figures
    # its stand-in desktop settles as a real one does (0.1-0.3 s): it no longer waits out the 2 s timeout every step
    assert min(float(v) for k, v in figures.items() if k.startswith("settle_p50_")) < 2.0, figures


@pytest.fixture(scope="module")
def gpu_model_quick() -> subprocess.CompletedProcess:
    """One `bench_gpu_model --quick` run of every schedule, with the sensitivity table's episode.action_s row (20 +
    60 modelled seconds per run): the two tests below read its output (one start of the benchmark, not two)."""
    proc = subprocess.run([sys.executable, "-m", "bench.bench_gpu_model", "--quick", "--sensitivity",
                           "--sensitivity-params", "episode.action_s", "--sensitivity-window", "20", "60"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def test_bench_gpu_model_quick(gpu_model_quick):
    """The GPU timing model through the real actors and learner, every schedule; the last line leads with the
    two figures the issue names."""
    last = gpu_model_quick.stdout.strip().splitlines()[-1]
    figures = dict(item.split("=", 1) for item in last.split() if "=" in item)
    assert figures and len(figures) == len(last.split()), f"last line is not key=value figures: {last!r}"
    assert list(figures)[:2] == ["async_over_lockstep", "achieved_over_ideal"]
    schedules = ("lockstep", "arpo", "eta1", "eta2", "eta4")
    assert {f"{s}_traj_per_min" for s in schedules} <= set(figures)
    assert all(float(figures[f"{s}_traj_per_min"]) > 0 for s in schedules)
    assert figures["best"] in ("eta1", "eta2", "eta4")  # the synchronous ones are what it is measured against
    assert float(figures["async_over_arpo"]) == pytest.approx(
        float(figures[f"{figures['best']}_traj_per_min"]) / float(figures["arpo_traj_per_min"]), rel=0.01)


def test_bench_gpu_model_sensitivity_compares_the_best_async_schedule_with_each_synchronous_one(gpu_model_quick):
    """--sensitivity with one parameter: a table row with the ratio at x0.5 and x2 against lockstep and arpo."""
    lines = gpu_model_quick.stdout.splitlines()
    best = gpu_model_quick.stdout.strip().splitlines()[-1].split(" best=")[1].split()[0]
    header = next(i for i, line in enumerate(lines) if line.startswith(f"sensitivity: {best} / lockstep and arpo"))
    row = next(line for line in lines[header:] if line.startswith("episode.action_s")).split()
    assert len(row) == 5 and all(float(v) > 0 for v in row[1:])  # x0.5 and x2 against lockstep, then arpo


def test_bench_gpu_model_refuses_arpo_with_fewer_desktops_than_a_batch():
    """ARPO runs one desktop per trajectory of the batch; a round that could not start all of them together would
    never pass its first step, so the benchmark refuses it before it starts anything."""
    proc = subprocess.run([sys.executable, "-m", "bench.bench_gpu_model", "--quick", "--actors", "8",
                           "--schedules", "lockstep,arpo,eta2"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "16 desktops for 2 groups of 8, not 8" in proc.stderr


def test_bench_gpu_model_real_desktops(desktop_image):
    """--real-desktops: 2 real docker desktops, lockstep and eta 2, 10 s warm-up + 30 s window each (~100 s): the
    real-desktop figures are there and sane, and every container of the run is gone afterwards."""
    figures = run_bench("bench_gpu_model", "--real-desktops", "2", "--quick", "--schedules", "lockstep,eta2",
                        timeout=400)
    assert list(figures)[:2] == ["async_over_lockstep", "achieved_over_ideal"]
    for s in ("lockstep", "eta2"):
        assert float(figures[f"{s}_traj_per_min"]) > 0
        assert 0.99 <= float(figures[f"{s}_act_x"]) < 3  # padded to at least the modelled time
        assert 0 <= float(figures[f"{s}_late_share"]) <= 1
        assert 0 < float(figures[f"{s}_work_p50_ms"]) < 5000  # a real click + screenshot
        assert 0 < float(figures[f"{s}_reset_p50_ms"]) < 10000  # a real POST /reset
    left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=arpo.run={figures['desktop_label']}"],
                          capture_output=True, text=True, check=True).stdout
    assert figures["desktop_label"].startswith("bench-gpu-") and not left.strip()


def test_bench_desktops_quick(desktop_image):
    """Every part of the benchmark once, at its smallest: 2 starts, 2 resets of each kind, 2 desktops in the
    capacity probe (the live probe's bigger steps are test_bench_desktops_live_small's)."""
    figures = run_bench("bench_desktops", "--quick", "--starts", "2", "--resets", "2", "--shots", "3",
                        "--actions", "3", "--max-desktops", "2", timeout=600)
    assert {"start_p50_s", "reset_inplace_p50_s"} <= set(figures)


def test_bench_desktops_live_small(desktop_image):
    """`--live` in two small steps: the last line starts with the fixed names, and every desktop answered."""
    figures = run_bench("bench_desktops", "--live", "2,3", "--concurrency", "2", "--window-s", "2", timeout=600)
    assert list(figures)[:4] == ["live", "ram_mb_per_desktop", "start_per_s", "healthy"]
    assert figures["live"] == figures["healthy"] == "3" and figures["start_failures"] == "0"
    assert "live_2_start_per_s" in figures


def test_bench_e2e_one_short_arm(desktop_image, tmp_path):
    figures = run_bench("bench_e2e", "--arms", "async", "--minutes", "0.5", "--out", str(tmp_path), timeout=600)
    assert figures


def test_bench_learner_quick():
    figures = run_bench("bench_learner", "--quick", timeout=600)
    assert {"ours_tok_s", "plain_tok_s", "ratio", "ranks2_tok_s", "rss_mb_1", "rss_mb_2", "publish_disk_s",
            "publish_dist_s", "publish_disk_f32_s", "publish_dist_f32_s", "publish_mb", "publish_f32_mb",
            "publish_disk_mb", "publish_disk_f32_mb", "publish_bytes_ratio"} == set(figures)
    assert float(figures["publish_bytes_ratio"]) == 0.5  # the bf16 server got bf16: half the float32 bytes


def test_bench_real_size_quick():
    figures = run_bench("bench_real_size", "--quick", "--fsdp", timeout=600)
    assert {"params_b", "tokens", "images", "step_s", "step_tok_s", "peak_gb", "dist_s", "dist_gb", "dist_gb_s",
            "disk_s", "disk_gb", "disk_gb_s", "ratio"} == set(figures)
    # bf16 went out (the server holds bf16): about 2 bytes a weight, where the float32 masters would be 4
    assert float(figures["dist_gb"]) < 2.05 * float(figures["params_b"])


def test_bench_learning_one_short_arm(desktop_image, tmp_path):
    figures = run_bench("bench_learning", "--arms", "a", "--seeds", "1", "--minutes", "0.5", "--out",
                        str(tmp_path), timeout=600)
    assert any(k.startswith("a_") for k in figures)
    assert (tmp_path / "learning-grid4.png").is_file()


def test_probe_learning_three_batches(desktop_image):
    figures = run_bench("probe_learning", "--steps", "3", "--arms", "a,c", timeout=600)
    assert any(k.startswith("a_") for k in figures) and any(k.startswith("c_") for k in figures)
    # each arm's batches take its updates_per_batch optimizer steps (a: 2, c: ARPO's 2), as in the learner
    assert figures.get("a_steps_per_batch") == "2" and figures.get("c_steps_per_batch") == "2"


def test_probe_learning_chance_mode_samples_the_untrained_policy(desktop_image):
    """--chance takes no optimizer step and reports each task's chance success rate (issue 25 item 1)."""
    figures = run_bench("probe_learning", "--steps", "3", "--arms", "a", "--chance", timeout=600)
    assert "a_steps_per_batch" not in figures  # no batch was trained
    chances = {k: float(v) for k, v in figures.items() if k.startswith("chance_")}
    assert set(chances) == {f"chance_grid4-{c}" for c in ("blue", "green", "red", "yellow")}
    assert all(0.0 <= v <= 1.0 for v in chances.values())


def test_fuzz_wire_smoke():
    figures = run_bench("fuzz_wire", "--cases", "500", timeout=120)
    assert figures["cases"] == "500" and figures["crashes"] == "0" and figures["wrong_accepts"] == "0"


def test_osworld_coverage_quick():
    """Our own OSWorld-format tasks in one default-image desktop: every one loads and gets a stage; with a
    stand-in mirror (--stand-in) the task that downloads its file sets up from it and evaluates untouched."""
    figures = run_bench("osworld_coverage", "--quick", "--stand-in", timeout=600)
    assert int(figures["tasks"]) >= 7 and figures["load"] == figures["tasks"]
    assert int(figures["evaluate"]) >= 1
    assert figures["stand_in_files"] == "2" and int(figures["download_ok"]) >= 1  # arpo-os-download's two files


def test_bench_learning_poses_a_multi_step_family_with_its_number_of_actions():
    """`python -m bench.bench_learning --family settings` trains the 2-step family with 2-step episodes (and
    settings-apply with 3), one group per task, as configs/multistep.toml does."""
    from arpo_async.config import load_config
    from tests.learning_arms import TASK_SETUP, check_tasks, task_selection

    for family, actions in (("settings", 2), ("settings-apply", 3)):
        name, selection = task_selection(family)
        tasks = check_tasks(selection)
        assert name == family and tasks and {t.family for t in tasks} == {family}
        config = load_config(None, TASK_SETUP + selection)  # the family's overrides win over the one-click setup
        assert config.actors.max_steps == actions and config.learner.groups_per_step == len(tasks)


def test_bench_hosts_quick():
    """2 x 32 actors on two hosts (network namespaces where this machine can make them) against the real learner:
    nothing lost, every queue within its bound, and the lag figures present."""
    figures = run_bench("bench_hosts", "--quick", timeout=600)
    assert figures["actors"] == "64" and figures["hosts"] == "2"
    assert figures["lost"] == "0" and figures["unbounded"] == "0"
    assert int(figures["steps"]) >= 1 and int(figures["trajectories"]) >= 1
    assert {"loop_lag_p99_ms", "max_queue_depth", "idle_lag_p99_ms"} <= set(figures)


def test_bench_eval_quick():
    """`arpo eval` throughput: the real command at 1 and 2 desktops; every figure is there and positive."""
    figures = run_bench("bench_eval", "--quick", timeout=600)
    assert {f"d{n}_{k}" for n in (1, 2) for k in ("episodes_per_min", "desktop_busy", "scaling")} == set(figures)
    assert all(float(v) > 0 for v in figures.values())
