"""python -m spec_jax generate|bench|eval ...

    python -m spec_jax generate --prompt "Once upon a time"
    python -m spec_jax generate --drafter ngram --num-draft 4 --temperature 0.8
    python -m spec_jax generate --drafter draft:../shared/models/salty279K --num-draft 4
    python -m spec_jax generate --prompt A --prompt B ... --mesh data=8,model=1
    python -m spec_jax generate --model ../shared/models/smollm2-135m-instruct --chat \
        --prompt "What is the capital of France?" --drafter ngram --dtype bfloat16
    python -m spec_jax.launch --processes 2 --devices-per-process 4 -- \
        python -m spec_jax generate --prompt A ... --mesh data=8,model=1   (the same output)
    python -m spec_jax bench ...          (same as python -m spec_jax.bench ...)
    python -m spec_jax eval ...           (same as python -m spec_jax.eval ...)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys

# The command line needs no torch (a GGUF tokenizer is built without it): transformers' advice
# "PyTorch was not found ..." on import is noise here.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

DEFAULT_MODEL = str(pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "models"
                    / "stories260K")
SAMPLING_DEFAULTS = {"temperature": 0.0}      # the command line decodes greedily by default


def _generate(args) -> int:
  import jax
  import spec_jax as sj
  from spec_jax import distributed, sharding
  from spec_jax.models.tokenizers import decode_generated
  if not os.path.exists(args.model):
    print(f"error: model path {args.model!r} does not exist (give --model a Hugging Face folder, "
          "a .gguf file or a llama2.c .bin)", file=sys.stderr)
    return 2
  from spec_jax import compile_cache
  from spec_jax.bench.specs import constraint_of, make_drafter
  from spec_jax.models.chat import chat_ids, default_stop_ids, parse_template_kwargs
  compile_cache.enable()
  prompts = args.prompt or (["What is the capital of France?"] if args.chat
                            else ["Once upon a time"])
  try:
    if args.system is not None and not args.chat:
      raise ValueError("--system is a chat template's system message: give --chat too")
    template_kwargs = None
    if args.chat_template_kwargs is not None:
      if not args.chat:
        raise ValueError("--chat-template-kwargs are the chat template's options: give --chat "
                         "too")
      template_kwargs = parse_template_kwargs(args.chat_template_kwargs)
    if jax.process_count() > 1 and args.mesh is None:
      raise ValueError(f"this run has {jax.process_count()} processes: give --mesh "
                       f"data=N,model=M over their {jax.device_count()} devices")
    mesh = sharding.parse_mesh(args.mesh)
    model = sj.load(args.model, dtype=args.dtype)
    if args.attention_impl is not None:
      model = dataclasses.replace(model, config=model.config.replace(
          attention_impl=args.attention_impl))
    drafter = make_drafter(args.drafter, model)
    if args.attention_impl is not None:       # a draft model's too (also inside ngram+draft:)
      drafter = _with_draft_model(drafter, lambda m: dataclasses.replace(
          m, config=m.config.replace(attention_impl=args.attention_impl)))
    _warn_ignored_options(args, drafter)
    if not -2**63 <= args.seed < 2**63:
      raise ValueError(f"--seed {args.seed} is outside [-2**63, 2**63)")
    sampling = sj.Sampling(**{name: getattr(args, name) for name in sj.sampling.OPTIONS})
    # Every process feeds its share of the prompts (all of them on one process).
    mine = distributed.share(prompts)
    # The memory estimate is the global batch's, which every process decodes (a process's own
    # share may even be empty: one prompt over two processes).
    if args.chat:
      # --system "" is an empty system message (the template's default one is left out).
      system = [] if args.system is None else [{"role": "system", "content": args.system}]
      conversation = lambda p: system + [{"role": "user", "content": p}]
      inputs = dict(messages=[conversation(p) for p in mine],
                    chat_template_kwargs=template_kwargs)
      ids = [chat_ids(model, conversation(p), f"prompt {i}", template_kwargs)
             for i, p in enumerate(prompts)]
    else:
      inputs = dict(prompts=mine)
      ids = [model.encode(p) if model.tokenizer is not None else p for p in prompts]
    model, drafter = _check_memory(model, drafter, ids, args, mesh, sampling.needs_history)
    out = sj.generate(model, **inputs, drafter=drafter, num_draft=args.num_draft,
                      max_new_tokens=args.max_new_tokens, sampling=sampling,
                      key=jax.random.key(args.seed), mesh=mesh,
                      constraint=constraint_of(args))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if jax.process_index() != 0:
    return 0
  every = sj.new_tokens(out.result)        # every process's rows, in prompt order
  # Decoded after each row's prompt ids (decode_generated's context: a sentencepiece decoder
  # drops the first word's space of a decode that starts mid-text).
  texts = ([decode_generated(model.tokenizer, t, context=c) for t, c in zip(every, ids)]
           if model.tokenizer is not None else [None] * len(every))
  for prompt, text, toks in zip(prompts, texts, every):
    shown = text if text is not None else " " + " ".join(map(str, toks))
    print(f"> {prompt}\n{shown}" if args.chat else prompt + shown)
    print()
  if constraint_of(args) is not None:
    # A row that ran out of tokens before its grammar was complete holds a prefix of a match
    # only (e.g. JSON cut inside a string); one cut after a whole match is a match.
    stops = default_stop_ids(model)
    grammar = constraint_of(args).compile(model.tokenizer, vocab_size=model.config.vocab_size,
                                          end_ids=stops)     # generate's (cached): no recompile
    cut = [i for i, t in enumerate(every) if not grammar.complete(t, stops)]
    if cut:
      print(f"warning: row(s) {cut} reached --max-new-tokens {args.max_new_tokens} before "
            f"their grammar was complete: their text is a prefix of a match, not a match",
            file=sys.stderr)
  s = out.stats
  over = f" (all {s.processes} processes)" if s.processes > 1 else ""
  print(f"{s.new_tokens} new tokens{over} in {s.seconds:.3f} s: {s.tokens_per_second:.1f} "
        f"tokens/s (compile excluded: {out.compile_seconds:.1f} s compiling)")
  if drafter is not None:
    print(s.summary())
  return 0


def _check_memory(model, drafter, prompts, args, mesh, history: bool = False):
  """Before anything is compiled: prints the memory per device (weights, KV cache, drafter
  and decode state; spec_jax.memory) to stderr and raises ValueError when it cannot fit the
  device. On an accelerator the weights then take their execution layout once, here, outside
  the decode jit, the canonical buffers donated (models.layout.prepare_model). Returns
  (model, drafter), both in that layout."""
  import jax
  import numpy as np
  import spec_jax as sj
  from kernels_pallas import platform
  from spec_jax import memory
  from spec_jax.decoding.strategies import strategy_for
  from spec_jax.decoding.target import as_target
  from spec_jax.models.layout import prepare_model
  strategy = strategy_for(None, drafter, args.num_draft if drafter is not None else 4)
  tokens, lens, capacity = sj.prepare_batch(model, prompts, args.max_new_tokens,
                                            strategy.extent, None, prompt_bucket=None)
  b = tokens.shape[0]
  sampling = sj.Sampling().rows(b, np)
  est = memory.estimate(as_target(model.config), model.params, drafter,
                        None if drafter is None else drafter.params,
                        prompt_tokens=jax.ShapeDtypeStruct(tokens.shape, np.int32),
                        prompt_lens=jax.ShapeDtypeStruct(lens.shape, np.int32),
                        capacity=capacity, max_new_tokens=args.max_new_tokens,
                        sampling=sampling, mesh=mesh, strategy=strategy, history=history)
  device_bytes = memory.device_memory(jax.devices()[0])
  print(est.describe(device_bytes), file=sys.stderr)
  memory.check_fits(est, device_bytes)
  if not platform.is_cpu():
    model = prepare_model(model, mesh)
    drafter = _with_draft_model(drafter, lambda m: prepare_model(m, mesh))
  return model, drafter


def _with_draft_model(drafter, fn):
  """`drafter` with fn applied to its separate draft model: a DraftModel's, or one that is a
  LookupFirst's fallback (ngram+draft:MODEL); other drafters unchanged."""
  import spec_jax as sj
  if isinstance(drafter, sj.drafters.LookupFirst):
    return drafter.replace(fallback=_with_draft_model(drafter.fallback, fn))
  if isinstance(drafter, sj.drafters.DraftModel):
    return drafter.replace(model=fn(drafter.model))
  return drafter


