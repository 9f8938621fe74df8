"""Backend compile seconds of four small generates (chain, tree, governed, sampled), for
comparing XLA flags: run once per setting, each in its own process.

    SPEC_JAX_COMPILE_CACHE=off XLA_FLAGS="--xla_backend_optimization_level=0 \\
        --xla_llvm_disable_expensive_passes=true [--xla_cpu_use_fusion_emitters=false]" \\
        python scripts/compile_cost.py

Prints the first calls' wall time, the backend compile seconds (jax.monitoring) and an md5 of
the tokens (equal tokens across settings: the flag did not change the numerics here).
"""

import collections
import hashlib
import os
import time

import jax

import spec_jax as sj


def main():
  seconds = collections.Counter()
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **_: seconds.update({event: duration}))
  cfg = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2)
  target = sj.init_model(cfg, jax.random.key(1))
  drafter = sj.drafters.DraftModel(sj.init_model(cfg.replace(num_layers=1), jax.random.key(3)))
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
  t0 = time.perf_counter()
  outs = [sj.generate(target, prompts, drafter=drafter, max_new_tokens=16, stop_tokens=[],
                      **kw).tokens
          for kw in (dict(num_draft=3), dict(tree=sj.TreeSpec(3, 2, 6)),
                     dict(num_draft="auto", governor=sj.Governor(ks=(0, 2), schedule=(2, 0))),
                     dict(num_draft=2, sampling=sj.Sampling(1.0)))]
  wall = time.perf_counter() - t0
  print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}: first calls {wall:.1f} s, backend "
        f"compile {seconds['/jax/core/compile/backend_compile_duration']:.1f} s, tokens md5 "
        f"{hashlib.md5(str(outs).encode()).hexdigest()[:8]}")


if __name__ == "__main__":
  main()
