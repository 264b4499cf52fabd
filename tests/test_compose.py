"""Dockerfile, .dockerignore and docker-compose.yml, checked without a Docker engine.

- docker-compose.yml validates against the compose-spec schema vendored by
  check-jsonschema, and has what the deployment needs: a GPU executor, a CPU profile,
  replicas without clashes, health checks, the scheduler.
- The health-check command is run for real against servers that are and are not SERVING.
- The Dockerfile and .dockerignore are read for what the image needs.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
HEALTH = "python -m client --target localhost:50051 --timeout 5 health | grep -q '\"SERVING\"'"


def check_jsonschema(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True, text=True, check=False, timeout=120,
    )


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with no variable set."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def command(service: dict) -> list[str]:
    cmd = service["command"]
    return shlex.split(interpolate(cmd)) if isinstance(cmd, str) else [interpolate(c) for c in cmd]


def test_compose_file_matches_the_compose_spec() -> None:
    out = check_jsonschema(COMPOSE)
    assert out.returncode == 0, out.stdout + out.stderr


def test_schema_check_rejects_a_bad_compose_file(tmp_path: Path) -> None:
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(COMPOSE.read_text().replace("    image: modelexec:cuda\n", "    image: modelexec:cuda\n    gpu: yes\n", 1))
    out = check_jsonschema(bad)
    assert out.returncode != 0, out.stdout


def test_gpu_executor(compose: dict) -> None:
    executor = compose["services"]["executor"]
    assert "profiles" not in executor  # the default `docker compose up`
    assert executor["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    cmd = command(executor)
    assert cmd[:3] == ["python", "-m", "service"]
    assert cmd[cmd.index("--device") + 1] == "cuda" and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert executor["build"]["context"] == "."
    assert executor["build"]["args"]["TORCH_VARIANT"].startswith("cu")


def test_cpu_profile(compose: dict) -> None:
    cpu = {name: s for name, s in compose["services"].items() if "cpu" in s.get("profiles", [])}
    assert set(cpu) == {"executor-cpu", "scheduler-cpu"}
    executor = cpu["executor-cpu"]
    cmd = command(executor)
    assert cmd[:3] == ["python", "-m", "service"] and cmd[cmd.index("--device") + 1] == "cpu"
    assert "deploy" not in executor
    assert executor["build"]["args"]["TORCH_VARIANT"] == "cpu"
    assert "executor-cpu" in cpu["scheduler-cpu"]["depends_on"]


def test_tensor_parallel_executor(compose: dict) -> None:
    """One executor over two GPUs: the service spawns rank 1, so the container reserves two."""
    executor = compose["services"]["executor-tp"]
    assert executor["profiles"] == ["tp"]
    cmd = command(executor)
    assert cmd[:3] == ["python", "-m", "service"] and cmd[cmd.index("--device") + 1] == "cuda"
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert executor["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 2
    assert executor["ipc"] == "host"  # NCCL's shared memory between the two ranks


def test_services_can_scale(compose: dict) -> None:
    """No fixed container name or host port, so `--scale executor=3` cannot clash."""
    for name, service in compose["services"].items():
        assert "container_name" not in service, name
        for port in service.get("ports", []):
            assert isinstance(port, str) and ":" not in port, f"{name}: fixed host port {port!r}"


def test_executors_health_check_through_grpc_health(compose: dict) -> None:
    for name in ("executor", "executor-cpu"):
        check = compose["services"][name]["healthcheck"]
        assert check["test"] == ["CMD-SHELL", HEALTH], name
        assert check["start_period"] and check["retries"] >= 1


def test_scheduler(compose: dict) -> None:
    for name, executor in (("scheduler", "executor"), ("scheduler-cpu", "executor-cpu")):
        service = compose["services"][name]
        assert command(service) == ["python", "-m", "client", "schedule", "--targets", f"{executor}:50051",
                                    "--prompts-file", "/data/prompts.txt"], name
        assert service["depends_on"][executor]["condition"] == "service_healthy"
        assert {"source": "prompts", "target": "/data/prompts.txt"} in service["configs"]
        assert "deploy" not in service  # needs no GPU
    prompts = compose["configs"]["prompts"]["content"].splitlines()
    assert len(prompts) >= 2 and all(p.strip() for p in prompts)


def test_schedule_command_takes_the_compose_arguments() -> None:
    """`python -m client schedule` (the reference scheduler) accepts what compose passes."""
    out = subprocess.run([sys.executable, "-m", "client", "schedule", "--help"], cwd=REPO,
                         capture_output=True, text=True, check=False, timeout=60)
    if out.returncode != 0 and "invalid choice" in out.stderr:
        pytest.skip("the reference scheduler (python -m client schedule) is not there yet")
    assert out.returncode == 0, out.stderr
    assert "--targets" in out.stdout and "--prompts-file" in out.stdout


def run_health(address: str) -> int:
    cmd = HEALTH.replace("localhost:50051", address)
    return subprocess.run(["sh", "-c", cmd], cwd=REPO, capture_output=True, check=False, timeout=60).returncode


def test_health_check_command_passes_only_when_serving(make_server) -> None:
    serving = make_server()
    assert run_health(serving.address) == 0
    cold = make_server(warmup_on_start=False)  # NOT_SERVING until a Warmup call
    assert run_health(cold.address) != 0
    serving.stop()
    assert run_health(serving.address) != 0  # nothing listening


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        current += raw.rstrip().removesuffix("\\") + " " if raw.rstrip().endswith("\\") else raw.strip()
        if not raw.rstrip().endswith("\\"):
            lines.append(current)
            current = ""
    return [(line.split(None, 1)[0].upper(), " ".join(line.split()[1:])) for line in lines]


def test_dockerfile() -> None:
    ins = dockerfile_instructions()
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for k, a in ins if k == "ARG" and "=" in a}
    assert [a for k, a in ins if k == "FROM"] == ["${PYTHON_IMAGE}"] and args["PYTHON_IMAGE"] == "python:3.11-slim"
    assert args["TORCH_VARIANT"] == "cpu"
    runs = [a for k, a in ins if k == "RUN"]
    assert any("pip install -r requirements.txt" in r for r in runs)
    assert any(r.startswith("make model") for r in runs)
    assert ("COPY", "requirements.txt requirements-base.txt ./") in ins
    cmd = [a for k, a in ins if k == "CMD"][-1]
    assert cmd.startswith('["python", "-m", "service", "--host", "0.0.0.0"')
    health = [a for k, a in ins if k == "HEALTHCHECK"][-1]
    assert health.endswith("CMD " + HEALTH)


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified: the last matching pattern wins; `!` re-includes; a
    pattern matches a path or any folder above it; `**/` matches any depth."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").strip("/")
        pats = [pat, pat.removeprefix("**/")] if pat.startswith("**/") else [pat]
        for c in candidates:
            if any(fnmatch.fnmatchcase(c, p) or (p != pat and fnmatch.fnmatchcase(c.split("/")[-1], p)) for p in pats):
                ignored = not negate
                break
    return ignored


def test_dockerignore_keeps_what_the_image_needs() -> None:
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    needed = [f for f in tracked if f in {"requirements.txt", "requirements-base.txt", "Makefile", "pyproject.toml"}
              or (f.split("/")[0] in {"service", "executors", "kvcache", "generated", "protos"})
              or (f.startswith("client/") and not f.startswith("client/typescript/"))]
    assert "service/__main__.py" in needed and "executors/gguf_import.py" in needed
    assert [f for f in needed if dockerignored(f, patterns)] == []
    for heavy in ("models/smollm2-135m-instruct/model.safetensors", ".git/HEAD",
                  "client/typescript/node_modules/x.js", "service/__pycache__/x.pyc", "tests/conftest.py"):
        assert dockerignored(heavy, patterns), heavy
