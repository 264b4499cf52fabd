"""The client must stay importable where torch is absent: it may never import it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


def test_client_does_not_import_torch() -> None:
    result = _run(
        "import client, client.aio, client.blocking, client.__main__, sys; assert 'torch' not in sys.modules"
    )
    assert result.returncode == 0, result.stderr

