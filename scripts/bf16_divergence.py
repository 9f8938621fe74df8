"""How often bf16 greedy speculative output parts from bf16 plain greedy output, and the target's
top-2 logit gap where it does (docs/speed.md, "greedy in bf16").

    python scripts/bf16_divergence.py [--target widened:../shared/models/stories260K] \
        [--drafter draft:../shared/models/salty279K] [--num-draft 4] [--prompts 32] [--new 64]

A verify over K+1 rows and a one-row step may run different kernels and round differently, so
at a near-tie the two can pick different argmaxes. For every prompt: the first position where
the two outputs differ, the top-2 gap of the bf16 model's logits there (computed in float32
from the bf16 weights), and both tokens' distance to the maximum; over every emitted token of
both runs, the distance of the token to the maximum (an argmax has 0).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

import spec_jax as sj
from spec_jax.bench.prompts import prompt_token_lists
from spec_jax.bench.specs import load_model, make_drafter


def reference_logits(ref, prompt, new):
  seq = jnp.asarray([list(prompt) + list(new)], jnp.int32)
  out = sj.forward(ref.params, ref.config, seq, sj.KVCache.zeros(ref.config, 1, seq.shape[1]),
                   jnp.zeros((1,), jnp.int32))
  n = len(prompt)
  return np.asarray(out.logits[0, n - 1:n - 1 + len(new)], np.float64)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--target", default="widened:../shared/models/stories260K")
  ap.add_argument("--drafter", default="draft:../shared/models/salty279K")
  ap.add_argument("--num-draft", type=int, default=4)
  ap.add_argument("--prompts", type=int, default=32)
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  target = load_model(a.target, dtype="bfloat16")
  drafter = make_drafter(a.drafter, target)
  ids, _ = prompt_token_lists(target, "tinystories", a.prompts, 8, 128, 0)
  greedy = sj.Sampling(temperature=0.0)
  plain = sj.generate(target, ids, max_new_tokens=a.new, sampling=greedy, stop_tokens=[]).tokens
  spec = sj.generate(target, ids, drafter=drafter, num_draft=a.num_draft, max_new_tokens=a.new,
                     sampling=greedy, stop_tokens=[]).tokens
  ref = target.astype("float32")          # the bf16 weights, computed without bf16 rounding
  parts, dist, scale = [], [], 0.0
  for prompt, p, s in zip(ids, plain, spec):
    for toks in (p, s):
      lg = reference_logits(ref, prompt, toks)
      scale = max(scale, float(np.abs(lg).max()))
      dist.append(lg.max(-1) - lg[np.arange(len(toks)), toks])
    j = next((i for i, (x, y) in enumerate(zip(p, s)) if x != y), None)
    if j is not None:
      lg = reference_logits(ref, prompt, p[:j + 1])[-1]
      top2 = np.sort(lg)[-2:]
      parts.append({"position": j, "top2_gap": float(top2[1] - top2[0]),
                    "plain_to_max": float(lg.max() - lg[p[j]]),
                    "spec_to_max": float(lg.max() - lg[s[j]])})
  dist = np.concatenate(dist)
  same = sum(p == s for p, s in zip(plain, spec))
  out = {"target": a.target, "drafter": a.drafter, "num_draft": a.num_draft,
         "prompts": len(ids), "new_tokens": a.new, "identical_rows": int(same),
         "rows_that_part": len(parts), "positions": len(ids) * a.new,
         "first_partings": parts, "logit_scale": scale,
         "emitted_to_max": {"max": float(dist.max()), "p99": float(np.quantile(dist, 0.99)),
                            "nonzero_fraction": float((dist > 0).mean())}}
  print(f"{a.target} bf16, {a.drafter} K={a.num_draft}, {len(ids)} prompts x {a.new} tokens: "
        f"{same} rows identical, {len(parts)} part")
  for q in parts:
    print(f"  parts at new token {q['position']}: top-2 gap {q['top2_gap']:.4f} "
          f"(plain's token {q['plain_to_max']:.4f}, speculative's {q['spec_to_max']:.4f} below "
          f"the max; logits up to {scale:.1f})")
  print(f"every emitted token: at most {dist.max():.4f} below the max (p99 "
        f"{np.quantile(dist, 0.99):.4f}; {100 * (dist > 0).mean():.2f} % not the exact argmax)")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
