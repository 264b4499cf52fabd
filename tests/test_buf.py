"""buf on the contract: `buf lint` (STANDARD rules, buf.yaml) and `buf breaking` against the
contract as last released (protos/RELEASED: the tag and its commit).

buf is the npm package @bufbuild/buf (the binary ships inside it), pinned in
client/typescript/package.json and installed by `make install-test`. A fresh clone may
not carry tags, so the check falls back to the released commit by its sha; a shallow
clone that lacks that commit fails with a message saying so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROTOS = REPO / "protos"
RELEASED = PROTOS / "RELEASED"
BUF = REPO / "client" / "typescript" / "node_modules" / ".bin" / "buf"
CONTRACT = "modelexec/v1/executor.proto"


def buf(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    if not BUF.exists():
        pytest.fail(f"{BUF.relative_to(REPO)} is missing: run `make install-test` (npm ci in client/typescript)")
    return subprocess.run([str(BUF), *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=120)


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False, timeout=60)


def released() -> tuple[str, str]:
    """(tag, full commit sha) from protos/RELEASED."""
    tag, sha = RELEASED.read_text().split()
    assert len(sha) == 40 and all(c in "0123456789abcdef" for c in sha), f"{RELEASED}: not a full sha: {sha}"
    return tag, sha


def git_dir() -> str:
    """The repository's common git directory (the .git folder, also from a worktree)."""
    out = git("rev-parse", "--path-format=absolute", "--git-common-dir")
    if out.returncode != 0:
        pytest.fail(f"not a git checkout ({out.stderr.strip()}): the breaking check needs the repository's history")
    return out.stdout.strip()


def released_commit_available(sha: str) -> None:
    if git("cat-file", "-e", f"{sha}^{{commit}}").returncode == 0:
        return
    shallow = git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    if shallow:
        pytest.fail(
            f"this clone is shallow and lacks the released contract's commit {sha} (protos/RELEASED); "
            "clone with full history (`git clone` without --depth) to run the breaking-change check"
        )
    pytest.fail(f"the released contract's commit {sha} (protos/RELEASED) is not in this repository")


def against_input() -> str:
    """The released contract as a buf input: by tag where the clone has it, else by commit."""
    tag, sha = released()
    gd = git_dir()
    tagged = git("rev-parse", "-q", "--verify", f"refs/tags/{tag}^{{commit}}")
    if tagged.returncode == 0:
        assert tagged.stdout.strip() == sha, f"tag {tag} is at {tagged.stdout.strip()}, protos/RELEASED says {sha}"
        return f"{gd}#format=git,tag={tag},subdir=protos"
    released_commit_available(sha)
    return f"{gd}#format=git,ref={sha},subdir=protos"


def by_commit() -> str:
    _, sha = released()
    gd = git_dir()
    released_commit_available(sha)
    return f"{gd}#format=git,ref={sha},subdir=protos"


def test_buf_lint() -> None:
    files = buf("ls-files")
    assert files.returncode == 0, files.stderr
    assert f"protos/{CONTRACT}" in files.stdout.split(), f"buf does not see the contract: {files.stdout!r}"
    out = buf("lint", "--error-format", "text")
    assert out.returncode == 0, f"buf lint failed:\n{out.stdout}{out.stderr}"


def test_buf_lint_reports_violations(tmp_path: Path) -> None:
    """The lint rules of buf.yaml are in force: a bad module next to it fails."""
    module = tmp_path / "protos" / "modelexec" / "v1"
    module.mkdir(parents=True)
    (module / "bad.proto").write_text(
        'syntax = "proto3";\npackage modelexec.v1;\nenum color { RED = 0; }\nmessage thing { int32 Bad_Name = 1; }\n'
    )
    shutil.copy(REPO / "buf.yaml", tmp_path / "buf.yaml")
    out = buf("lint", "--error-format", "json", cwd=tmp_path)
    assert out.returncode != 0
    rules = {json.loads(line)["type"] for line in out.stdout.splitlines() if line.strip()}
    # The last two are STANDARD rules beyond BASIC.
    assert {"ENUM_PASCAL_CASE", "MESSAGE_PASCAL_CASE", "FIELD_LOWER_SNAKE_CASE",
            "ENUM_ZERO_VALUE_SUFFIX", "ENUM_VALUE_PREFIX"} <= rules, out.stdout


@pytest.mark.parametrize("against", [against_input, by_commit], ids=["released", "released-commit"])
def test_buf_breaking_against_released_contract(against) -> None:
    """Everything since the release is additive: no breaking change (buf.yaml: FILE rules)."""
    out = buf("breaking", "protos", "--against", against(), "--error-format", "text")
    assert out.returncode == 0, f"buf breaking against {RELEASED.read_text().strip()} failed:\n{out.stdout}{out.stderr}"


def test_buf_breaking_reports_a_removed_field(tmp_path: Path) -> None:
    """The check compares against the real released files (not an empty input): dropping
    a released field and renaming a released RPC are reported."""
    copy = tmp_path / "protos"
    shutil.copytree(PROTOS, copy)
    proto = copy / CONTRACT
    text = proto.read_text()
    edited = text.replace("  uint32 sequence_length = 2;\n", "", 1).replace("rpc TruncateKv(", "rpc TrimKv(", 1)
    assert edited.count("\n") < text.count("\n") and "rpc TrimKv(" in edited, "the edits no longer apply"
    proto.write_text(edited)
    out = buf("breaking", str(copy), "--against", by_commit(), "--error-format", "text")
    assert out.returncode != 0, out.stdout + out.stderr
    assert "sequence_length" in out.stdout and "TruncateKv" in out.stdout, out.stdout


def test_released_file_names_the_first_release() -> None:
    tag, sha = released()
    assert tag == "modelexec-v1.0.0"
    released_commit_available(sha)
    assert git("cat-file", "-e", f"{sha}:protos/{CONTRACT}").returncode == 0
