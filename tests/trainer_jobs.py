"""The trainers' own jobs that wrote fixtures/trainers/, run from the tests: importing a job
script (it imports its trainer only when a job runs) and running one of its functions on gloo
ranks."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from conftest import FIXTURES_DIR
from make_fixtures import run_gloo_job

TRAINER_FIXTURES = FIXTURES_DIR / "trainers"


def import_job(name: str):
    """fixtures/trainers/<name>.py, importable here and in the job's spawned ranks."""
    if str(TRAINER_FIXTURES) not in sys.path:
        sys.path.insert(0, str(TRAINER_FIXTURES))
    return importlib.import_module(name)


def run_job(function, world_size: int, *args, out_file: Path) -> dict:
    """function(rank, world_size, *args, out_file) on world_size gloo ranks; the JSON its rank 0
    wrote to out_file."""
    run_gloo_job(world_size, function, *args, str(out_file))
    return json.loads(out_file.read_text())
