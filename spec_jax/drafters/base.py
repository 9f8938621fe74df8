"""The drafter interface: what the engine hands a draft source and what it gets back.

A drafter is a small pytree of params plus pure functions; the engine calls them inside one
`jax.jit` around `lax.while_loop`, so every array has a static shape:

    state = drafter.init_state(params, prefill)                   # once, after the target's prefill
    draft_tokens, draft_probs, state = drafter.propose(params, state, ctx)   # every round
    state = drafter.commit(params, state, tokens, n_accepted, verify)        # after rejection

Tree drafting (spec_jax.tree; drafters with `supports_tree`):

    tree, state = drafter.propose_tree(params, state, ctx, spec)     # a DraftTree of N+1 nodes
    state = drafter.commit_tree(params, state, tokens, n_accepted, verify)
      # verify holds the target's outputs gathered along the accepted path (a chain of depth D)

- draft_tokens int32 [B, K]; -1 marks "no draft here": valid drafts are a prefix of each row,
  and the engine derives draft_lengths[b] from the first -1 (an n-gram drafter with fewer than K
  matches proposes fewer).
- draft_probs float32 [B, K, V], the distribution each draft was sampled from (the real q), or
  None for deterministic proposals (q one-hot at the draft token). Both are lossless.
- With num_draft="auto" the governor may run plain rounds (K = 0) in between: they do not call
  propose, but they do call commit with tokens [B, 1] (the one emitted token, n_accepted 0) and
  the verify of the last committed token. A drafter with state must stay in sync across them
  (Medusa and the feature heads read the verified feature there; DraftModel skips them and
  catches up lazily in `catch_up`, which the governor calls before the next propose; K is
  static in commit as tokens.shape[1] - 1).

Drafter objects are static arguments of the jitted engine: they must be hashable by their
static configuration (not by their params, which travel separately as `drafter.params` and are
traced). The library's drafters are frozen dataclasses (`FrozenDrafter`, `frozen_drafter`):
every field is static configuration and part of the hash except the ones declared with
`compare=False` (the params, `params_field()`, and what a loader records of the drafter's
origin), so a field cannot be left out of the compile-cache key by mistake; `with_params`
swaps the params (and greedy_drafts) for a new drafter of the same configuration.
Adding a draft source is one new module implementing this; the engine does not change.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax.sampling import Sampling


@flax.struct.dataclass
class PrefillInfo:
  """What the target's prefill produced, for drafters to initialise from.

  tokens: int32 [B, S] token buffer: row b holds its prompt in [0, prompt_lens[b]) and the first
    sampled token at prompt_lens[b] (lengths = prompt_lens + 1 committed tokens).
  prompt_tokens: int32 [B, P] the right-padded prompts the target prefilled (offset 0).
  prompt_lens: int32 [B].
  hidden: [B, P, D] the target's final hidden states over the (right-padded) prompt; None for
    drafters whose `reads_prompt_hidden` is False.
  layer_hidden: tuple of [B, P, D], the layers the drafter asked for (`target_layers`).
  target_params: the target model's params (heads reuse its embedding and LM head).
  sampling: per-row Sampling arrays [B], the settings drafts are drawn under
    (Sampling.for_drafts: the row's temperature times its draft_temperature_scale).
  lazy: (static) the engine calls `catch_up` before the first propose (the governor does): a
    drafter may leave work to it that drafting would need (DraftModel: the prompt's prefill,
    wasted when the governor never drafts).
  """
  tokens: jax.Array
  prompt_tokens: jax.Array
  prompt_lens: jax.Array
  hidden: jax.Array
  layer_hidden: tuple
  target_params: Any
  sampling: Sampling
  lazy: bool = flax.struct.field(pytree_node=False, default=False)


@flax.struct.dataclass
class DraftContext:
  """Inputs of one propose call.

  key: PRNG key for this round's drafting (already split from the engine's key).
  tokens: int32 [B, S] committed tokens; row b is valid in [0, lengths[b]).
  lengths: int32 [B] committed tokens per row. tokens[b, lengths[b]-1] is the last committed
    token; the target's KV cache holds entries for positions < lengths[b]-1.
  sampling: per-row Sampling arrays [B], the settings drafts are drawn under
    (Sampling.for_drafts: the row's temperature times its draft_temperature_scale).
  target_params: the target's params.
  num_draft: K (static).
  greedy: every row is greedy (static): propose argmax drafts deterministically (draft_probs
    None); the engine verifies by exact matching without random draws.
  rolled: (static) a hint that autoregressive drafters should run their K-1 later steps as a
    loop (lax.fori_loop) instead of unrolling them: the same drafts, a smaller program (the
    governor compiles a round for every candidate K). Drafters may ignore it.
  target_cache: the target's KV cache as the round starts (entries for positions
    < lengths[b] - 1, the target's own layout), for drafters that attend to it (the Gemma 4
    assistant's KV-shared layers); None where a caller has none (the bench's drafter timers).
  history: the committed sampling.History (counts [B, V], prompt [B, V]) when the decode
    applies penalties, else None. A drafter that samples from logits may apply
    `sampling.probs(logits, sampling, history + its own drafts so far)` for a q closer to the
    target's p (higher acceptance); losslessness only needs q to be what the draft was
    drawn from.
  """
  key: jax.Array
  tokens: jax.Array
  lengths: jax.Array
  sampling: Sampling
  target_params: Any
  num_draft: int = flax.struct.field(pytree_node=False)
  greedy: bool = flax.struct.field(pytree_node=False, default=False)
  rolled: bool = flax.struct.field(pytree_node=False, default=False)
  target_cache: Any = None
  history: Any = None


@flax.struct.dataclass
class VerifyInfo:
  """What the verify step saw, for drafters that follow the target's features (EAGLE, MTP).

  input_tokens: int32 [B, K+1], the verify inputs: the last committed token, then the drafts.
  hidden: [B, K+1, D] the target's final hidden state after each input (position i predicts
    the token after input i).
  layer_hidden: tuple of [B, K+1, D] for the drafter's `target_layers`.
  lengths_before: int32 [B] committed tokens before this round (input 0 sits at lengths_before-1).
  lengths: int32 [B] committed tokens after this round.
  target_params: the target's params (feature heads embed the accepted tokens in commit), or
    None where a caller does not provide them.
  """
  input_tokens: jax.Array
  hidden: jax.Array
  layer_hidden: tuple
  lengths_before: jax.Array
  lengths: jax.Array
  target_params: Any = None


class Drafter:
  """Base class. Subclasses set `params` and implement propose (and, if stateful, the rest).

  Attributes:
    params: pytree passed back into every call (traced, not static).
    target_layers: indices of target layers whose hidden states the drafter needs (EAGLE-3).
    max_draft: the largest K this drafter can propose (None = any).
    supports_tree: propose_tree is implemented (tree drafting, spec_jax.tree).
    samples_tree_candidates: its trees draw sampled candidates at T > 0 when the TreeSpec asks
      (False: top-k or trie candidates at every temperature, n-gram's).
    supports_best_first: propose_tree builds DDTree's best-first trees
      (TreeSpec(candidates="best_first"), spec_jax.tree.build_best_first_tree): block drafters,
      whose one forward gives every depth's child distribution.
    reads_prompt_hidden: init_state reads PrefillInfo.hidden / layer_hidden (the target's
      features over the prompt); when False the prefill keeps none and passes hidden None.
    rolls_steps_on: the platforms ("cpu", "gpu", "tpu") on which a chain decode runs its later
      draft steps as a loop (DraftContext.rolled; decoding.loop.rolls_draft_steps): where that
      measured better.
  """
  params: Any = None
  reads_prompt_hidden: bool = True
  target_layers: tuple = ()
  max_draft: Optional[int] = None
  supports_tree: bool = False
  samples_tree_candidates: bool = True
  supports_best_first: bool = False
  rolls_steps_on: tuple = ()

  def check_compatible(self, target) -> None:
    """Raises ValueError if this drafter cannot draft for `target` (a Model)."""

  def prepare(self, params):
    """Called once per generate() call inside the jit, before the decode loop: a place for
    loop-invariant work on the params (DraftModel unstacks its layers here)."""
    return params

  def init_state(self, params, prefill: PrefillInfo):
    return ()

  def propose(self, params, state, ctx: DraftContext):
    raise NotImplementedError

  def commit(self, params, state, tokens, n_accepted, verify: VerifyInfo):
    return state

  def propose_tree(self, params, state, ctx: DraftContext, spec):
    """A draft tree for tree drafting -> (spec_jax.tree.DraftTree with spec.num_nodes + 1
    nodes, state). ctx.num_draft is spec.depth. Drafters that cannot build trees refuse."""
    raise ValueError(f"{type(self).__name__} cannot build draft trees (its supports_tree is "
                     "False); the drafters that can are spec_jax.drafters.TREE_DRAFTERS (the "
                     "registry's, spec_jax.drafters.registry), or pass tree=None for a chain")

  def commit_tree(self, params, state, tokens, n_accepted, verify: VerifyInfo):
    """After a tree round: `verify` is the target's verify output gathered along the accepted
    path (input_tokens [B, D+1] = the root then the path's nodes; hidden, layer_hidden alike),
    tokens the emitted [B, D+1], exactly what `commit` gets after a chain of D drafts."""
    return self.commit(params, state, tokens, n_accepted, verify)

  def disown(self, state, rows):
    """After propose, when a wrapper (LookupFirst) verifies other drafts than this drafter's in
    rows `rows` (bool [B]): the state without what commit would assume of its own drafts
    there. Default: nothing (a commit that reads only the verified tokens needs nothing)."""
    del rows
    return state

  def catch_up(self, params, state, tokens, lengths):
    """Brings the state up to date with the committed tokens (tokens int32 [B, S], lengths
    [B]) before a propose that follows plain (K = 0) rounds; the governor calls it (once,
    outside its per-K rounds). Default: nothing to do (commit already kept the state)."""
    return state

  # Static identity: a dataclass drafter's compared fields (FrozenDrafter); a hand-written
  # drafter may override it with its own static configuration.
  def _static_key(self):
    if dataclasses.is_dataclass(self):
      return (type(self).__name__,) + tuple(getattr(self, f.name)
                                            for f in dataclasses.fields(self) if f.compare)
    return (type(self).__name__,)

  def __hash__(self):
    return hash(self._static_key())

  def __eq__(self, other):
    return type(self) is type(other) and self._static_key() == other._static_key()


def params_field():
  """The `params` field of a frozen drafter: traced, so not compared, hashed or printed."""
  return dataclasses.field(compare=False, repr=False)


def derived_field(compare: bool = True):
  """A field __post_init__ computes from the others (not a constructor argument)."""
  return dataclasses.field(init=False, compare=compare, repr=False)


def frozen_drafter(cls):
  """Class decorator: `cls` as a frozen dataclass whose equality and hash are Drafter's (the
  compared fields, by `_static_key`), not the dataclass's own (which would compare params)."""
  return dataclasses.dataclass(frozen=True, eq=False)(cls)


@frozen_drafter
class FrozenDrafter(Drafter):
  """A Drafter that is a frozen dataclass (module docstring). Subclasses declare their fields
  (`params: Any = params_field()` first where they have params; a field that shadows a Drafter
  class attribute without a default is declared with `dataclasses.field()`), normalise and
  check them in `__post_init__` (object.__setattr__ for normalised values), and are decorated
  with `frozen_drafter` when they add fields.

  trained_num_draft: the K the drafter was trained or published for (0: unknown); source: the
  folder it was loaded from. Both describe its origin: not compared, keyword-only.
  """
  trained_num_draft: int = dataclasses.field(default=0, compare=False, repr=False, kw_only=True)
  source: Optional[str] = dataclasses.field(default=None, compare=False, repr=False,
                                            kw_only=True)

  @classmethod
  def from_hyper_params(cls, target, hyper_params: dict, key=None, **options):
    """A fresh drafter for `target` (a Model) of the shape `hyper_params()` described (what
    heads.json saves; the trainer's options): `cls.init(target, key=key, **hyper_params,
    **options)` unless a kind derives some of them."""
    return cls.init(target, key=key, **hyper_params, **options)

  def replace(self, **changes):
    """A copy with `changes` applied to its fields (checked again by __post_init__)."""
    return dataclasses.replace(self, **changes)

  def with_params(self, params, greedy_drafts: Optional[bool] = None):
    """The same static configuration with other params (e.g. trained ones, or another dtype),
    and greedy_drafts changed when given."""
    changes = {"params": params}
    if greedy_drafts is not None:
      changes["greedy_drafts"] = bool(greedy_drafts)
    return dataclasses.replace(self, **changes)


def in_target_dtype(drafter, target):
  """The drafter with its floating params in the target's dtype when that is low-precision
  (heads trained in float32 decode in bf16 beside a bf16 target: half the bytes a draft step
  reads, bf16 operands with f32 accumulation like every dot); as it is otherwise. Activations
  stay as the drafter computes them (float32): only the weights are rounded."""
  dtype = target.config.dtype
  if dtype == "float32":
    return drafter
  cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return drafter.with_params(jax.tree.map(cast, drafter.params))
