"""`python -m bench`: run the performance suite (bench/suite.py); `--help` lists its parts."""

import sys

from bench.suite import main

sys.exit(main())
