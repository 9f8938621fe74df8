"""The llama.cpp side of the peer comparison, through llama-cpp-python (the `peers` extra).

A job (see spec_jax.bench.peer_worker) with side "llamacpp" names a GGUF file as "gguf" and a
thread count as "threads" (n_threads = n_threads_batch); configurations are "plain" and
"ngram" (llama-cpp-python's own prompt-lookup drafter, `LlamaPromptLookupDecoding(
num_pred_tokens=k)` passed as `draft_model=`). One `Llama` per configuration (the drafter is
fixed when a Llama is built; with one, llama-cpp-python keeps the logits of every position).

What is timed, per prompt: `llm.reset()` (the next eval clears the whole KV cache, so every
call evaluates its prompt again, as the other sides do, instead of reusing the previous call's
prefix), then `Llama.generate(prompt_ids, temp=0.0, reset=False)` iterated for exactly max_new
tokens: the prompt eval, then one eval per step (or per verify of 1 + drafted tokens), each
token picked by llama.cpp's greedy sampler. `generate` never stops at EOS by itself (only its
callers `create_completion` / `__call__` do), so no logit bias is needed to decode exactly
max_new tokens. tau = (max_new - 1) / (evals after the prompt eval): tokens per target forward.

Greedy agreement, measured on SmolLM2-135M-Instruct's Q4_1 file (tests/test_peers.py): llama.cpp
multiplies Q4_1 weights with activations quantised to Q8_1, so its greedy tokens part from those
of the float32 model transformers dequantises from the same file at near-ties (with the chat
template's default system prompt, "What is the capital of France?" starts at a top-2 gap of
0.08: transformers answers "The capital of France is Paris.", llama.cpp "L'Étoile, ..."). Its
prompt lookup can also part from its own plain decoding: a verify over 1 + K tokens runs other
matmul kernels than a one-token step (same prompt, position 7). Away from near-ties all agree.
"""

from __future__ import annotations

import itertools
import time

from spec_jax.models.gguf_reader import GGUFFile

LLAMACPP_HINT = ("llama-cpp-python is not installed: `pip install -e '.[peers]'` builds it "
                 "(CMAKE_ARGS=\"-DGGML_NATIVE=ON\"; see docs/peers.md)")


def import_llama_cpp():
  """llama_cpp, or a ValueError saying how to install it."""
  try:
    import llama_cpp
  except ImportError as e:
    raise ValueError(f"{LLAMACPP_HINT} ({e})") from None
  return llama_cpp


def gguf_info(path) -> dict:
  """What llama.cpp streams per decode step from a GGUF file: {"bytes": every tensor's bytes as
  stored (the quantised weights, the tied token embedding once), "type": the tensor type
  holding the most bytes (e.g. "Q4_1"), "bytes_by_type": {type: bytes}}."""
  reader = GGUFFile(path)
  by_type: dict = {}
  for t in reader.tensors:
    name = t.tensor_type.name
    by_type[name] = by_type.get(name, 0) + int(t.n_bytes)
  if not by_type:
    raise ValueError(f"{path}: a GGUF file without tensors")
  return {"bytes": sum(by_type.values()), "type": max(by_type, key=by_type.get),
          "bytes_by_type": by_type}


def load_llama(gguf_path, *, threads: int, n_ctx: int, lookup_tokens: int = 0, seed: int = 0):
  """A llama_cpp.Llama on the CPU; lookup_tokens > 0 adds prompt-lookup drafting of that many
  tokens (max_ngram_size 2, llama-cpp-python's default)."""
  llama_cpp = import_llama_cpp()
  from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
  draft = LlamaPromptLookupDecoding(num_pred_tokens=int(lookup_tokens)) if lookup_tokens else None
  return llama_cpp.Llama(model_path=str(gguf_path), n_ctx=int(n_ctx), n_threads=int(threads),
                         n_threads_batch=int(threads), n_gpu_layers=0, seed=seed,
                         draft_model=draft, verbose=False)


def greedy_tokens(llm, prompt, max_new: int) -> tuple:
  """Exactly max_new greedy tokens after `prompt` (token ids; its KV recomputed from scratch)
  -> (tokens, evals): evals counts the target forwards, the prompt's included."""
  if max_new < 1:
    raise ValueError(f"max_new must be >= 1, got {max_new}")
  evals = [0]
  inner = llm.eval

  def counting_eval(tokens):
    evals[0] += 1
    return inner(tokens)

  llm.eval = counting_eval
  try:
    llm.reset()
    gen = llm.generate(list(prompt), temp=0.0, repeat_penalty=1.0, reset=False)
    tokens = [int(t) for t in itertools.islice(gen, max_new)]
    gen.close()
  finally:
    del llm.eval                      # the class's method again
  if len(tokens) != max_new:
    raise RuntimeError(f"llama.cpp stopped after {len(tokens)} of {max_new} tokens")
  return tokens, evals[0]


def run_llamacpp(job: dict, rounds) -> dict:
  """The job's configurations through llama.cpp, timed by `rounds` (peer_worker._rounds)."""
  if int(job.get("batch", 1)) != 1:
    raise ValueError("llama-cpp-python's Llama decodes one sequence: the llama.cpp side runs "
                     "at batch 1 only")
  if not job.get("gguf"):
    raise ValueError("the llama.cpp side needs a GGUF file (job['gguf'])")
  max_new = int(job["max_new"])
  longest_k = max([int(c.get("k") or 0) for c in job["configs"]] + [0])
  n_ctx = max(len(p) for p in job["prompts"]) + max_new + longest_k + 16
  calls, llms = {}, []
  for cfg in job["configs"]:
    if cfg["mode"] not in ("plain", "ngram"):
      raise ValueError(f"llama.cpp side: mode {cfg['mode']!r} is not run here (plain, ngram)")
    k = int(cfg["k"]) if cfg["mode"] == "ngram" else 0
    llm = load_llama(job["gguf"], threads=int(job["threads"]), n_ctx=n_ctx, lookup_tokens=k,
                     seed=int(job.get("seed", 0)))
    llms.append(llm)

    def call(llm=llm):
      tokens, seconds, forwards = [], 0.0, 0
      for prompt in job["prompts"]:
        t0 = time.perf_counter()
        out, evals = greedy_tokens(llm, prompt, max_new)
        seconds += time.perf_counter() - t0
        tokens.append(out)
        forwards += evals - 1
      emitted = len(job["prompts"]) * (max_new - 1)
      return tokens, seconds, (emitted / forwards if forwards else 1.0)
    calls[cfg["name"]] = call
  try:
    return rounds(calls, job)
  finally:
    for llm in llms:              # freed now, not by __del__ at interpreter exit (which fails)
      llm.close()
