"""Every requirements file resolves on a stranger's machine: against the public index alone.

This machine's pip configuration adds local indexes and a CPU wheel of torch that has no
Triton dependency; a fresh machine elsewhere sees only PyPI, where torch's CUDA build pins
its own Triton. So each file is resolved, in a clean virtual environment with a current pip,
with no configuration file at all (`PIP_CONFIG_FILE=/dev/null`: `--isolated` alone still
reads the machine-wide ones, such as a constraints file), no other PIP_* variable,
`--ignore-installed` and `--dry-run`: a pin that fights another package's (triton==3.9.0 against torch's 3.7.1, say)
fails here, not on a user's machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FILES = sorted(p.relative_to(REPO).as_posix() for p in [*REPO.glob("requirements*.txt"),
                                                         *REPO.glob("*/requirements*.txt")]
               if "node_modules" not in p.parts)


# No pip configuration file is read (pip's own rule for os.devnull) and no PIP_* variable is seen.
NO_PIP_CONFIG = {**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, "PIP_CONFIG_FILE": os.devnull}


def public_index_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=15).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def clean_pip(tmp_path_factory) -> Path:
    if not public_index_reachable():
        pytest.skip("pypi.org is out of reach: resolution against the public index cannot be checked offline")
    env_dir = tmp_path_factory.mktemp("resolve") / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # A current pip reads wheels' metadata without downloading them (PEP 658), resolves as users'
    # pips do, and trusts the system's certificates (truststore) without a configured `cert`.
    subprocess.run([str(python), "-m", "pip", "install", "--isolated", "--quiet", "--upgrade", "pip"], check=True,
                   capture_output=True, timeout=300)
    return python


def test_the_files_are_found():
    assert {"requirements.txt", "requirements-base.txt", "requirements-test.txt", "requirements-gpu.txt",
            "bench/requirements.txt"} <= set(FILES)


def test_every_requirements_file_resolves_on_the_public_index(clean_pip, tmp_path):
    runs = {}
    for name in FILES:  # in parallel: the slowest (torch and its CUDA libraries) takes ~25 s
        report = tmp_path / (name.replace("/", "_") + ".json")
        runs[name] = (report, subprocess.Popen(
            [str(clean_pip), "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed",
             "--disable-pip-version-check", "--quiet", "--report", str(report), "-r", str(REPO / name)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=NO_PIP_CONFIG))
    resolved = {}
    failures = []
    for name, (report, proc) in runs.items():
        out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            failures.append(f"{name}:\n{out[-2000:]}")
            continue
        resolved[name] = {i["metadata"]["name"].lower(): i["metadata"]["version"]
                          for i in json.loads(report.read_text())["install"]}
    assert not failures, "\n\n".join(failures)
    # The pins that matter, as PyPI resolves them: torch 2.13.0 with the Triton its build pins.
    test = resolved["requirements-test.txt"]
    assert test["torch"] == "2.13.0" and test["grpcio"] == "1.85.1"
    major, minor = (int(x) for x in test["triton"].split(".")[:2])
    assert (3, 6) <= (major, minor) < (4, 0), test["triton"]
    # The GPU check's file brings no torch or Triton: it runs beside the machine's own.
    assert "torch" not in resolved["requirements-gpu.txt"] and "triton" not in resolved["requirements-gpu.txt"]
    assert "torch" not in resolved["requirements-base.txt"]
