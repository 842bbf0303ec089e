"""The files a task set names (actors/osworld/task_files.py), on five real OSWorld task files and hostile ones."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from actors.osworld.task_files import EVALUATOR, SETUP, TaskFile, scan_task_files, task_files
from arpo_async.task_sets import load_task_set

DATA = Path(__file__).resolve().parents[1] / "data" / "tasks" / "osworld_files"


def test_real_tasks_name_their_files_in_the_mirror_layout():
    files = task_files(load_task_set(DATA))
    by_path = {str(f.relpath): f for f in files}
    calc = "libreoffice_calc/0bf05a7d-b28b-44d2-955a-50b41e24012a"
    assert by_path[f"{calc}/Customers_New_7digit_Id.xlsx"].kind == SETUP
    gold = by_path[f"{calc}/Customers_New_7digit_Id_gold-Sheet1.csv"]  # the second of a multi cloud_file
    assert (gold.kind, gold.where) == (EVALUATOR, "evaluator.expected.path[1]")
    assert "id=1h1GnUpyj92K7FXiHJ1xVaUYW_UYMDLPM" in gold.url
    post = by_path["libreoffice_calc/4e6fcf72-daf3-439f-a232-c434ce416af6/Employee_Age_By_Birthday_gold.xlsx"]
    assert (post.kind, post.where) == (SETUP, "evaluator.postconfig[4].parameters.files[0]")
    # a thunderbird file whose id is another task's: the mirror is keyed by the id, as DownloadCache looks it up
    assert "thunderbird/030eeff7-b492-4218-b312-701ec99ee0cc/thunderbird-profile.tar.gz" in by_path
    assert len(files) == 9 and len(by_path) == 9


def _task(folder: Path, domain: str, task_id: str, config: list, evaluator: dict) -> None:
    (folder / domain).mkdir(parents=True, exist_ok=True)
    task = {"id": task_id, "instruction": "x", "config": config,
            "evaluator": {"func": "compare_table", **evaluator}}
    (folder / domain / f"{task_id}.json").write_text(json.dumps(task))


def _download(url, path) -> dict:
    return {"type": "download", "parameters": {"files": [{"url": url, "path": path}]}}


def test_hostile_references_are_left_out_each_with_one_line(tmp_path):
    shutil.copytree(DATA / "multi_apps", tmp_path / "multi_apps")
    _task(tmp_path, "calc", "a", [_download("file:///etc/passwd", "/home/user/p.txt"),
                                  _download("https://h/x", "/home/user/.."),
                                  _download("https://h/y", "/home/user/"),
                                  _download("https://h/ok", "/home/user/ok.xlsx"),
                                  _download("https://h/other", "/tmp/ok.xlsx")],
          {"result": {"type": "cloud_file", "path": ["https://h/1", "https://h/2"], "dest": ["1.xlsx"],
                      "multi": True},
           "expected": {"type": "cloud_file", "path": "https://h/ok", "dest": "ok.xlsx"}})
    _task(tmp_path / "nested", "deeper", "b", [_download("https://h/b", "/home/user/b.xlsx")],
          {"result": {"type": "vm_file", "path": "/home/user/b.xlsx", "dest": "b.xlsx"}})
    (tmp_path / "calc" / "broken.json").write_text("{")
    files, problems = scan_task_files(load_task_set(tmp_path))
    assert TaskFile("calc", "a", "ok.xlsx", "https://h/ok", SETUP, "config[3].parameters.files[0]") in files
    assert not any(f.task_id in ("b", "broken") for f in files)
    assert {f.relpath.parts[0] for f in files} == {"calc", "multi_apps"}
    text = "\n".join(problems)
    for expected in ("calc/a: config[0].parameters.files[0]: 'file:///etc/passwd' is not an http(s) URL",
                     "calc/a: config[1].parameters.files[0]: file name '..' is not a file name",
                     "calc/a: config[2].parameters.files[0]: file name empty or not a string",
                     "calc/a: config[4].parameters.files[0]: calc/a/ok.xlsx is also named with another URL",
                     "calc/a: evaluator.result.path: a cloud_file with multi needs 'path' and 'dest' lists",
                     "nested/deeper/b: config[0].parameters.files[0]: domain 'nested/deeper' holds '/'",
                     "calc/broken: not loaded"):
        assert expected in text, (expected, problems)
    assert len(problems) == 7, problems
