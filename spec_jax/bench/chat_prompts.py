"""Chat traffic as prompts: `--prompts chat:SOURCE` (e.g. chat:spec_bench).

Each question's first turn becomes one user message, encoded with the model's own chat template
by transformers (`apply_chat_template([{"role": "user", "content": q}],
add_generation_prompt=True)`): exactly the token ids a chat user sends, ending with the
template's assistant header. The tokenizer comes from the model spec: a HF folder's tokenizer
files, or a GGUF file's metadata as `sj.load` reads it (`gguf_file.read_tokenizer`: it splits text
as the file's pre-tokenizer type says, where transformers' own GGUF conversion may not).

Prompts are never cut (a cut chat prompt loses its assistant header): questions whose encoding
is longer than max_prompt_tokens are left out, and the n prompts are taken evenly spread over
the rest in file order, so every category of a set like Spec-Bench (mt_bench's 8 categories,
then translation, summarization, qa, math_reasoning, rag) is represented.
"""

from __future__ import annotations

import functools

from spec_jax.bench.prompts import read_prompt_records
from spec_jax.bench.specs import parse_widened, resolve_path
from spec_jax.models import gguf_file

CHAT_PREFIX = "chat:"


def is_chat_source(source: str) -> bool:
  return isinstance(source, str) and source.startswith(CHAT_PREFIX)


@functools.lru_cache(maxsize=4)
def hf_tokenizer(spec: str):
  """transformers' tokenizer of a model spec (a HF folder, a .gguf file or a folder holding one,
  or `widened:` one of those: widening keeps the tokenizer) with a chat template; ValueError
  when there is none. Cached: reading a GGUF's vocabulary takes seconds."""
  import transformers
  source = parse_widened(spec)[0] if spec.startswith("widened:") else spec
  if source.startswith("random:"):
    raise ValueError(f"chat prompts need a real model's chat template; {spec!r} has none")
  path = resolve_path(source)
  if path.is_dir() and not (path / "config.json").is_file():
    ggufs = sorted(path.glob("*.gguf"))           # a folder holding one .gguf (as sj.load reads)
    if len(ggufs) == 1:
      path = ggufs[0]
  if path.is_file() and path.suffix == ".gguf":
    tok = gguf_file.read_tokenizer(path).hf
  elif path.is_dir():
    tok = transformers.AutoTokenizer.from_pretrained(path)
  else:
    raise ValueError(f"chat prompts: {spec!r} is neither a HF folder nor a .gguf file (nor a "
                     f"folder holding one)")
  if not getattr(tok, "chat_template", None):
    raise ValueError(f"chat prompts: the tokenizer of {spec!r} has no chat template")
  return tok


def chat_prompt_token_lists(spec: str, source: str, n: int, max_prompt_tokens: int) -> tuple:
  """n chat-encoded prompts of `source` ('chat:SET' or 'SET') for the model `spec`
  -> (ids, texts, categories); see the module docstring."""
  if n < 1:
    raise ValueError(f"need at least one prompt, got n={n}")
  name = source[len(CHAT_PREFIX):] if is_chat_source(source) else source
  if not name:
    raise ValueError("chat:SOURCE needs a prompt set, e.g. chat:spec_bench")
  tok = hf_tokenizer(spec)
  eligible = []
  for rec in read_prompt_records(name):
    ids = tok.apply_chat_template([{"role": "user", "content": rec.turns[0]}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    if len(ids) <= max_prompt_tokens:
      eligible.append((ids, rec.turns[0], rec.category))
  if not eligible:
    raise ValueError(f"chat:{name}: no question fits in --max-prompt-tokens "
                     f"{max_prompt_tokens} once encoded with the chat template")
  picked = [eligible[(i * len(eligible)) // n if n <= len(eligible) else i % len(eligible)]
            for i in range(n)]
  return ([p[0] for p in picked], [p[1] for p in picked], [p[2] for p in picked])
