"""Regenerate the Python code for protos/: `python -m generated` (or `--check` to diff).

protoc is pointed at protos/ under the virtual path `generated/`. The one import between
generated modules (the gRPC stubs of their messages) is then made relative, so the same
files work as `generated.modelexec.v1` in the checkout and inside the installed client
package (`modelexec_client.proto`, see pyproject.toml).
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
OUT_PACKAGE = REPO / "generated"
PACKAGE_INITS = ("modelexec/__init__.py", "modelexec/v1/__init__.py")


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Run protoc into out_root (which receives a `generated/` tree); return written files."""
    import grpc_tools
    from grpc_tools import protoc  # build-time dependency only

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    virtual = [f"generated/{p.relative_to(PROTO_ROOT).as_posix()}" for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-Igenerated={PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *virtual,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for init in PACKAGE_INITS:
        (out_root / "generated" / init).touch()
    for stub in (out_root / "generated").rglob("*_pb2_grpc.py"):
        text = stub.read_text()
        relative = re.sub(r"^from generated\.[\w.]+ import (\w+_pb2) as", r"from . import \1 as", text,
                          flags=re.MULTILINE)
        if relative == text:
            raise SystemExit(f"{stub.name}: no generated.* import to make relative; protoc's output changed")
        stub.write_text(relative)
    return sorted(p for p in (out_root / "generated").rglob("*") if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if checked-in code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        fresh = generate(fresh_root)
        rel = [p.relative_to(fresh_root / "generated") for p in fresh]
        if args.check:
            stale = [r for r in rel if not (OUT_PACKAGE / r).exists()
                     or not filecmp.cmp(fresh_root / "generated" / r, OUT_PACKAGE / r, shallow=False)]
            if stale:
                print("stale generated code, run `python -m generated`:", *stale, sep="\n  ")
                return 1
            print(f"generated code is up to date ({len(rel)} files)")
            return 0
        for r in rel:
            (OUT_PACKAGE / r).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(fresh_root / "generated" / r, OUT_PACKAGE / r)
            print("wrote", OUT_PACKAGE.name / r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
