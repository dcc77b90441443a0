"""``python -m pagedserve.ops.cpu --check-all-isas``: compile every ISA's kernel units with -Wall
-Werror and link the libraries, running nothing (build.py; ``make check-kernels``, CI)."""

import sys

from pagedserve.ops.cpu.build import main

sys.exit(main())
