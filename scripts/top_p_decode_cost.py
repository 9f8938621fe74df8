"""What top-p costs a whole decode: SmolLM2-135M-Instruct in bf16, B = 1, T = 1, 64 new tokens,
plain decoding and prompt lookup (K = 4), sj.generate wall time (compiled before timing),
median of 5 interleaved repeats, tokens per second (docs/sampling.md). Run it from a checkout
to time that checkout's sampler (the script puts the current folder first on sys.path).

    python scripts/top_p_decode_cost.py 0.9     # top_p; 1.0 = no filter
"""
import json
import statistics
import sys
import time

import jax

sys.path.insert(0, ".")
import spec_jax as sj  # noqa: E402

top_p = float(sys.argv[1]) if len(sys.argv) > 1 else 0.9
model = sj.load("../shared/models/smollm2-135m-instruct", dtype="bfloat16")
prompt = [[1, 4093, 28, 1812, 314, 253, 1789, 30, 2, 198, 1, 520, 9531, 198]]
cells = {"plain": dict(drafter=None, num_draft=0),
         "ngram K=4": dict(drafter=sj.drafters.NGram(), num_draft=4)}
sampling = sj.Sampling(temperature=1.0, top_p=top_p)
run = lambda kw, seed: sj.generate(model, prompt, sampling=sampling, max_new_tokens=64,
                                   stop_tokens=[], key=jax.random.key(seed), **kw)
for kw in cells.values():
  run(kw, 0)
times = {name: [] for name in cells}
for seed in range(5):
  for name, kw in cells.items():
    t0 = time.perf_counter()
    run(kw, seed)
    times[name].append(time.perf_counter() - t0)
print(json.dumps({"top_p": top_p, **{f"{k} tok/s": round(64 / statistics.median(v), 1)
                                      for k, v in times.items()}}))
