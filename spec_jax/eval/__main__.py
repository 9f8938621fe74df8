"""python -m spec_jax.eval (see spec_jax.eval.cli)."""

from spec_jax.eval.cli import main

if __name__ == "__main__":
  from spec_jax import distributed
  distributed.exit(main())
