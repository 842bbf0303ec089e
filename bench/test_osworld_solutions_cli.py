"""bench.osworld_solutions' command line: a files mirror (``--osworld-files``) reaches the run's config as
``learner.osworld_files``, and a path that is not a folder is refused before anything runs."""
from __future__ import annotations

import pytest

from arpo_async.config import load_config
from bench.osworld_solutions import main, mirror_overrides


def test_the_bench_takes_a_files_mirror_into_the_run_config_and_refuses_one_that_is_not_a_folder(tmp_path, capsys):
    mirror = tmp_path / "mirror with 'quotes' \" and spaces"
    mirror.mkdir()
    assert load_config(None, mirror_overrides(mirror)).learner.osworld_files == str(mirror.resolve())
    assert mirror_overrides(None) == []
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path), "--osworld-files", str(tmp_path / "absent")])
    assert exc.value.code == 2
    assert f"--osworld-files {tmp_path / 'absent'} is not a folder" in capsys.readouterr().err
