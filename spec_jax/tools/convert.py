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

from spec_jax.tools.checks import add_check_flags, max_logit_diff, target_logits, too_far, tool_main
import spec_jax as sj
from spec_jax.models import gguf_file


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m spec_jax.tools.convert",
                              description="Convert a GGUF file into a Hugging Face folder.")
  p.add_argument("gguf", help="the .gguf file")
  p.add_argument("out", help="the folder to write")
  add_check_flags(p, "folder's logits and the file's", max_diff=1e-5, prompt=False)
  return p.parse_args(argv)


def run(args) -> int:

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
  diff = max_logit_diff(target_logits(folder, ids), target_logits(source, ids))
  print(f"{folder.config.model_type}: {folder.config.num_params / 1e6:.1f}M params, "
        f"max |logit difference| folder vs file {diff:.2e} over {len(ids)} tokens")
  return too_far("logits", args.max_diff) if diff > args.max_diff else 0


def main(argv=None) -> int:
  return tool_main(parse_args, run, argv)


if __name__ == "__main__":
  sys.exit(main())
