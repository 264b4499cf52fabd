"""`python -m bench`: run the performance suite (bench/suite.py); `--help` lists its parts."""

import sys

from executors.omp_pool import spin_briefly

spin_briefly()  # as `python -m service` does, before torch loads its OpenMP runtime

from bench.suite import main  # noqa: E402  (after the setting above)

sys.exit(main())
