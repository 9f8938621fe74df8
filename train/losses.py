"""Distillation losses: the heads learn the frozen target's own distributions and features.

Labels are soft: p = softmax(target logits) at the position the head predicts (the target's
exact next-token distribution given the real prefix), so a head that matches p drafts what
the target would sample; greedy acceptance needs the argmax, which the soft label contains.

  Medusa     sum_i decay^i  CE(p_{j+1+i}, head_i(h_j))                     (head i: token j+2+i)
  EAGLE      sum_s decay^(s-1) [ w_f smoothL1(o^s_j, f_{j+1}) + w_ce CE(p_{j+1}, lm_head(o^s_j)) ]
  EAGLE-3    the same with w_f = 0 and ttt_steps > 1 (training-time test: o^(s-1) fed back),
             over its draft vocabulary: p restricted to the draft tokens and renormalised
             (softmax of the target's logits at those ids), positions whose target argmax is
             outside the draft vocabulary masked out (EAGLE `eagle/traineagle3/cnets.py`,
             Model.forward: target_head[..., t2d], position_mask = t2d[argmax] * loss_mask)
  MTP        as EAGLE-3 with the full vocabulary (feature = the target's pre-norm last layer
             output)
  DFlash     sum_{a,k} w_k CE(p_{a+k-1}, slot k of the block anchored at a) / sum w_k over
             A random anchors per window run in one pass (`DFlash.training_hidden`'s block
             mask), w_k = exp(-(k-1)/gamma) for slots k = 1..b-1 (slot 0, the anchor's own
             token, is not a draft); p_{a+k-1} is the target's distribution of token a+k given
             the real prefix, whose average over the data is the marginal slot k must learn
             (DFlash paper's position-decayed loss; SpecForge `OnlineDFlashModel.forward`)
  DSpark     the DFlash anchors with slot k = 0..b-1 predicting token a+k+1, Markov inputs
             teacher-forced, w_k = exp(-k/gamma); ce_weight CE + l1_weight ||q - p||_1 +
             confidence_weight BCE(confidence, 1 - ||q - p||_1 / 2) (DeepSpec `loss.py`)

Each returns (loss, metrics) with metrics["agree"] [steps or heads] = top-1 agreement with the
target's argmax per draft position. LOSSES maps the loss keys of the head kinds
(spec_jax.drafters.registry, HeadKind.loss) to them, with one signature:

    LOSSES[key](head, params, target_params, tokens, target_out, target_probs, cfg, key)

target_out: the frozen target's forward over tokens [B, T] (hidden [B, T, D], layer_hidden:
the head's target_layers); target_probs [B, T, V]; cfg: the config's train section.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spec_jax.drafters.medusa import medusa_logits


def soft_cross_entropy(logits, probs, mask):
  """mean over mask of -sum_v p log softmax(logits); logits/probs [..., V], mask [...]."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  ce = -jnp.sum(probs * logp, axis=-1)
  return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def top1_agreement(logits, probs, mask):
  same = (jnp.argmax(logits, -1) == jnp.argmax(probs, -1)).astype(jnp.float32)
  return jnp.sum(same * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def smooth_l1(pred, target, mask, beta: float = 1.0):
  d = jnp.abs(pred.astype(jnp.float32) - target.astype(jnp.float32))
  per = jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta).mean(-1)
  return jnp.sum(per * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def medusa_loss(params, hidden, target_probs, cfg):
  """hidden [B, T, D] (final, normed), target_probs [B, T, V]."""
  k = params["w"].shape[0]
  t = hidden.shape[1]
  logits = medusa_logits(params, hidden)                                  # [B, T, K, V]
  loss, agree = 0.0, []
  for i in range(k):
    n = t - 1 - i
    lg, p = logits[:, :n, i], target_probs[:, 1 + i:]
    mask = jnp.ones(lg.shape[:2], jnp.float32)
    loss = loss + cfg["step_decay"] ** i * cfg["ce_weight"] * soft_cross_entropy(lg, p, mask)
    agree.append(top1_agreement(lg, p, mask))
  return loss, {"agree": jnp.stack(agree)}


def feature_head_loss(head, params, target_params, tokens, hidden, layer_hidden, target_probs,
                      cfg, key):
  """EAGLE / EAGLE-3 / MTP: the unrolled head against the target's features and p."""
  feats = head.target_feature(params, hidden, layer_hidden)              # [B, T, D]
  teacher = jax.lax.stop_gradient(head.target_feature(params, hidden, layer_hidden)) \
      if head.kind not in ("eagle3", "eagle3_fused") else None
  noise = cfg["feature_noise"]
  fed = feats
  if noise:
    fed = feats + noise * jax.random.uniform(key, feats.shape, feats.dtype, -1.0, 1.0)
  outs = head.unroll(params, target_params, tokens, fed, steps=cfg["ttt_steps"])
  t1 = tokens.shape[1] - 1
  slot = jnp.arange(t1)
  p = target_probs[:, 1:]
  draft_tokens = getattr(head, "draft_tokens", None)     # EAGLE-3's reduced vocabulary
  if draft_tokens is not None:
    ids = jnp.asarray(draft_tokens)
    in_vocab = jnp.zeros((p.shape[-1],), bool).at[ids].set(True)[jnp.argmax(p, -1)]
    p_draft = p[..., ids]
    p_draft = p_draft / jnp.maximum(jnp.sum(p_draft, -1, keepdims=True), 1e-30)
  loss, agree = 0.0, []
  for s, o in enumerate(outs, start=1):
    mask = jnp.broadcast_to((slot >= s - 1).astype(jnp.float32)[None], o.shape[:2])
    if draft_tokens is None:
      logits = head.logits(params, target_params, o)
      step_loss = cfg["ce_weight"] * soft_cross_entropy(logits, p, mask)
      agree.append(top1_agreement(logits, p, mask))
    else:
      logits = head.draft_logits(params, o)                            # [B, T-1, V_draft]
      step_loss = cfg["ce_weight"] * soft_cross_entropy(logits, p_draft, mask * in_vocab)
      # Agreement with the target's argmax over the full vocabulary (out-of-vocabulary
      # positions count as misses: what drafting would see).
      same = ids[jnp.argmax(logits, -1)] == jnp.argmax(p, -1)
      agree.append(jnp.sum(same * mask) / jnp.maximum(jnp.sum(mask), 1.0))
    if cfg["feature_weight"] and teacher is not None:
      step_loss = step_loss + cfg["feature_weight"] * smooth_l1(o, teacher[:, 1:], mask)
    loss = loss + cfg["step_decay"] ** (s - 1) * step_loss
  return loss, {"agree": jnp.stack(agree)}


def dflash_gamma(block_size: int, gamma=None) -> float:
  """The slot-weight decay: `gamma` when given, else 7 for b >= 16, 4 for b >= 8, b/2 below
  (the DFlash paper's choices for b = 16 and 8)."""
  if gamma is not None:
    return float(gamma)
  return 7.0 if block_size >= 16 else 4.0 if block_size >= 8 else max(block_size / 2, 1.0)


def sample_anchors(key, batch: int, seq_len: int, num_anchors: int):
  """int32 [B, A] distinct anchors per row, uniform over 0 .. T-2 (a and a+1 in the window),
  sorted; A = min(num_anchors, T-1)."""
  a = min(num_anchors, seq_len - 1)
  u = jax.random.uniform(key, (batch, seq_len - 1))
  return jnp.sort(jnp.argsort(u, axis=1)[:, :a], axis=1).astype(jnp.int32)


def dflash_loss(head, params, target_params, tokens, layer_hidden, target_probs, cfg, key):
  """DFlash's block-masked multi-anchor loss (module docstring). target_probs [B, T, V]."""
  b, t = tokens.shape
  bs = head.block_size
  anchors = sample_anchors(key, b, t, cfg["num_anchors"])                     # [B, A]
  hidden = head.training_hidden(params, target_params, tokens, layer_hidden, anchors)
  logits = head.logits(params, target_params, hidden[:, :, 1:])               # [B, A, b-1, V]
  k = jnp.arange(1, bs, dtype=jnp.int32)
  label_pos = anchors[:, :, None] + k[None, None]                             # token a + k
  valid = (label_pos < t).astype(jnp.float32)
  rows = jnp.arange(b)[:, None, None]
  p = target_probs[rows, jnp.minimum(label_pos - 1, t - 1)]                  # p_{a+k-1}
  w = jnp.exp(-(k - 1).astype(jnp.float32) / dflash_gamma(bs, cfg["loss_gamma"]))
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  ce = -jnp.sum(p * logp, axis=-1)                                            # [B, A, b-1]
  weight = valid * w
  loss = cfg["ce_weight"] * jnp.sum(ce * weight) / jnp.maximum(jnp.sum(weight), 1e-6)
  same = (jnp.argmax(logits, -1) == jnp.argmax(p, -1)).astype(jnp.float32)
  agree = jnp.sum(same * valid, axis=(0, 1)) / jnp.maximum(jnp.sum(valid, axis=(0, 1)), 1.0)
  return loss, {"agree": agree}


def dspark_loss(head, params, target_params, tokens, layer_hidden, target_probs, cfg, key):
  """DSpark's loss (DeepSpec `deepspec/modeling/dspark/loss.py`, compute_dspark_loss), over
  DFlash's block-masked anchors with teacher-forced Markov inputs (`DSpark.training_outputs`).

  Draft k = 0 .. K-1 of the block anchored at a (slot k, or k + 1 with DFlash's readout)
  predicts token a + k + 1, whose target
  distribution given the real prefix is p = target_probs[a + k]; q = softmax(the slot's
  Markov-corrected logits). With w_k = exp(-k / gamma) (DeepSpec's `_build_loss_weight_mask`)
  and sums over the valid slots (a + k + 1 < T):

    loss = ce_weight * sum w CE(p, q) / sum w                  (soft labels, as DFlash here)
         + l1_weight * sum w ||q - p||_1 / sum w               (DeepSpec's l1_loss)
         + confidence_weight * sum w BCE(c_k, alpha_k) / sum w  (the confidence head)

  alpha_k = 1 - ||q - p||_1 / 2 = sum_v min(p, q), the probability that a draft from q is
  accepted against p (detached: the confidence head learns it, the draft head is not pulled
  towards what it predicts). target_probs [B, T, V]; metrics: per-slot top-1 agreement,
  alpha and the confidence head's mean prediction."""
  b, t = tokens.shape
  bs = head.block_size
  anchors = sample_anchors(key, b, t, cfg["num_anchors"])                     # [B, A]
  logits, conf = head.training_outputs(params, target_params, tokens, layer_hidden, anchors)
  k = jnp.arange(head.max_draft, dtype=jnp.int32)                           # draft index
  label_pos = anchors[:, :, None] + k[None, None] + 1                         # token a + k + 1
  valid = (label_pos < t).astype(jnp.float32)
  rows = jnp.arange(b)[:, None, None]
  p = target_probs[rows, jnp.minimum(label_pos - 1, t - 1)]                  # p_{a+k}
  w = jnp.exp(-k.astype(jnp.float32) / dflash_gamma(bs, cfg["loss_gamma"])) * valid
  norm = jnp.maximum(jnp.sum(w), 1e-6)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  ce = -jnp.sum(p * logp, axis=-1)                                            # [B, A, b]
  l1 = jnp.sum(jnp.abs(jnp.exp(logp) - p), axis=-1)
  alpha = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))
  bce = jnp.maximum(conf, 0.0) - conf * alpha + jnp.log1p(jnp.exp(-jnp.abs(conf)))
  loss = (cfg["ce_weight"] * jnp.sum(ce * w) + cfg["l1_weight"] * jnp.sum(l1 * w)) / norm
  if head.confidence_head:
    loss = loss + cfg["confidence_weight"] * jnp.sum(bce * w) / norm
  per_slot = lambda x: jnp.sum(x * valid, axis=(0, 1)) / jnp.maximum(jnp.sum(valid, (0, 1)), 1.)
  same = (jnp.argmax(logits, -1) == jnp.argmax(p, -1)).astype(jnp.float32)
  return loss, {"agree": per_slot(same), "alpha": per_slot(alpha),
                "confidence": per_slot(jax.nn.sigmoid(conf))}


def _medusa(head, params, target_params, tokens, out, target_probs, cfg, key):
  del head, target_params, tokens, key
  return medusa_loss(params, out.hidden, target_probs, cfg)


def _feature_head(head, params, target_params, tokens, out, target_probs, cfg, key):
  return feature_head_loss(head, params, target_params, tokens, out.hidden, out.layer_hidden,
                           target_probs, cfg, key)


def _dflash(head, params, target_params, tokens, out, target_probs, cfg, key):
  return dflash_loss(head, params, target_params, tokens, out.layer_hidden, target_probs, cfg,
                     key)


def _dspark(head, params, target_params, tokens, out, target_probs, cfg, key):
  return dspark_loss(head, params, target_params, tokens, out.layer_hidden, target_probs, cfg,
                     key)


# The registry's loss keys (HeadKind.loss) -> the loss, in the uniform signature above.
LOSSES = {"medusa": _medusa, "feature_head": _feature_head, "dflash": _dflash,
          "dspark": _dspark}
