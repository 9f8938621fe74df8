"""python -m spec_jax.eval (see spec_jax.eval.cli)."""

import sys

from spec_jax.eval.cli import main

if __name__ == "__main__":
  sys.exit(main())
