"""`python -m bench.gpu_venv DIR`: the GPU check's virtual environment, over the machine's packages.

`make gpu-check` runs on a GPU machine's own torch, Triton and transformers, and adds only the
service's small dependencies. `python -m venv --system-site-packages` alone does not give that
when the machine's python is itself a virtual environment (an image's /opt/torch/.venv, say):
the new environment then sees the base interpreter's site-packages, not the packages beside the
python that made it, and torch is missing. So this also writes a .pth file that adds the making
interpreter's site-packages after the new environment's own (site.addsitedir, so their own .pth
files run too): what pip installs into DIR wins, everything else comes from the machine.
The environment gets no pip of its own (a machine's python may lack ensurepip): the making
python's pip installs into it with `pip --python DIR/bin/python install ...`.

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import site
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

PTH_NAME = "machine-site-packages.pth"


def machine_site_dirs() -> list[str]:
    """The site-packages of the interpreter running this (its venv's, when it is one), in order."""
    dirs = list(site.getsitepackages())
    purelib = sysconfig.get_path("purelib")
    if purelib not in dirs:
        dirs.append(purelib)
    return [d for d in dirs if Path(d).is_dir()]


def make(target: Path) -> Path:
    """Create (or complete) the environment at target; returns its python."""
    python = target / "bin" / "python"
    if not python.exists():
        venv.EnvBuilder(system_site_packages=True, with_pip=False).create(target)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    lines = [f"import site; site.addsitedir({d!r})" for d in machine_site_dirs() if d != purelib]
    (Path(purelib) / PTH_NAME).write_text("\n".join(lines) + "\n")
    return python


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    print(make(Path(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
