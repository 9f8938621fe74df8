"""widen_heads: trained draft heads for a widened target (`spec_jax.models.widen`).

    wide = spec_jax.models.widen(target, 768, 2048, 12)
    heads = sj.drafters.load("runs/eagle3", target)
    wide_heads = sj.drafters.widen_heads(heads, target, wide)   # the same drafts on `wide`
    heads_folder.save("runs/eagle3-wide", wide_heads, wide, num_draft=6)

The widened target's features are the source's zero-padded ([f, 0]: hidden states, layer
outputs, embeddings), so a head computes the same thing once every weight that reads a
residual-width vector gets zero rows for the padding, every weight that writes one gets zero
columns, every RMSNorm over D is scaled like the target's (the head's norms share the target's
eps, which widen scaled by D/D'), and the head's own decoder layer is widened with the target's
recipe (`spec_jax.models.widen.widen_layer`).

The head's layer mirrors its target's shape when it had it: a layer with the source target's
head count takes the widened target's heads (and head_dim), a layer with the source's MLP width
takes the widened one's; a head with its own choice keeps it (its head_dim grows to
D' / num_heads, as `head_layer_config` builds it). EAGLE-3's target_layers stay the same
indices: widen puts its extra identity layers after the source's.

A DFlash drafter keeps its own head count and grows head_dim by D'/D: its q/k RMSNorms are
exact only then (`spec_jax.models.widen.plan`), whatever the target's head shape.

`HEAD_RULES` below is the one place that says how each kind's params widen, by param name.
A kind whose architecture changes (e.g. a 2D-input attention) changes its entry here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.drafters import registry
from spec_jax.drafters.base import in_target_dtype
from spec_jax.models.widen import LAYER_AXES, NORM, Rule, place, plan

# [n*D, D]: reads a concatenation of n residual-width vectors, writes one.
_CONCAT_IN = Rule(("res_blocks", "res"))
_RES = Rule(("res",))

# Decoder layers stacked on a leading [N] axis (DFlash): N is kept.
_STACKED_LAYER = {name: Rule((None,) + rule.axes, rule.scale) for name, rule in LAYER_AXES.items()}

# kind -> {param name: Rule, or a {name: Rule} dict for a decoder layer widened by the head
# layer's own plan}.
HEAD_RULES = {
    "medusa": {
        "w": Rule((None, None, "res", "res")),     # [K, N, D, D] residual SiLU blocks
        "b": Rule((None, None, "res")),            # [K, N, D]
        "lm_head": Rule((None, "res", None)),      # [K, D, V]
    },
    "eagle": {
        "fc": _CONCAT_IN,                          # concat(embedding, feature) -> D
        "fc_b": _RES,
        "layer": LAYER_AXES,
    },
    "eagle3": {
        "fc": _CONCAT_IN,                          # concat(low, mid, high) -> D
        "embed_norm": NORM,                        # the midlayer's input_layernorm
        "hidden_norm": NORM,
        "layer": {**{k: LAYER_AXES[k] for k in ("wo", "mlp_norm", "w_gate", "w_up", "w_down")},
                  # q/k/v read concat(normed embedding, normed feature): two residual blocks
                  "wq": Rule(("res_blocks", "q"), "q"),
                  "wk": Rule(("res_blocks", "kv")),
                  "wv": Rule(("res_blocks", "kv"))},
        "norm": NORM,
        "lm_head": Rule(("res", None)),            # [D, V_draft], its own
        "embed": Rule((None, "res")),              # a loaded checkpoint's own embedding
    },
    "eagle3_fused": {
        "fuse": _CONCAT_IN,                        # concat(low, mid, high) -> D
        "fc": _CONCAT_IN,
        "fc_b": _RES,
        "layer": LAYER_AXES,
        "out_norm": NORM,
    },
    "mtp": {
        "fc": _CONCAT_IN,                          # concat(enorm(embedding), hnorm(feature))
        "enorm": NORM,
        "hnorm": NORM,
        "layer": LAYER_AXES,
        "out_norm": NORM,
    },
    "dflash": {
        "fc": _CONCAT_IN,                          # concat(captured layers) -> D
        "hidden_norm": NORM,                       # normalises the context feature
        "layers": _STACKED_LAYER,                  # [N, ...] Qwen3 layers (q/k norms)
        "norm": NORM,
        "mask_embed": _RES,                        # the learned mask embedding (ours)
    },
}
# DSpark: DFlash's backbone; its Markov head reads the backbone's normed output h (zero-padded
# like every residual vector) only through gate_h / joint_h, its confidence head through w_h.
HEAD_RULES["dspark"] = {
    **HEAD_RULES["dflash"],
    "markov": {"w1": Rule((None, None)), "w2": Rule((None, None)), "gate_h": Rule(("res", None)),
               "gate_e": Rule((None, None)), "gate_b": Rule((None,)),
               "joint_s": Rule((None, None)), "joint_e": Rule((None, None)),
               "joint_h": Rule(("res", None)), "joint_b": Rule((None,))},
    "confidence": {"w_h": _RES, "w_e": Rule((None,)), "b": Rule(())},
}


def _wide_hyper_params(drafter, source, widened) -> dict:
  """The drafter's hyper-parameters for the widened target (mirror rule: module docstring)."""
  hp = dict(drafter.hyper_params())
  layer_config = getattr(drafter, "layer_config", None)
  if layer_config is None:
    return hp
  src, new = source.config, widened.config
  block = drafter.kind in ("dflash", "dspark")
  if block:     # own heads, head_dim * D'/D: exact q/k norms (docstring)
    hp["head_dim"] = layer_config.head_dim * new.hidden_size // src.hidden_size
  else:
    hp["num_heads"] = new.num_heads if layer_config.num_heads == src.num_heads \
        else layer_config.num_heads
  hp["intermediate_size"] = new.intermediate_size \
      if layer_config.intermediate_size == src.intermediate_size \
      else layer_config.intermediate_size
  for name in ("num_kv_heads", "head_dim"):   # derived by head_layer_config when rebuilt
    if not block:
      hp.pop(name, None)
  if hp.get("rms_norm_eps") is not None:       # a head's own eps scales like the target's
    hp["rms_norm_eps"] = hp["rms_norm_eps"] * src.hidden_size / new.hidden_size
  return hp


