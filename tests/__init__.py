import os

from pipeline.common import apply_omp_env

# The test process runs torch and the C kernels with the OpenMP waits the CLI and the served stubs use
# (pipeline/common.py): set here, before tests/conftest.py imports torch and so loads libgomp, which reads them once.
# With libgomp's default spin the tiny models' two-thread kernel calls ran 10-40x slower beside a busy process.
apply_omp_env(os.environ)
