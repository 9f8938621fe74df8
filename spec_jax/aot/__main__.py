import sys

from spec_jax.aot.cli import main

sys.exit(main())
