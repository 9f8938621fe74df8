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

import numpy as np


def target_logits(model, tokens) -> np.ndarray:
  """float32 logits [T, V] of one forward over `tokens` (a list of ids)."""
  import jax.numpy as jnp
  from spec_jax.models.transformer import KVCache, forward
  toks = jnp.asarray([list(tokens)], jnp.int32)
  cache = KVCache.zeros(model.config, 1, toks.shape[1])
  out = forward(model.params, model.config, toks, cache, jnp.zeros((1,), jnp.int32))
  return np.asarray(out.logits[0])


def head_logits(drafter, model, tokens, steps: int = 2) -> np.ndarray:
  """float32 draft logits of a head drafter over `tokens` on `model`.

  Medusa: [T, K, V], every head at every position. EAGLE / EAGLE-3 / MTP: [steps, T-1, V], the
  head's teacher-forced outputs (step 1) and its own-feature outputs (steps > 1, as when it
  drafts), through `FeatureHead.unroll`. DFlash: [T-1, b-1, V], the block anchored at every
  position but the last (`DFlash.training_hidden`)."""
  import jax.numpy as jnp
  from spec_jax.drafters.medusa import medusa_logits
  from spec_jax.models.transformer import KVCache, forward
  toks = jnp.asarray([list(tokens)], jnp.int32)
  cache = KVCache.zeros(model.config, 1, toks.shape[1])
  layers = getattr(drafter, "target_layers", ())
  out = forward(model.params, model.config, toks, cache, jnp.zeros((1,), jnp.int32),
                return_layers=layers)
  if drafter.kind == "medusa":
    return np.asarray(medusa_logits(drafter.params, out.hidden)[0])
  if drafter.kind == "dflash":
    anchors = jnp.arange(toks.shape[1] - 1, dtype=jnp.int32)[None]
    hidden = drafter.training_hidden(drafter.params, model.params, toks, out.layer_hidden,
                                     anchors)
    return np.asarray(drafter.logits(drafter.params, model.params, hidden[:, :, 1:])[0])
  feats = drafter.target_feature(drafter.params, out.hidden, out.layer_hidden)
  outs = drafter.unroll(drafter.params, model.params, toks, feats, steps=steps)
  return np.stack([np.asarray(drafter.logits(drafter.params, model.params, o)[0]) for o in outs])


def max_logit_diff(a, b) -> float:
  """max |a - b|, where equal infinities (the -inf outside an EAGLE-3 draft vocabulary) count
  as no difference and any other mismatch of infinities as an infinite one."""
  a, b = np.asarray(a), np.asarray(b)
  same_inf = np.isinf(a) & (a == b)
  return float(np.abs(np.where(same_inf, 0.0, a) - np.where(same_inf, 0.0, b)).max())


def _prompt_tokens(model, prompt: str) -> list:
  if model.tokenizer is not None:
    return model.encode(prompt)
  return [model.config.bos_token_id or 0] + [(7 * i + 3) % model.config.vocab_size
                                             for i in range(15)]


def _num_params(params) -> int:
  import jax
  return int(sum(np.size(x) for x in jax.tree.leaves(params)))


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
  p.add_argument("--prompt", default="Once upon a time, there was a little girl named Lily.",
                 help="text of the logits check")
  p.add_argument("--max-diff", type=float, default=1e-3,
                 help="fail (exit 1) when a float32 model's max |logit diff| exceeds this")
  p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
  return p.parse_args(argv)


def run(args) -> int:
  import spec_jax as sj
  from spec_jax.drafters.formats import heads_folder
  from spec_jax.drafters.widening import widen_heads
  from spec_jax.models.hf_export import save_hf
  from spec_jax.models.widen import widen

  src = sj.load(args.src, dtype=args.dtype)
  c = src.config
  sizes = (args.hidden_size, args.intermediate_size, args.num_layers, args.head_dim,
           args.num_heads, args.num_kv_heads)
  if any(s is not None for s in sizes):
    head_dim = args.head_dim
    if head_dim is None:   # realistic heads for a wider model; the source's for a deeper one
      widening = args.hidden_size not in (None, c.hidden_size)
      head_dim = 64 if widening and 64 % c.head_dim == 0 else c.head_dim
    model = widen(src, args.hidden_size or c.hidden_size,
                  args.intermediate_size or c.intermediate_size, args.num_layers or c.num_layers,
                  head_dim=head_dim, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads)
    what = "widened"
  else:
    model, what = src, "converted"
  heads = sj.drafters.load(args.heads, src) if args.heads else None   # fail before writing
  out = save_hf(model, args.out, overwrite=args.overwrite)
  wide = sj.load(out)
  w = wide.config
  files = ", ".join(f"{p.name} ({p.stat().st_size / 1e6:.1f} MB)" if p.stat().st_size > 1e6
                    else p.name for p in sorted(out.iterdir()) if p.is_file())
  print(f"wrote {out} ({what} {args.src}, Hugging Face {w.model_type} folder): {files}")
  print(f"  params: {_num_params(wide.params):,} (source {_num_params(src.params):,}); hidden "
        f"{w.hidden_size}, intermediate {w.intermediate_size}, layers {w.num_layers}, heads "
        f"{w.num_heads} x {w.head_dim}, kv heads {w.num_kv_heads}, {w.dtype}")
  tokens = _prompt_tokens(src, args.prompt)
  a, b = target_logits(src, tokens), target_logits(wide, tokens)
  diff = float(np.abs(a - b).max())
  same = bool((a.argmax(-1) == b.argmax(-1)).all())
  print(f"  check: max |logit diff| vs the source over {len(tokens)} prompt tokens: {diff:.3g}; "
        f"argmax identical: {'yes' if same else 'NO'}")
  failed = w.dtype == "float32" and diff > args.max_diff

  if heads is not None:
    heads_out = pathlib.Path(args.heads_out) if args.heads_out else out / "heads"
    wide_heads = widen_heads(heads, src, wide)
    heads_folder.save(heads_out, wide_heads, wide, num_draft=wide_heads.trained_num_draft,
                      extra={"widened_from": {"heads": str(args.heads), "target": str(args.src)}})
    reloaded = sj.drafters.load(heads_out, wide)
    hd = max_logit_diff(head_logits(heads, src, tokens), head_logits(reloaded, wide, tokens))
    print(f"wrote {heads_out} ({heads.kind} heads for {out}); check: max |draft logit diff| vs "
          f"the source heads: {hd:.3g}")
    failed = failed or (w.dtype == "float32" and hd > args.max_diff)
  if failed:
    print(f"error: logits differ by more than --max-diff={args.max_diff}", file=sys.stderr)
    return 1
  return 0


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    return run(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
