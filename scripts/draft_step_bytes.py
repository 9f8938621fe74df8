"""Bytes a decode step and an EAGLE-3 draft step stream, from configs alone (no weights read):
what the draft vocabulary saves on a small and on an 8B model (docs/real_model.md, "What would
change on an 8B model").

    python scripts/draft_step_bytes.py        # SmolLM2-135M and Llama-3.1-8B, bf16

A target's decode step reads every weight except its input embedding table (a gather reads B
rows of it; a tied table is read whole as the LM head). A draft step of an EAGLE-3 head reads
its decoder layer, its norms and its LM head over the draft vocabulary; `fc` (3 D_target -> D)
runs once per round on the target's captured features, not per draft. Prints each as a share
of the target's step: the per-draft cost a memory-bound accelerator would see, before any
fixed per-step overhead.
"""

import argparse

import numpy as np

from spec_jax.aot import shapes
from spec_jax.drafters.eagle import EAGLE3
from spec_jax.memory import params_bytes

PER_ROUND = ("fc",)          # EAGLE-3 params used once per round, not per draft step


def target_step_bytes(model) -> tuple[int, int]:
  """(bytes streamed per decode step, bytes of the LM head among them)."""
  p = model.params
  total = params_bytes(p)
  if "lm_head" in p:
    return total - params_bytes(p["embed"]), params_bytes(p["lm_head"])
  return total, params_bytes(p["embed"])                       # tied: the table is the LM head


def eagle3_head(target, draft_vocab: int, config: str = None):
  if config:
    return shapes.drafter_from_spec(f"eagle3:{config}", target)
  ids = None if draft_vocab >= target.config.vocab_size else np.arange(draft_vocab)
  return shapes._abstract_drafter(lambda t: EAGLE3.init(t, draft_tokens=ids), target)


def report(name: str, target_config: str, draft_vocabs, head_config: str = None) -> None:
  target = shapes.abstract_model(shapes.target_config(target_config))
  step, head = target_step_bytes(target)
  c = target.config
  print(f"{name}: hidden {c.hidden_size}, {c.num_layers} layers, vocabulary {c.vocab_size}; "
        f"a decode step streams {step / 1e9:.3f} GB, the LM head {head / 1e9:.3f} GB "
        f"= {head / step:.1%} of it")
  for vd in draft_vocabs:
    d = eagle3_head(target, vd, head_config if vd is None else None)
    p = d.params
    per_draft = params_bytes({k: v for k, v in p.items() if k not in PER_ROUND})
    lm = params_bytes(p["lm_head"])
    per_round = params_bytes({k: v for k, v in p.items() if k in PER_ROUND})
    label = f"V_d {d.draft_vocab_size}" + (f" ({head_config})" if vd is None else "")
    print(f"  EAGLE-3 head, {label}: a draft step streams {per_draft / 1e6:.1f} MB "
          f"(LM head {lm / 1e6:.1f} MB) = {per_draft / step:.3f} of a target step; "
          f"fc once a round {per_round / 1e6:.1f} MB = {per_round / step:.3f}")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.parse_args(argv)
  report("SmolLM2-135M-Instruct", "smollm2-135m-instruct", [4096, 8192, 16384, 49152])
  report("Llama-3.1-8B", "llama-3.1-8b", [None, 128256], head_config="eagle3-llama-3.1-8b")


if __name__ == "__main__":
  main()