def _warn_ignored_options(args, drafter) -> None:
  """Options that cannot act in this run, said on stderr (the command line decodes greedily by
  default, where the library samples at 1.0: --top-p alone printed the greedy text)."""
  from spec_jax.sampling import OPTIONS
  if args.temperature == 0:
    filters = [name for name in ("top_k", "top_p", "min_p", "draft_temperature_scale")
               if name in OPTIONS and getattr(args, name) != OPTIONS[name].default]
    if filters:
      print(f"warning: {', '.join('--' + f.replace('_', '-') for f in filters)} act on "
            f"sampling only, and --temperature is 0 (greedy, this command's default): give "
            f"--temperature too", file=sys.stderr)
  if drafter is None and args.num_draft != 4:
    print("warning: --num-draft is the drafter's K per round; without --drafter it decodes "
          "plainly", file=sys.stderr)


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  from spec_jax import distributed
  from spec_jax.sampling import OPTIONS
  try:
    distributed.initialize()        # a multi-process run (spec_jax.launch, a pod) or nothing
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if argv and argv[0] == "bench":
    from spec_jax import bench
    return bench.main(argv[1:])
  if argv and argv[0] == "eval":
    from spec_jax import eval as eval_harness
    return eval_harness.main(argv[1:])
  parser = argparse.ArgumentParser(prog="python -m spec_jax")
  sub = parser.add_subparsers(dest="command", required=True)
  g = sub.add_parser("generate", help="generate text, optionally with speculative decoding")
  g.add_argument("--model", default=DEFAULT_MODEL,
                 help="HF folder, .gguf file or llama2.c .bin (default: %(default)s)")
  g.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
  g.add_argument("--chat", action="store_true",
                 help="each prompt is a user message, asked in the model's chat template; the "
                 "answer ends at the template's end-of-turn token")
  g.add_argument("--system", default=None, help="with --chat: a system message first")
  g.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                 help="with --chat: the template's options as a JSON object, e.g. "
                 "'{\"enable_thinking\": false}' (Qwen3)")
  g.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                 help="the weights' dtype (default: the checkpoint's; float32 for GGUF)")
  g.add_argument("--max-new-tokens", type=int, default=128)
  for name, opt in OPTIONS.items():            # one option per Sampling field
    g.add_argument("--" + name.replace("_", "-"), type=opt.parse,
                   default=SAMPLING_DEFAULTS.get(name, opt.default),
                   help=opt.help + (" (default here: 0, greedy; the library's is 1.0)"
                                    if name in SAMPLING_DEFAULTS else ""))
  from spec_jax.bench.specs import DRAFTER_SPECS, add_constraint_flags
  add_constraint_flags(g)
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--drafter", default=None, help=DRAFTER_SPECS)
  g.add_argument("--num-draft", type=int, default=4, help="K, draft tokens per round")
  g.add_argument("--attention-impl", default=None, choices=("auto", "pallas", "reference"),
                 help="verify attention: auto (the Pallas kernel on GPU / TPU, jnp on CPU), "
                 "pallas (interpreted on CPU), reference (jnp); default: the model's (auto)")
  g.add_argument("--mesh", default=None, metavar="data=N,model=M",
                 help="shard over every device of every process: rows on data, weights on "
                 "model (N x M = the device count); needed when run by spec_jax.launch")
  sub.add_parser("bench", help="side-by-side benchmark (see python -m spec_jax.bench --help)")
  sub.add_parser("eval", help="Spec-Bench-format evaluation (see python -m spec_jax.eval --help)")
  args = parser.parse_args(argv)
  return _generate(args)


if __name__ == "__main__":
  from spec_jax import distributed
  distributed.exit(main())
