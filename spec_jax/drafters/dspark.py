"""DSpark: a DFlash block backbone, a sequential Markov head over its slots, a confidence head.

DSpark (DeepSeek 2026, `DSpark_paper.pdf` in deepseek-ai/DeepSpec; code
`deepspec/modeling/dspark/{qwen3/modeling.py, markov_head.py, common.py, loss.py}`,
`deepspec/eval/dspark/draft_ops.py`) keeps DFlash's one parallel forward over a block and adds
two small heads on its outputs. With b the block size, p the position of the last committed
token x_p, h_k the backbone's normed output at block slot k (position p + k), k = 0 .. b - 1:

  backbone  DFlash's (`spec_jax.drafters.dflash`, reused as the base class): the block
            [x_p, m, ..., m] at positions p .. p + b - 1 over the target's context features.
            DeepSpec reads EVERY slot, next-token style: slot k predicts x_{p+k+1}, so a block of
            b drafts b tokens (`Qwen3DSparkModel.forward`: label_offsets = 1 .. b; z-lab's
            DFlash reads slots 1 .. b - 1, each predicting its own position).
  base      z_k = lm_head(h_k), the target's (frozen) LM head.
  Markov    z'_k = z_k + bias(x_{k-1}, h_k), x_{-1} = x_p and x_{k-1} the token drafted at the
            previous slot (`markov_head.py`, rank r, w1 [V, r], w2 [r, V]):
              vanilla  bias = w1[x] w2                                    (`VanillaMarkov`)
              gated    bias = (sigmoid([h, w1[x]] Wg + bg) * w1[x]) w2     (`GatedMarkovHead`)
              rnn      s_k = g s_{k-1} + (1 - g) tanh(c), bias = tanh(o) w2 with
                       [g; c; o] = [s_{k-1}, w1[x], h] Wj + bj, s_{-1} = 0   (`RNNHead`)
            Drafting is sequential over the slots (a `lax.scan` after the one backbone forward,
            `sample_block_tokens`): x_k ~ q_k = sampling.probs(z'_k), or its argmax when greedy.
  confidence c_k = sigmoid([h_k, w1[x_{k-1}]] w_c + b_c) (`AcceptRatePredictor`, the w1 part
            when confidence_with_markov): the predicted probability that draft k is accepted
            given the earlier ones were; prod_{j<=k} c_j is the predicted survival of slot k
            (DeepSpec's scheduler reads it, `_confident_prefix_length`). Returned by
            `propose_with_confidence` and kept in `DSparkState.confidence` after every propose.

Why rejection sampling stays exact. The drafts form an autoregressive chain: x_k is drawn from
q_k(. | context, x_0 .. x_{k-1}), a distribution that depends on the EARLIER drafts. The
engine's verifier accepts x_k with min(1, p_k(x_k) / q_k(x_k)) only after x_0 .. x_{k-1} were
accepted, i.e. when the target's p_k conditions on exactly the prefix q_k conditioned on, and
resamples a rejection from norm(max(p_k - q_k, 0)); that is Leviathan et al.'s / Chen et al.'s
speculative sampling with a draft model, lossless whenever the reported q_k is the distribution
x_k was actually drawn from. So the q_k reported per slot is the Markov-corrected distribution
conditioned on the SAMPLED previous draft (not on the argmax: a q from the greedy chain beside
sampled drafts is lossy, and tests/test_dspark.py shows the chi-square catches it). Greedy rows
draft the argmax chain with q one-hot (draft_probs None), verified by exact match.

Trees (`propose_tree`, vanilla and gated heads): a node at depth d with token t has the child
distribution z_d + bias(t, h_d), so `tree.build_dynamic_tree` expands per node from the one
backbone forward (its `expand` callback gets every node's token and depth); best-first (DDTree)
trees run the Markov head for each node as it is popped (`tree.build_best_first_tree` with
`node_logits`): the N likeliest sequences under the drafter's autoregressive q. The RNN head's
child distribution depends on the whole path and is refused for trees.

Training (`train.losses.dspark_loss`): DFlash's multi-anchor block mask, teacher-forced Markov
inputs (x_{k-1} the real previous token), per-slot weights exp(-k / gamma), and DeepSpec's
`compute_dspark_loss`: ce_weight * CE + l1_weight * ||q - p||_1 + confidence_weight *
BCE(c_k, 1 - ||q - p||_1 / 2), the confidence target the exact acceptance probability of a
draft from q against p (detached).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax import sampling as sampling_lib
from spec_jax import tree as tree_lib
from spec_jax.drafters.base import DraftContext, PrefillInfo, frozen_drafter
from spec_jax.drafters.dflash import DFlash, DFlashState
from spec_jax.drafters.dflash_layers import _dense

MARKOV_HEADS = ("vanilla", "gated", "rnn")
READOUTS = ("next", "mask")


@flax.struct.dataclass
class DSparkState(DFlashState):
  """DFlash's context K/V cache (k, v [N, B, Hkv, S, Dh]) and the last proposal's confidence.

  confidence: float32 [B, b], c_k = the predicted acceptance probability of draft k given the
  earlier drafts were accepted (slots >= the round's K are 0; all 0 before the first propose
  and for a drafter without a confidence head)."""
  confidence: jax.Array


@frozen_drafter
class DSpark(DFlash):
  """A DSpark drafter (module docstring): DFlash's fields plus its two heads.

  Params: DFlash's, plus markov {w1 [V, r], w2 [r, V]; gated: gate_h [D, r], gate_e [r, r],
  gate_b [r]; rnn: joint_s [r, 3 r], joint_e [r, 3 r], joint_h [D, 3 r], joint_b [3 r]} when
  markov_rank > 0, and confidence {w_h [D], (w_e [r] with confidence_with_markov), b []} when
  confidence_head. (DeepSpec's concatenated-input Linears split by input block: one residual-
  width block per leaf, so `widen_heads` pads them like any other.)

  Args (beyond DFlash's):
    markov_rank: r; 0 = no Markov head (DeepSpec's DFlash configs: the backbone alone, read
      next-token style).
    markov_head: "vanilla" | "gated" | "rnn" (DeepSpec's markov_head_type).
    confidence_head: whether it has the confidence head.
    confidence_with_markov: the confidence head also reads w1[x_{k-1}] (needs markov_rank > 0).
    readout: "next" (DeepSpec's: slot k = 0 .. b-1 predicts x_(p+k+1), b drafts per block) or
      "mask" (z-lab DFlash's: slots 1 .. b-1 predict their own positions, b - 1 drafts; ours,
      not in DeepSpec's format). The Markov chain is the same: draft i conditions on draft i-1.
  """

  kind = "dspark"
  supports_tree = True

  markov_rank: int = 0
  markov_head: str = "vanilla"
  confidence_head: bool = False
  confidence_with_markov: bool = False
  readout: str = "next"

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)
    r = self.markov_rank
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
      raise ValueError(f"dspark: markov_rank must be an integer >= 0 (0: no Markov head), got "
                       f"{r!r}")
    if self.markov_head not in MARKOV_HEADS:
      raise ValueError(f"dspark: markov_head={self.markov_head!r}; allowed: "
                       f"{', '.join(MARKOV_HEADS)}")
    if self.readout not in READOUTS:
      raise ValueError(f"dspark: readout={self.readout!r}; allowed: {', '.join(READOUTS)}")
    set_("confidence_head", bool(self.confidence_head))
    set_("confidence_with_markov", bool(self.confidence_with_markov))
    if self.confidence_with_markov and (not self.confidence_head or r == 0):
      raise ValueError("dspark: confidence_with_markov needs confidence_head and a Markov head "
                       f"(markov_rank > 0); got confidence_head={self.confidence_head}, "
                       f"markov_rank={r}")
    if isinstance(self.block_size, int) and not isinstance(self.block_size, bool) and \
        self.block_size < 2:
      raise ValueError(f"dspark: block_size must be an integer >= 2, got {self.block_size}")
    super().__post_init__()

  @property
  def first_slot(self) -> int:
    """The block slot of draft 0: 0 for DeepSpec's readout, 1 for DFlash's."""
    return 0 if self.readout == "next" else 1

  @property
  def max_draft(self) -> int:
    return self.block_size - self.first_slot

  def param_shapes(self) -> dict:
    shapes = super().param_shapes()
    d, v, r = self.layer_config.hidden_size, self.target_config.vocab_size, self.markov_rank
    if r:
      m = {"w1": (v, r), "w2": (r, v)}
      if self.markov_head == "gated":
        m.update(gate_h=(d, r), gate_e=(r, r), gate_b=(r,))
      elif self.markov_head == "rnn":
        m.update(joint_s=(r, 3 * r), joint_e=(r, 3 * r), joint_h=(d, 3 * r), joint_b=(3 * r,))
      shapes["markov"] = m
    if self.confidence_head:
      shapes["confidence"] = {"w_h": (d,), "b": ()}
      if self.confidence_with_markov:
        shapes["confidence"]["w_e"] = (r,)
    return shapes

  def hyper_params(self) -> dict:
    return dict(super().hyper_params(), markov_rank=self.markov_rank,
                markov_head=self.markov_head, confidence_head=self.confidence_head,
                confidence_with_markov=self.confidence_with_markov, readout=self.readout)

  # ----------------------------------------------------------------------- the two heads

  def markov_bias(self, params, prev, hidden, rnn_state):
    """The Markov head's logit bias (`markov_head.py`, compute_step_bias / _rnn_step).

    prev int32 [...] the previous slot's token; hidden float32 [..., D] this slot's backbone
    output; rnn_state float32 [..., r] (the RNN head's; others pass it through).
    Returns (bias float32 [..., V] (0 without a Markov head), new rnn_state)."""
    if not self.markov_rank:
      return jnp.zeros((), jnp.float32), rnn_state
    m = params["markov"]
    e = m["w1"][prev].astype(jnp.float32)                                # [..., r]
    if self.markov_head == "vanilla":
      return _dense(e, m["w2"]), rnn_state
    if self.markov_head == "gated":     # gate_proj([h, w1[x]]), its weight split by block
      gate = jax.nn.sigmoid(_dense(hidden, m["gate_h"]) + _dense(e, m["gate_e"]) +
                            m["gate_b"].astype(jnp.float32))
      return _dense(gate * e, m["w2"]), rnn_state
    # joint_proj([s, w1[x], h]), its weight split by block
    z = (_dense(rnn_state, m["joint_s"]) + _dense(e, m["joint_e"]) +
         _dense(hidden, m["joint_h"]) + m["joint_b"].astype(jnp.float32))
    g, c, o = jnp.split(z, 3, axis=-1)
    g = jax.nn.sigmoid(g)
    new_state = g * rnn_state + (1.0 - g) * jnp.tanh(c)
    return _dense(jnp.tanh(o), m["w2"]), new_state

  def confidence_logit(self, params, prev, hidden):
    """The confidence head's logit (`AcceptRatePredictor` over [h_k, w1[x_{k-1}]]):
    prev int32 [...], hidden [..., D] -> float32 [...] (zeros without the head)."""
    if not self.confidence_head:
      return jnp.zeros(hidden.shape[:-1], jnp.float32)
    c = params["confidence"]
    out = _dense(hidden.astype(jnp.float32), c["w_h"][:, None])[..., 0]
    if self.confidence_with_markov:
      e = params["markov"]["w1"][prev].astype(jnp.float32)
      out = out + _dense(e, c["w_e"][:, None])[..., 0]
    return out + c["b"].astype(jnp.float32)

  def _rnn_zeros(self, lead):
    return jnp.zeros(tuple(lead) + (self.markov_rank,), jnp.float32)

  def teacher_forced(self, params, base_logits, prev, hidden):
    """Training: the Markov-corrected logits and confidence logits with the real previous
    tokens (`apply_block_logits`; the RNN head unrolled over the slots).

    base_logits [..., b, V]; prev int32 [..., b] (slot k's x_{k-1}); hidden [..., b, D]
    -> (logits [..., b, V], confidence logits [..., b])."""
    hidden = hidden.astype(jnp.float32)
    state = self._rnn_zeros(prev.shape[:-1])
    out = []
    for k in range(prev.shape[-1]):
      bias, state = self.markov_bias(params, prev[..., k], hidden[..., k, :], state)
      out.append(base_logits[..., k, :] + bias)
    return jnp.stack(out, axis=-2), self.confidence_logit(params, prev, hidden)

  def draft_chain(self, params, base_logits, hidden, first_prev, key, sampling, greedy: bool):
    """The sequential draft over K slots (`sample_block_tokens`), one `lax.scan` step a slot.

    base_logits float32 [B, K, V]; hidden [B, K, D]; first_prev int32 [B] (x_p); greedy
    (static): argmax drafts. Returns (drafts int32 [B, K], q float32 [B, K, V] (the exact
    distribution each draft was drawn from: sampling.probs of the corrected logits given the
    previous DRAWN token; one-hot rows for greedy ones), confidence logits float32 [B, K])."""
    b, k_slots = base_logits.shape[:2]
    hidden = hidden.astype(jnp.float32)
    rows = jnp.arange(b)
    slot_keys = jax.vmap(lambda r: jax.vmap(lambda i: jax.random.fold_in(
        jax.random.fold_in(key, r), i))(jnp.arange(k_slots)))(rows)          # [B, K] keys

    def step(carry, xs):
      prev, state = carry
      z, h, keys = xs                                                        # [B, V], [B, D]
      bias, state = self.markov_bias(params, prev, h, state)
      logits = z + bias
      conf = self.confidence_logit(params, prev, h)
      if greedy:
        tok, q = jnp.argmax(logits, -1).astype(jnp.int32), jnp.zeros((b, 0), jnp.float32)
      else:
        q = sampling_lib.probs(logits, sampling)
        tok = jax.vmap(sampling_lib.sample)(keys, q)
      return (tok, state), (tok, q, conf)

    xs = (jnp.swapaxes(base_logits, 0, 1), jnp.swapaxes(hidden, 0, 1),
          jnp.swapaxes(slot_keys, 0, 1))
    init = (first_prev.astype(jnp.int32), self._rnn_zeros((b,)))
    _, (toks, q, conf) = jax.lax.scan(step, init, xs)
    q = None if greedy else jnp.swapaxes(q, 0, 1)
    return jnp.swapaxes(toks, 0, 1), q, jnp.swapaxes(conf, 0, 1)

  # ----------------------------------------------------------------------- drafter interface

  def block_outputs(self, params, state, ctx: DraftContext, num_slots: int):
    """The backbone over the block at p = lengths - 1 -> (hidden [B, K, D], base logits
    [B, K, V], x_p [B]) of slots 0 .. K - 1 (slot k predicts x_{p+k+1})."""
    hidden = self.block_hidden(params, state, ctx.target_params, ctx.tokens, ctx.lengths)
    hidden = hidden[:, self.first_slot:self.first_slot + num_slots]
    last = jnp.take_along_axis(ctx.tokens, (ctx.lengths - 1)[:, None], axis=1)[:, 0]
    return hidden, self.logits(params, ctx.target_params, hidden), last

  def _check_k(self, k: int, what: str) -> None:
    if k > self.max_draft:
      raise ValueError(f"a DSpark drafter with block_size {self.block_size} and readout "
                       f"{self.readout!r} drafts at most {self.max_draft} tokens per round; "
                       f"{what}={k}")

  def init_state(self, params, prefill: PrefillInfo):
    base = super().init_state(params, prefill)
    conf = jnp.zeros((prefill.tokens.shape[0], self.block_size), jnp.float32)
    return DSparkState(k=base.k, v=base.v, confidence=conf)

  def propose_with_confidence(self, params, state: DSparkState, ctx: DraftContext):
    """propose, plus the confidence head's per-slot acceptance probabilities float32 [B, K]
    (zeros without a confidence head); the state keeps them in `confidence`."""
    k = ctx.num_draft
    self._check_k(k, "num_draft")
    hidden, base, last = self.block_outputs(params, state, ctx, k)
    greedy = bool(self.greedy_drafts or ctx.greedy)
    drafts, q, conf_logits = self.draft_chain(params, base, hidden, last, ctx.key, ctx.sampling,
                                              greedy)
    conf = jax.nn.sigmoid(conf_logits) if self.confidence_head else jnp.zeros_like(conf_logits)
    padded = jnp.zeros_like(state.confidence).at[:, :k].set(conf)
    return drafts, q, conf, state.replace(confidence=padded)

  def propose(self, params, state: DSparkState, ctx: DraftContext):
    drafts, q, _, state = self.propose_with_confidence(params, state, ctx)
    return drafts, q, state

  @staticmethod
  def survival(confidence):
    """Predicted survival of each draft: cumprod of the per-slot confidence [..., K]
    (DeepSpec's prefix acceptance, `ConfidenceHeadRecorder.observe`)."""
    return jnp.cumprod(confidence, axis=-1)

  def propose_tree(self, params, state: DSparkState, ctx: DraftContext, spec):
    """A tree over the Markov-corrected slot distributions: a node at depth d with token t gets
    its children from z_d + bias(t, h_d) (per node, from the one backbone forward);
    `tree.build_dynamic_tree`'s top-k / sampled / distinct candidates, or DDTree's best-first
    tree over this autoregressive q (`tree.build_best_first_tree` with per-node children:
    the N likeliest drafted sequences, each node's children computed when it is popped)."""
    self._check_k(spec.depth, "TreeSpec.depth")
    if self.markov_rank and self.markov_head == "rnn":
      raise ValueError("a DSpark drafter with the rnn Markov head cannot build trees (a "
                       "node's children depend on its whole path's recurrent state); use a "
                       "chain, or a vanilla / gated Markov head")
    hidden, base, last = self.block_outputs(params, state, ctx, spec.depth)
    hidden = hidden.astype(jnp.float32)
    rows = jnp.arange(base.shape[0])[:, None]
    none = jnp.zeros((), jnp.float32)
    root_bias, _ = self.markov_bias(params, last, hidden[:, 0], none)
    if spec.candidates == "best_first":
      # DDTree over the Markov-corrected q: a node's children depend on its own token, so they
      # are computed (one bias, one top-k) when the node is popped.
      def node_logits(tokens, depths):
        d = jnp.minimum(depths, spec.depth - 1)              # depth-D nodes get no children
        bias, _ = self.markov_bias(params, tokens, hidden[rows[:, 0], d], none)
        return base[rows[:, 0], d] + bias

      slots = base.at[:, 0].add(root_bias)
      return tree_lib.build_best_first_tree(slots, spec, node_logits), state

    def expand(tokens, parents, depths, start, carry):
      del parents
      d = depths[:, start:]                      # a depth-d node's children: slot d
      bias, _ = self.markov_bias(params, tokens[:, start:], hidden[rows, d], none)
      return base[rows, d] + bias, carry

    candidates = "topk" if self.greedy_drafts else spec.candidates_for(ctx.greedy)
    tree, _ = tree_lib.build_dynamic_tree(base[:, 0] + root_bias, expand, (), spec,
                                          key=ctx.key, sampling=ctx.sampling,
                                          candidates=candidates)
    return tree, state

  # ----------------------------------------------------------------------- training

  def training_outputs(self, params, target_params, tokens, layer_hidden, anchors):
    """All anchors' blocks in one pass (DFlash's training mask), teacher-forced heads.

    tokens int32 [B, T]; layer_hidden: the captured target layers ([B, T, D_t] each); anchors
    int32 [B, A]. Returns (logits [B, A, K, V], confidence logits [B, A, K]), K = max_draft:
    draft k of the block anchored at a predicts token a + k + 1 with x_{k-1} = token a + k."""
    hidden = self.training_hidden(params, target_params, tokens, layer_hidden, anchors)
    hidden = hidden[:, :, self.first_slot:]
    t = tokens.shape[1]
    pos = jnp.minimum(anchors[:, :, None] + jnp.arange(self.max_draft)[None, None], t - 1)
    prev = jnp.take_along_axis(tokens[:, None, :], pos, axis=2)             # [B, A, b]
    base = self.logits(params, target_params, hidden)
    return self.teacher_forced(params, base, prev, hidden)

  # ----------------------------------------------------------------------- construction

  @classmethod
  def init(cls, target, key=None, markov_rank: int = 0, markov_head: str = "vanilla",
           confidence_head: bool = True, confidence_with_markov: Optional[bool] = None,
           readout: str = "next", init_std: float = 0.02, greedy_drafts: bool = False,
           **dflash_options) -> "DSpark":
    """A fresh DSpark drafter for `target` (a Model): DFlash.init's backbone (its options:
    block_size, num_layers, target_layers, ...), the Markov head normal(init_std) (DeepSpec's
    initializer_range; its bias starts near 0), the confidence head normal(init_std) with a
    zero bias. confidence_with_markov None: True when there is a Markov head (DeepSpec's
    configs)."""
    key = jax.random.key(0) if key is None else key
    k_base, k_m1, k_m2, k_g, k_g2, k_g3, k_c, k_c2 = jax.random.split(key, 8)
    if confidence_with_markov is None:
      confidence_with_markov = bool(confidence_head and markov_rank)
    if isinstance(markov_rank, bool) or not isinstance(markov_rank, int) or markov_rank < 0:
      raise ValueError(f"dspark: markov_rank must be an integer >= 0, got {markov_rank!r}")
    base = DFlash.init(target, key=k_base, init_std=init_std, **dflash_options)
    params = dict(base.params)
    d, v, r = base.layer_config.hidden_size, target.config.vocab_size, markov_rank
    normal = lambda k, shape: init_std * jax.random.normal(k, shape, jnp.float32)
    if r:
      m = {"w1": normal(k_m1, (v, r)), "w2": normal(k_m2, (r, v))}
      if markov_head == "gated":
        m.update(gate_h=normal(k_g, (d, r)), gate_e=normal(k_g2, (r, r)),
                 gate_b=jnp.zeros((r,)))
      elif markov_head == "rnn":
        m.update(joint_s=normal(k_g, (r, 3 * r)), joint_e=normal(k_g2, (r, 3 * r)),
                 joint_h=normal(k_g3, (d, 3 * r)), joint_b=jnp.zeros((3 * r,)))
      params["markov"] = m
    if confidence_head:
      params["confidence"] = {"w_h": normal(k_c, (d,)), "b": jnp.zeros(())}
      if confidence_with_markov:
        params["confidence"]["w_e"] = normal(k_c2, (r,))
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(DFlash) if f.init
              and f.name not in ("params", "greedy_drafts")}
    return cls(params=params, greedy_drafts=greedy_drafts, markov_rank=r,
               markov_head=markov_head, confidence_head=confidence_head,
               confidence_with_markov=confidence_with_markov, readout=readout, **fields)


__all__ = ["DSpark", "DSparkState", "MARKOV_HEADS"]