def _widen_tree(params: dict, rules: dict, target_plan, layer_plan, where: str) -> dict:
  out = {}
  for name, leaf in params.items():
    if name not in rules:
      raise ValueError(f"widen_heads: no widening rule for {where} param {name!r} (known: "
                       f"{', '.join(rules)}); add one to HEAD_RULES in "
                       f"spec_jax/drafters/widening.py")
    rule = rules[name]
    if isinstance(rule, dict):
      out[name] = _widen_tree(leaf, rule, layer_plan, layer_plan, f"{where}/{name}")
    else:
      out[name] = place(leaf, rule, target_plan)
  return out


def widen_heads(drafter, source, widened):
  """`drafter` (Medusa / EAGLE / EAGLE3 / MTP trained on `source`) for `widened` = widen(source).

  Args:
    drafter: a head drafter built for `source` (e.g. from `sj.drafters.load(dir, source)`).
    source: the Model the heads were trained on.
    widened: `spec_jax.models.widen(source, ...)` (or that model saved and reloaded).

  Returns:
    A drafter of the same kind for `widened` whose draft logits on `widened` equal the source
    drafter's on `source` (float rounding aside); save it with
    `formats.heads_folder.save(dir, drafter, widened, num_draft)` to bind it to the widened
    target.

  Raises:
    ValueError: a kind without rules, a drafter not built for `source`, or a head layer whose
      shape cannot be widened exactly (as for the target).
  """
  kind = getattr(drafter, "kind", None)
  if kind not in HEAD_RULES:
    raise ValueError(f"widen_heads: cannot widen a {type(drafter).__name__} (kind {kind!r}); "
                     f"allowed kinds: {', '.join(HEAD_RULES)}")
  drafter.check_compatible(source)
  target_plan = plan(source.config, widened.config)
  skeleton = registry.build(kind, widened, _wide_hyper_params(drafter, source, widened))
  layer_plan = None
  if hasattr(drafter, "layer_config"):
    try:
      layer_plan = plan(drafter.layer_config, skeleton.layer_config)
    except ValueError as e:
      raise ValueError(f"widen_heads: the {kind} head's decoder layer: {e}") from e
  wide = _widen_tree(drafter.params, HEAD_RULES[kind], target_plan, layer_plan, kind)
  want = jax.tree.map(np.shape, skeleton.params)
  got = jax.tree.map(np.shape, wide)
  if want != got:
    raise ValueError(f"widen_heads: the widened {kind} params do not have the shapes the "
                     f"widened target's {kind} head needs: {got} vs {want}")
  params = jax.tree.map(lambda x, ref: jnp.asarray(x, jnp.asarray(ref).dtype), wide,
                        skeleton.params)
  out = skeleton.replace(params=params, greedy_drafts=drafter.greedy_drafts,
                         trained_num_draft=int(getattr(drafter, "trained_num_draft", 0) or 0))
  return in_target_dtype(out, widened)
