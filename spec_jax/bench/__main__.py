"""python -m spec_jax.bench (see spec_jax.bench.cli)."""

import sys

from spec_jax.bench.cli import main

if __name__ == "__main__":
  sys.exit(main())
