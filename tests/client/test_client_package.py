"""The client alone: one pip command installs it, without torch, as `modelexec_client`.

A scheduler in another repository installs the `modelexec-client` distribution that
pyproject.toml builds from client/ and the generated protocol code. Here a copy of the
tracked files is installed into a fresh virtual environment (the same command a user runs
on a checkout; the `installed_client` fixture of tests/conftest.py), and that environment's
Python, started outside the checkout, talks to a real server.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import importlib.util, json, sys
import modelexec_client as mc
from modelexec_client import DecodeInput, ExecutorClient, LogitsPolicy, PrefillInput
with ExecutorClient(sys.argv[1], timeout=30) as c:
    out = c.prefill(PrefillInput([1, 2, 3, 4, 5], logits_policy=LogitsPolicy.argmax()))
    step = c.decode(DecodeInput(out.logits.token_id, out.kv_cache))
    c.release_cache(step.kv_cache)
print(json.dumps({
    "length": step.kv_cache.sequence_length,
    "module": mc.__file__,
    "torch": importlib.util.find_spec("torch") is not None,
    "loaded_torch": "torch" in sys.modules,
    "client": importlib.util.find_spec("client") is not None,
    "generated": importlib.util.find_spec("generated") is not None,
}))
"""


def test_one_pip_command_installs_a_client_without_torch(installed_client, paged_server, tmp_path):
    python, _ = installed_client
    done = subprocess.run([str(python), "-c", SCRIPT, paged_server.address], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # outside the checkout: only what is installed
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["length"] == 6
    assert "site-packages" in facts["module"]
    # No torch installed or loaded, and no generic top-level names that could clash.
    assert facts == {**facts, "torch": False, "loaded_torch": False, "client": False, "generated": False}


def test_its_command_line_tool_answers(installed_client, paged_server, tmp_path):
    tool = installed_client[0].parent / "modelexec-client"
    done = subprocess.run([str(tool), "--target", paged_server.address, "info"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["executor_name"]


def test_the_checkout_and_the_package_share_one_code_base():
    """The installed package is these files: their imports are relative, and the generated
    stubs import their messages relatively, so no file needs rewriting to be installed."""
    offenders = [p.name for p in (REPO / "client").glob("*.py")
                 if p.name != "_proto.py" and any(line.lstrip().startswith(("from client", "import client",
                                                                           "from generated", "import generated"))
                                                  for line in p.read_text().splitlines())]
    assert offenders == []
    stub = (REPO / "generated" / "modelexec" / "v1" / "executor_pb2_grpc.py").read_text()
    assert "from . import executor_pb2" in stub and "from generated" not in stub
