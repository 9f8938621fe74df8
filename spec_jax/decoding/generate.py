"""generate: prompts in, text and acceptance statistics out — a host wrapper over `decode`.

It checks and pads the prompts (decoding.prompts), resolves the round strategy once
(decoding.strategies), compiles decode ahead of time once per shapes (decoding.compiled;
compilation is not timed), calibrates a cost table on first use for a strategy that reads one
(decoding.calibration: the governor's), times the compiled call and decodes the text.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple, Optional

import jax
import numpy as np

from spec_jax import constraints as constraints_lib, global_batch, processors as processors_lib
from spec_jax import sharding as sharding_lib
from spec_jax.decoding import calibration
from spec_jax.decoding.checks import INT32_MAX, check_key, is_static_int
from spec_jax.decoding.compiled import compiled_decode_call
from spec_jax.decoding.prompts import pad_batch, prompt_ids, stop_array
from spec_jax.decoding.strategies import strategy_for
from spec_jax.decoding.target import as_target
from spec_jax.drafters.base import Drafter
from spec_jax.models.chat import chat_ids, check_messages
from spec_jax.models.tokenizers import decode_generated
from spec_jax.sampling import OPTIONS, Sampling
from spec_jax.stats import SpecStats


class GenerateOutput(NamedTuple):
  """tokens: list[list[int]] new tokens per row (a stop token that ended a row is included);
  text: list[str] or None (decoded new tokens, special tokens dropped); stats: SpecStats;
  result: the DecodeResult as numpy arrays (per-row statistics, finished_at_round); rows: the
  global row indices of tokens and text; compile_seconds: what this call spent tracing and
  compiling decode and running the fresh executable once for 2 tokens (its one-time kernel
  setup); 0.0 when the executable was already in memory (a persistent-cache hit,
  spec_jax.compile_cache, leaves the tracing and the setup run); never part of stats.seconds. With a mesh over several processes, tokens and text are
  this process's rows, result and stats cover every process's rows (new_tokens(result) is every
  row's tokens, in global order). complete: with a constraint, list[bool] per row of tokens:
  whether the row is a whole match of the grammar (a row cut by max_new_tokens may hold only a
  prefix of one); None without a constraint."""
  tokens: list
  text: Optional[list]
  stats: SpecStats
  result: Optional[Any] = None
  rows: Optional[range] = None
  compile_seconds: float = 0.0
  complete: Optional[list] = None


def new_tokens(result) -> list:
  """Host side: list[list[int]] of each row's new tokens (a stop token that ended a row
  included) from a DecodeResult."""
  tokens = np.asarray(result.tokens)
  lengths, prompt_lens = np.asarray(result.lengths), np.asarray(result.prompt_lens)
  return [tokens[b, prompt_lens[b]:lengths[b]].tolist() for b in range(tokens.shape[0])]


@functools.lru_cache(maxsize=None)
def _default_key():
  """jax.random.key(0), made once (creating a key is an eager device op, ~0.5 ms a call)."""
  return jax.random.key(0)


def generate(target, prompts=None, drafter: Optional[Drafter] = None, num_draft=4,
             max_new_tokens: int = 128, sampling: Sampling = Sampling(), key=None,
             stop_tokens=None, capacity: Optional[int] = None, mesh=None,
             prompt_bucket: Optional[int] = None, governor=None, tree=None,
             messages=None, strategy=None, constraint=None,
             processors=(), acceptance_prior=None,
             chat_template_kwargs=None) -> GenerateOutput:
  """Speculative (or, with drafter=None, plain) generation for a batch of prompts.

  A host-side wrapper over `decode`: prepares and pads the prompts, compiles `decode` ahead of
  time (one compile per (B, prompt bucket, S, K, greedy); compilation is not timed), times the
  compiled call, and decodes the text.

  Args:
    target: a Model (sj.load / sj.init_model).
    prompts: list[str] (needs a tokenizer; BOS added as the tokenizer does) or list[list[int]];
      rows may differ in length. Give prompts or messages, not both.
    messages: chat input instead of prompts: a list of conversations (one per row), each a
      list of {"role": "system" | "user" | "assistant" | "tool", "content": str} ending with
      a non-assistant message; the model's chat template is applied with the generation prompt
      (spec_jax.models.chat), and with stop_tokens=None a row stops at the template's
      end-of-turn token. text is then the assistant's answer without special tokens. Keys
      beside role and content (tool_calls, reasoning_content) reach the template.
    chat_template_kwargs: with messages, the chat template's options (e.g. Qwen3's
      {"enable_thinking": False}, or {"tools": [...]}), passed to apply_chat_template.
    drafter: a Drafter (sj.drafters.*) or None for plain decoding (then num_draft is ignored).
    strategy: how the rounds run (sj.strategies): Chain(K), Tree(spec), Governed(governor),
      "auto", or a Strategy of your own; None: num_draft, tree and governor say it.
    num_draft: K, draft tokens per round (>= 1 with a drafter), or "auto": the governor picks
      K (0 = a plain step) every round from a cost table (`sj.calibrate`, measured on first
      use for this batch and capacity, then cached on disk; not part of the timed seconds)
      and the batch's live acceptance (spec_jax.governor).
    max_new_tokens: new tokens per row at most (>= 1).
    sampling: Sampling, scalars or per-row [B] arrays; temperature 0 = greedy.
    key: jax PRNG key (default key(0)).
    stop_tokens: None = the model's end-of-text tokens (its EOS ids and its tokenizer's
      end-of-turn tokens: <|im_end|>, <|endoftext|>, <|eot_id|>, <end_of_turn>, ...); [] = never
      stop early. Any list of up to 8 ids runs the same compiled decode (prompts.padded_stops).
    capacity: KV-cache capacity S (default: the longest prompt + max_new_tokens + K + 1, rounded
      up to a power of two, at least 512 or the model's context if shorter:
      prompts.capacity_bucket; decode compiles once per such bucket).
    mesh: optional jax.sharding.Mesh with axes "data" (batch rows) and "model" (heads, MLP
      features, vocabulary): see spec_jax.sharding. The batch must divide the "data" size.
      A mesh over several processes (after spec_jax.distributed.initialize()): every process
      calls generate() with the same options and its own prompts (possibly none); the batch
      is every process's rows in process order (spec_jax.global_batch); each process gets its
      own rows' tokens and text back, and statistics over all rows (stats.processes says how
      many processes they sum over).
    prompt_bucket: None (default): prompts are padded to the whole cache capacity, so one
      compiled decode serves every prompt length up to it (its prefill runs in chunks of
      min(64, S) positions until the chunk holding the longest prompt's end:
      spec_jax.models.prefill); an integer m: padded to a multiple of m instead (one compile
      per padded length; the padding is masked either way). For a large batch of short
      prompts m = the prompt length prefills only the real positions (a 40k-row batch of a
      3-token prompt at S = 16 decoded 1.8x faster, the same tokens).
    governor: with num_draft="auto", a `sj.Governor` (or a dict of its options); None = the
      defaults.
    tree: sj.TreeSpec(depth=D, top_k=k, num_nodes=N) for tree drafting (spec_jax.tree: one
      verify over N+1 tree nodes per round, lossless); num_draft is then ignored. None: a chain.
    constraint: sj.constraints.regex(pattern) or sj.constraints.json_schema(schema): every
      row's output matches it (then ends with a stop token), compiled for the target's
      tokenizer on the host (cached) and applied inside the decode, losslessly under
      speculation (spec_jax.constraints). None: unconstrained.
    processors: LogitsProcessors of your own (spec_jax.processors), applied in order after
      the penalties (and before the constraint) at every position, drafts included.
    acceptance_prior: with num_draft="auto", what earlier calls of this target and drafter
      saw: a sequence of per-position acceptances in [0, 1] (an earlier output's
      `stats.position_acceptance`; shorter than the governor's largest K: the last entry
      repeats; longer: cut). The governor starts from it instead of its guess and skips its
      two drafted warm-up rounds, so a batch where drafting cannot pay decodes plainly from
      its first round. Or the rows' own estimates (an earlier output's
      `stats.row_acceptance`, or several outputs' rows stacked): the spread, so that the
      slowest-row objective weighs a row as poor as the poorest earlier ones by how often they
      occurred (governor.choice.profile_weights). For large batches: at B = 1 a prior can
      lock a well-drafted request into plain decoding (docs/governor.md). None: no prior.
      Ignored by fixed K and trees.

  Returns:
    GenerateOutput(tokens, text, stats, result).
  """
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
      or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
  max_new_tokens = int(max_new_tokens)
  if messages is not None and prompts is not None:
    raise ValueError("give prompts or messages, not both")
  if messages is None and prompts is None:
    raise ValueError("generate needs prompts (a list of strings or token-id lists) or messages "
                     "(a list of chat conversations)")
  if chat_template_kwargs is not None and messages is None:
    raise ValueError("chat_template_kwargs are the chat template's options: give messages too")

  def ids_of_rows(allow_empty=False):
    # A multi-process call checks them below, inside the processes' error exchange (a process's
    # share may be empty, and one process's bad row must not leave the others waiting).
    rows_ = prompts
    if messages is not None:
      rows_ = [chat_ids(target, c, f"messages[{b}]", chat_template_kwargs)
               for b, c in enumerate(check_messages(messages, allow_empty))]
    return prompt_ids(target, rows_, allow_empty=allow_empty)
  strategy = strategy_for(strategy, drafter, num_draft, tree, governor,
                          as_target(target.config))
  prior = strategy.acceptance_prior(acceptance_prior)      # ValueError on a bad one
  if drafter is not None:
    drafter.check_compatible(target)
  if not isinstance(sampling, Sampling):
    raise ValueError(f"sampling must be a spec_jax.Sampling, got {type(sampling).__name__}")
  vocab_size = as_target(target.config).vocab_size
  sampling.check(vocab_size=vocab_size)   # logit_bias ids
  processors = processors_lib.check_processors(processors)
  grammar = None
  if constraint is not None:
    if not isinstance(constraint, constraints_lib.Constraint):
      raise ValueError(f"constraint must be sj.constraints.regex(...) or "
                       f"sj.constraints.json_schema(...), got {type(constraint).__name__}")
    ends = stop_array(target, stop_tokens).tolist() or list(
        getattr(target.tokenizer, "eos_ids", ()) or ())
    grammar = constraint.compile(target.tokenizer, vocab_size=vocab_size, end_ids=ends)
    processors += (grammar,)
  if key is None:
    key = _default_key()
  else:
    check_key(key)
  if capacity is not None and (not is_static_int(capacity) or not 1 <= capacity <= INT32_MAX):
    raise ValueError(f"capacity must be None or a positive integer below 2**31, got "
                     f"{capacity!r}")
  sharding_lib.check_mesh(mesh, 0)
  spans = sharding_lib.spans_processes(mesh)
  if not spans:
    ids = ids_of_rows()
    rows, processes = range(len(ids)), 1
  else:       # each process fed its own rows: every process now gets the whole global batch
    try:
      ids, error = ids_of_rows(allow_empty=True), None
    except ValueError as e:
      ids, error = [], str(e)
    ids, sampling, rows, processes = global_batch.assemble(ids, sampling, _agreed_options(
        target, drafter, strategy, max_new_tokens, sampling, key, stop_tokens, capacity,
        prompt_bucket, processors, prior), error=error)
  sharding_lib.check_mesh(mesh, len(ids))
  prompt_tokens, prompt_lens, capacity = pad_batch(target, ids, max_new_tokens, strategy.extent,
                                                     capacity, prompt_bucket)
  batch = prompt_tokens.shape[0]
  mesh = sharding_lib.as_auto(mesh)
  greedy = sampling.is_greedy
  history = sampling.needs_history        # static: no penalty, no history in the program
  sampling = sampling.as_arrays(batch)
  stop = stop_array(target, stop_tokens)

  # A cost table, for a strategy that reads one (calibrated on first use, then cached): not timed.
  costs = calibration.round_costs_for(strategy, target, drafter, batch, capacity, greedy,
                                      max_new_tokens, prompt_len=prompt_tokens.shape[1],
                                      stop_count=len(stop), mesh=mesh, history=history,
                                      processors=processors,
                                      bias_width=int(np.shape(sampling.logit_bias.ids)[-1]))
  compiled, args, kwargs = compiled_decode_call(
      target, drafter, prompt_tokens, prompt_lens, key, max_new_tokens=max_new_tokens,
      sampling=sampling, stop=stop, capacity=capacity, greedy=greedy, mesh=mesh,
      strategy=strategy, round_costs=costs, acceptance_prior=prior, history=history,
      processors=processors)
  # A compile this call caused (calibration's first run included) and no call reported yet.
  compile_seconds = compiled.take_compile_seconds()
  if compile_seconds > 0:
    # A fresh executable's first run sets its kernels up (~0.8 s for a 135M model on XLA:CPU,
    # measured: 1.2 s then 0.46 s for the same call): that is part of compiling, not decoding,
    # so one 2-token run (the prefill and one round) goes first and is counted with the compile.
    warm_start = time.perf_counter()
    warm = dict(kwargs, max_new_tokens=sharding_lib.replicate(mesh, np.asarray(2, np.int32)))
    global_batch.to_host(compiled(*args, **warm), spans)
    compile_seconds += time.perf_counter() - warm_start
  start = time.perf_counter()
  packed = compiled(*args, **kwargs)
  flat = global_batch.to_host(packed, spans)   # waits for the result; every row, every process
  seconds = time.perf_counter() - start

  result = compiled.unpack(flat)
  new = new_tokens(result)[rows.start:rows.stop]
  text = None
  if target.tokenizer is not None:
    # Decoded after the row's prompt: a sentencepiece decoder drops the first word's space of
    # a decode that starts mid-text (Llama 2 / Mistral: "time" + "t" read "timet").
    text = [decode_generated(target.tokenizer, t, context=ids[r])
            for r, t in zip(rows, new)]
  stats = SpecStats.from_result(result, seconds=seconds, processes=processes,
                                **strategy.stats_fields(greedy, drafter))
  if np.size(result.position_acceptance):   # for the next call's acceptance_prior
    per_row = np.asarray(result.row_acceptance)[rows.start:rows.stop]
    stats = dataclasses.replace(
        stats, position_acceptance=tuple(float(a) for a in np.asarray(result.position_acceptance)),
        row_acceptance=tuple(tuple(float(a) for a in row) for row in per_row))
  complete = None if grammar is None else [grammar.complete(t, ends) for t in new]
  return GenerateOutput(tokens=new, text=text, stats=stats, result=result, rows=rows,
                        compile_seconds=compile_seconds, complete=complete)


def _shared_bias(sampling):
  """The logit bias as one map for every row (hashable pairs): what processes exchange; a
  per-row bias cannot cross processes (ValueError)."""
  pairs = OPTIONS["logit_bias"].scalar(sampling.logit_bias)
  if pairs is None:
    raise ValueError("a per-row logit_bias cannot be spread over processes: pass one map "
                     "{token id: bias} for every row")
  return list(pairs)


def _agreed_options(target, drafter, strategy, max_new_tokens, sampling, key, stop_tokens,
                    capacity, prompt_bucket, processors=(), prior=None) -> dict:
  """What every process of a multi-process generate() must pass alike (global_batch.assemble
  compares fingerprints): all options but the prompts and per-row sampling arrays."""
  scalars = sampling.scalars()
  params = lambda pytree: [(np.shape(x), str(x.dtype)) for x in jax.tree.leaves(pytree)]
  return {"target": [repr(target.config), params(target.params)],
          "drafter": None if drafter is None else [type(drafter).__name__,
                                                   params(drafter.params)],
          "strategy": repr(strategy), "max_new_tokens": max_new_tokens,
          "sampling": "per-row" if scalars is None else list(scalars),
          "logit_bias": _shared_bias(sampling),
          "key": np.asarray(jax.random.key_data(key)).tolist(),
          "stop_tokens": None if stop_tokens is None else np.asarray(stop_tokens).tolist(),
          "capacity": capacity, "prompt_bucket": prompt_bucket,
          "acceptance_prior": None if prior is None else np.asarray(prior).tolist(),
          "processors": [repr(p) if getattr(p, "constraint", None) is None else
                         [repr(p), p.constraint.source] for p in processors]}
