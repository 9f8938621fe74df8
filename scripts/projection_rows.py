"""What a verify's rows cost in the dots alone: the widened stories260K target's four projection
shapes of one layer (bf16 weights stored [out, in], as the CPU execution layout stores them,
float32 accumulation), 12 weights of each shape per step of a jitted fori_loop of 20 steps, at
M = 2 rows (a one-token step: one-row bf16 products run as two) and M = 5, 8 (a K = 4, 7
verify); the median of 9 round-robin repeats, microseconds per dot.

    python scripts/projection_rows.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

SHAPES = [(768, 2048), (768, 768), (4096, 768), (1536, 768)]   # w_down, wo, w_gate|up, wqkv
ROWS = [2, 5, 8]


def loop(rows: int, out: int, inn: int):
  ws = [jax.random.normal(jax.random.key(i), (out, inn), jnp.float32).astype(jnp.bfloat16)
        for i in range(12)]
  x0 = jnp.ones((rows, inn), jnp.bfloat16)

  def run(ws, x):
    def body(_, x):
      acc = jnp.zeros((rows, inn), jnp.float32)
      for w in ws:
        y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        acc = acc + jnp.tile(y, (1, inn // out + 1))[:, :inn]        # feed the next step
      return acc.astype(jnp.bfloat16)
    return jax.lax.fori_loop(0, 20, body, x)

  fn = jax.jit(run)
  fn(ws, x0).block_until_ready()
  return lambda: fn(ws, x0).block_until_ready()


def main():
  total = {r: 0.0 for r in ROWS}
  for out, inn in SHAPES:
    fns = {r: loop(r, out, inn) for r in ROWS}
    times = {r: [] for r in ROWS}
    for _ in range(9):
      for r in ROWS:
        t = time.perf_counter()
        fns[r]()
        times[r].append((time.perf_counter() - t) / 240 * 1e6)
    med = {r: sorted(v)[4] for r, v in times.items()}
    for r in ROWS:
      total[r] += med[r]
    print(f"[{out}, {inn}] " + "  ".join(f"M={r}: {med[r]:.0f} us" for r in ROWS))
  print("one layer's four dots, relative to M=2: "
        + "  ".join(f"M={r}: {total[r] / total[2]:.2f}x" for r in ROWS))


if __name__ == "__main__":
  main()
