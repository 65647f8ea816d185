import os
import sys

from pipeline.common import apply_omp_env

apply_omp_env(os.environ)  # before torch loads libgomp, which reads it once (pipeline/common.py)

from pipeline.cli import main  # noqa: E402

sys.exit(main())
