"""The Makefile's promises that no other test reaches: Node.js is asked for before anything
runs, everything installs into the checkout's .venv, and torch's build is chosen out loud."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def bare_path(tmp_path: Path, *tools: str) -> str:
    """A PATH holding only these tools (no node, no npm, no python)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in tools:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return str(bin_dir)


def test_make_test_without_node_says_what_to_install_before_anything_runs(tmp_path):
    path = bare_path(tmp_path, "make", "sh", "bash", "grep")
    done = subprocess.run(["make", "test", "VENV=" + str(tmp_path / "venv")], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PATH": path})
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()
    assert any("make test needs Node.js 20+ and npm" in x and "apt-get install -y nodejs npm" in x for x in message), \
        done.stderr
    assert not (tmp_path / "venv").exists()  # nothing was created or installed first
    assert "pip" not in done.stdout and "venv" not in done.stdout


def test_every_target_runs_from_the_checkouts_virtual_environment():
    """Dry runs (`make -n`) of the README's two commands: each Python command is .venv's."""
    for target in ("serve", "test"):
        done = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        python_lines = [x for x in done.stdout.splitlines() if " -m " in x and "python" in x]
        assert python_lines and all(".venv/bin/python" in x for x in python_lines if "-m venv" not in x), \
            done.stdout


def test_the_torch_step_says_which_build_it_installs():
    done = subprocess.run(["make", "-n", "install-torch", "PY=/nonexistent/python"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    script = done.stdout
    for said in ("NVIDIA GPU found: installing torch", "No NVIDIA GPU: installing torch",
                 "the CPU build from https://download.pytorch.org/whl/cpu", "2.7 GB to download"):
        assert said in script, said
