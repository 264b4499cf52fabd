"""`python -m executors.cpu_kernels`: build the CPU kernels into the cache now (make install
does), or say why they cannot be built on this machine."""

import sys

from executors.cpu_kernels.build import KernelsUnavailable, build_library

try:
    print(f"CPU kernels: {build_library()}")
except KernelsUnavailable as e:
    print(f"CPU kernels not built (the service will use torch's matmuls): {e}")
    sys.exit(0)
