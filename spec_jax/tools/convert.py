"""python -m spec_jax.tools.convert MODEL.gguf OUT [--overwrite]

    python -m spec_jax.tools.convert \\
        ../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf out/smollm2-hf

Writes a GGUF file (llama / qwen2 / qwen3; F32, F16, BF16, Q8_0, Q4_0, Q4_1 tensors) as a
Hugging Face folder that transformers and `sj.load` both read: config.json,
generation_config.json, model.safetensors (the dequantised weights in float32, q/k rows in
Hugging Face's rotate-half order), and the tokenizer with its chat template
(spec_jax.models.gguf_file). The folder is written atomically. Then reloads OUT and checks
that its logits on a short prompt equal the GGUF's (exit 1 above --max-diff; 2 on a
ValueError such as an unsupported file).
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m spec_jax.tools.convert",
                              description="Convert a GGUF file into a Hugging Face folder.")
  p.add_argument("gguf", help="the .gguf file")
  p.add_argument("out", help="the folder to write")
  p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
  p.add_argument("--max-diff", type=float, default=1e-5,
                 help="fail (exit 1) when the folder's logits differ from the file's by more")
  return p.parse_args(argv)


def run(args) -> int:
  import jax.numpy as jnp
  import numpy as np

  import spec_jax as sj
  from spec_jax.models import gguf_file

  out = gguf_file.write_folder(args.gguf, args.out, overwrite=args.overwrite)
  print(f"wrote {out}")
  folder = sj.load(out)
  config, params, tokenizer = gguf_file.read_gguf(args.gguf)     # the file itself, no cache
  source = sj.Model(config=config, params=params, tokenizer=tokenizer)
  text = "The quick brown fox jumps over the lazy dog."
  ids = folder.encode(text) if folder.tokenizer is not None else [1, 2, 3, 4]
  if source.tokenizer is not None and source.encode(text) != ids:
    print("error: the folder's tokenizer encodes differently from the GGUF file's",
          file=sys.stderr)
    return 1
  tokens = jnp.asarray([ids], jnp.int32)
  logits = []
  for model in (folder, source):
    cache = sj.KVCache.zeros(model.config, 1, len(ids))
    logits.append(np.asarray(sj.forward(model.params, model.config, tokens, cache,
                                        jnp.zeros((1,), jnp.int32)).logits))
  diff = float(np.max(np.abs(logits[0] - logits[1])))
  print(f"{folder.config.model_type}: {folder.config.num_params / 1e6:.1f}M params, "
        f"max |logit difference| folder vs file {diff:.2e} over {len(ids)} tokens")
  return 0 if diff <= args.max_diff else 1


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    return run(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
