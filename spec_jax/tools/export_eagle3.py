"""python -m spec_jax.tools.export_eagle3 TARGET HEADS OUT [--overwrite]

    # EAGLE-3 heads trained by train.distill_heads -> a folder vLLM and SGLang load
    python -m spec_jax.tools.export_eagle3 ../shared/models/stories260K runs/eagle3 out/eagle3-hf

Loads HEADS (a training out_dir or heads folder, bound to TARGET by its fingerprint), writes OUT
with `sj.drafters.export(drafter, OUT, format="eagle3")` (config.json + model.safetensors,
torch names, [out, in] weights, atomically), reads OUT back with `sj.drafters.load` and prints
the tensors and the max |draft logit difference| against HEADS over a short prompt (exit status
1 above --max-diff, 2 on a ValueError such as heads that are not EAGLE-3).
"""

from __future__ import annotations

import argparse
import sys

from spec_jax.tools.checks import (add_check_flags, head_logits, max_logit_diff, prompt_tokens,
                                    too_far, tool_main)
import spec_jax as sj


def parse_args(argv=None):
  p = argparse.ArgumentParser(
      prog="python -m spec_jax.tools.export_eagle3",
      description="Export EAGLE-3 heads as a public LlamaForCausalLMEagle3 folder.")
  p.add_argument("target", help="the target the heads were trained on (sj.load path)")
  p.add_argument("heads", help="a heads folder or a train.distill_heads out_dir")
  p.add_argument("out", help="the folder to write")
  add_check_flags(p, "reloaded heads' draft logits", max_diff=1e-5)
  return p.parse_args(argv)


def run(args) -> int:
  import json


  target = sj.load(args.target)
  heads = sj.drafters.load(args.heads, target)
  out = sj.drafters.export(heads, args.out, format="eagle3", overwrite=args.overwrite)
  back = sj.drafters.load(out, target)
  config = json.loads((out / "config.json").read_text())
  size = (out / "model.safetensors").stat().st_size
  print(f"wrote {out}: config.json (LlamaForCausalLMEagle3, draft_vocab_size "
        f"{config['draft_vocab_size']} of {config['vocab_size']}), model.safetensors "
        f"({size / 1e6:.2f} MB)")
  written = "eagle_aux_hidden_state_layer_ids" in config
  print(f"  captured target layers: inputs of layers {[i + 1 for i in heads.target_layers]}"
        + (" (written for vLLM as these, for SGLang under eagle_config as the outputs of "
           f"{list(heads.target_layers)})" if written
           else " (the vLLM / SGLang default, not written)"))
  tokens = prompt_tokens(target, args.prompt)
  diff = max_logit_diff(head_logits(heads, target, tokens), head_logits(back, target, tokens))
  print(f"  check: reloaded with sj.drafters.load; max |draft logit diff| over {len(tokens)} "
        f"prompt tokens: {diff:.3g}")
  return too_far("draft logits", args.max_diff) if diff > args.max_diff else 0


def main(argv=None) -> int:
  return tool_main(parse_args, run, argv)


if __name__ == "__main__":
  sys.exit(main())
