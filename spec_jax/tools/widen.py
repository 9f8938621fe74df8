"""python -m spec_jax.tools.widen SRC OUT [sizes] [--heads RUN_DIR --heads-out DIR]

    # stories260K as a 78M-parameter Hugging Face llama folder with the same logits
    python -m spec_jax.tools.widen ../shared/models/stories260K out/stories260K-78M \\
        --hidden-size 768 --intermediate-size 2048 --num-layers 12
    # a plain conversion (llama2.c .bin -> Hugging Face folder): no size flags
    python -m spec_jax.tools.widen ../shared/models/salty279K out/salty279K-hf
    # heads trained on stories260K, widened with it (loadable with sj.drafters.load(DIR, OUT))
    python -m spec_jax.tools.widen ../shared/models/stories260K out/s78M --hidden-size 768 \\
        --intermediate-size 2048 --num-layers 12 --heads runs/eagle3 --heads-out out/s78M-eagle3

Writes OUT with `spec_jax.models.hf_export.save_hf` (sj.load and transformers'
AutoModelForCausalLM both read it), reloads it, and prints the parameter count and the max
|logit difference| between OUT and SRC on a short prompt (exit status 1 when a float32 model
differs by more than --max-diff). Size flags left out keep the source's value; head_dim defaults
to 64 when --hidden-size widens (else, or when 64 is not a multiple of it, the source's), with
num_heads = hidden_size // head_dim and the source's GQA group size; see
`spec_jax.models.widen`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys


from spec_jax.tools.checks import (add_check_flags, head_logits, max_logit_diff, num_params,
                                    prompt_tokens, target_logits, too_far, tool_main)
import spec_jax as sj
from spec_jax.drafters.formats import heads_folder
from spec_jax.drafters.widening import widen_heads
from spec_jax.models.hf_export import save_hf
from spec_jax.models.widen import widen


def parse_args(argv=None):
  p = argparse.ArgumentParser(
      prog="python -m spec_jax.tools.widen",
      description="Widen a model exactly (or just convert it) into a Hugging Face folder; "
                  "optionally widen its trained heads.")
  p.add_argument("src", help="source model: Hugging Face folder, llama2.c folder or .bin")
  p.add_argument("out", help="output folder (Hugging Face layout)")
  p.add_argument("--hidden-size", type=int, help="new hidden size D (default: the source's)")
  p.add_argument("--intermediate-size", type=int, help="new MLP width F (default: the source's)")
  p.add_argument("--num-layers", type=int, help="new layer count L (default: the source's)")
  p.add_argument("--head-dim", type=int,
                 help="new head_dim (default 64 with --hidden-size, else the source's)")
  p.add_argument("--num-heads", type=int, help="q heads (default hidden_size // head_dim)")
  p.add_argument("--num-kv-heads", type=int,
                 help="kv heads (default num_heads / the source's GQA group size)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), help="convert the params")
  p.add_argument("--heads", help="a heads folder or training out_dir trained on SRC")
  p.add_argument("--heads-out", help="where to save the widened heads (default OUT/heads)")
  add_check_flags(p, "logits (float32 models only)", max_diff=1e-3)
  return p.parse_args(argv)


def check_heads_out(args) -> None:
  """ValueError, before anything is written, for a --heads-out the run would misuse: without
  --heads, the source heads' own folder, or a non-empty folder without --overwrite (OUT's
  rule)."""
  if args.heads_out is None:
    return
  if not args.heads:
    raise ValueError("--heads-out is where the widened --heads go: give --heads too")
  out = pathlib.Path(args.heads_out).expanduser().resolve()
  source = pathlib.Path(args.heads).expanduser().resolve()
  if out in (source, source / "heads"):
    raise ValueError(f"--heads-out {args.heads_out} is the source heads' folder; the widened "
                     f"heads would replace the heads trained on SRC: give another folder")
  if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
    raise ValueError(f"--heads-out {args.heads_out} exists and is not empty; pass --overwrite "
                     f"to replace the heads in it")


def or_source(value, source):
  """A size flag: the source's value when left out (0 is a bad size, not "the source's")."""
  return source if value is None else value


def run(args) -> int:
  check_heads_out(args)
  src = sj.load(args.src, dtype=args.dtype)
  c = src.config
  sizes = (args.hidden_size, args.intermediate_size, args.num_layers, args.head_dim,
           args.num_heads, args.num_kv_heads)
  if any(s is not None for s in sizes):
    head_dim = args.head_dim
    if head_dim is None:   # realistic heads for a wider model; the source's for a deeper one
      widening = args.hidden_size not in (None, c.hidden_size)
      head_dim = 64 if widening and 64 % c.head_dim == 0 else c.head_dim
    model = widen(src, or_source(args.hidden_size, c.hidden_size),
                  or_source(args.intermediate_size, c.intermediate_size),
                  or_source(args.num_layers, c.num_layers), head_dim=head_dim, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads)
    what = "widened"
  else:
    model, what = src, "converted"
  heads = wide_heads = None
  if args.heads:                    # fail before writing: heads that do not load or widen
    heads = sj.drafters.load(args.heads, src)
    wide_heads = widen_heads(heads, src, model)
  out = save_hf(model, args.out, overwrite=args.overwrite)
  wide = sj.load(out)
  w = wide.config
  files = ", ".join(f"{p.name} ({p.stat().st_size / 1e6:.1f} MB)" if p.stat().st_size > 1e6
                    else p.name for p in sorted(out.iterdir()) if p.is_file())
  print(f"wrote {out} ({what} {args.src}, Hugging Face {w.model_type} folder): {files}")
  print(f"  params: {num_params(wide.params):,} (source {num_params(src.params):,}); hidden "
        f"{w.hidden_size}, intermediate {w.intermediate_size}, layers {w.num_layers}, heads "
        f"{w.num_heads} x {w.head_dim}, kv heads {w.num_kv_heads}, {w.dtype}")
  tokens = prompt_tokens(src, args.prompt)
  a, b = target_logits(src, tokens), target_logits(wide, tokens)
  diff = max_logit_diff(a, b)               # inf for a NaN: it fails the check
  same = bool((a.argmax(-1) == b.argmax(-1)).all())
  print(f"  check: max |logit diff| vs the source over {len(tokens)} prompt tokens: {diff:.3g}; "
        f"argmax identical: {'yes' if same else 'NO'}")
  failed = w.dtype == "float32" and diff > args.max_diff

  if heads is not None:
    heads_out = pathlib.Path(args.heads_out) if args.heads_out else out / "heads"
    heads_folder.save(heads_out, wide_heads, wide, num_draft=wide_heads.trained_num_draft,
                      extra={"widened_from": {"heads": str(args.heads), "target": str(args.src)}})
    reloaded = sj.drafters.load(heads_out, wide)
    hd = max_logit_diff(head_logits(heads, src, tokens), head_logits(reloaded, wide, tokens))
    print(f"wrote {heads_out} ({heads.kind} heads for {out}); check: max |draft logit diff| vs "
          f"the source heads: {hd:.3g}")
    failed = failed or (w.dtype == "float32" and hd > args.max_diff)
  return too_far("logits", args.max_diff) if failed else 0


def main(argv=None) -> int:
  return tool_main(parse_args, run, argv)


if __name__ == "__main__":
  sys.exit(main())
