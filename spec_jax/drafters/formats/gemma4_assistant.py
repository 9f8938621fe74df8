"""Reading a Gemma 4 assistant folder (config.json model_type "gemma4_assistant" + safetensors).

    drafter = sj.drafters.load("gemma-4-E2B-it-assistant", target)   # routes here

(spec_jax.drafters.formats.gemma4_assistant; the drafter: spec_jax.drafters.gemma4_assistant)

Names (HF [out, in] Linear weights transposed into our [in, out]):

  pre_projection.weight [D_a, 2 D_t]        pre_projection [2 D_t, D_a]
  post_projection.weight [D_t, D_a]         post_projection [D_a, D_t]
  model.embed_tokens.weight [V, D_a]        embed (the tied LM head; lm_head.weight when untied)
  model.norm.weight                         final_norm
  model.layers.N.*                          layers[N]: the Gemma 4 layer names of
                                            spec_jax.models.gemma.hf, q-side only
  masked_embedding.centroids.weight [C, D_a]   centroids [D_a, C]   (use_ordered_embeddings)
  masked_embedding.token_ordering [V]          token_ordering int32
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.drafters.gemma4_assistant import AssistantHead, Gemma4Assistant, check_pair
from spec_jax.models import hf, hf_reader
from spec_jax.models.gemma.forward import init_params
from spec_jax.models.gemma.hf import LAYER_NAMES

MODEL_TYPE = "gemma4_assistant"
_Q_ONLY = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "wq", "q_norm", "wo",
           "w_gate", "w_up", "w_down", "layer_scalar")


def is_assistant_folder(path) -> bool:
  try:
    raw = json.loads((pathlib.Path(path) / "config.json").read_text())
  except (OSError, json.JSONDecodeError):
    return False
  return isinstance(raw, dict) and raw.get("model_type") == MODEL_TYPE


def config_from_hf(cfg, dtype: str, source: str) -> tuple:
  """A transformers Gemma4AssistantConfig -> (decoder ModelConfig, AssistantHead)."""
  text = copy.deepcopy(cfg.get_text_config())
  if int(getattr(text, "hidden_size_per_layer_input", 0) or 0):
    raise ValueError(f"{source}: an assistant with per-layer embeddings is not supported")
  n_layers = int(text.num_hidden_layers)
  if int(text.num_kv_shared_layers or 0) != n_layers:
    raise ValueError(f"{source}: every assistant layer must be KV-shared (num_kv_shared_layers "
                     f"{text.num_kv_shared_layers} != num_hidden_layers {n_layers})")
  # Its layers attend to the target's cache; as a ModelConfig it is a stack without KV sharing
  # (only its q side, norms, RoPE and MLP are used).
  text.num_kv_shared_layers = 0
  decoder = hf.config_from_hf(text, dtype=dtype, source=source,
                              tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)))
  ordered = bool(getattr(cfg, "use_ordered_embeddings", False))
  head = AssistantHead(backbone_hidden_size=int(cfg.backbone_hidden_size), ordered=ordered,
                       num_centroids=int(cfg.num_centroids) if ordered else 0,
                       top_k=int(cfg.centroid_intermediate_top_k) if ordered else 0)
  if ordered:
    if head.num_centroids < 1 or decoder.vocab_size % head.num_centroids:
      raise ValueError(f"{source}: num_centroids {head.num_centroids} must divide the "
                       f"vocabulary of {decoder.vocab_size}")
    if not 1 <= head.top_k <= head.num_centroids:
      raise ValueError(f"{source}: centroid_intermediate_top_k {head.top_k} must be in "
                       f"[1, num_centroids={head.num_centroids}]")
  return decoder, head


def expected_shapes(decoder, head: AssistantHead) -> dict:
  """Shapes of every param leaf of an assistant."""
  abstract = jax.eval_shape(lambda k: init_params(decoder, k), jax.random.key(0))
  d_a, d_t = decoder.hidden_size, head.backbone_hidden_size
  out = {"layers": [{k: tuple(v.shape) for k, v in lp.items() if k in _Q_ONLY}
                    for lp in abstract["layers"]],
         "final_norm": (d_a,), "embed": (decoder.vocab_size, d_a),
         "pre_projection": (2 * d_t, d_a), "post_projection": (d_a, d_t)}
  if not decoder.tie_embeddings:
    out["lm_head"] = (d_a, decoder.vocab_size)
  if head.ordered:
    out["centroids"] = (d_a, head.num_centroids)
    out["token_ordering"] = (decoder.vocab_size,)
  return out


_TOP = {"pre_projection.weight": ("pre_projection", True),
        "post_projection.weight": ("post_projection", True),
        "model.embed_tokens.weight": ("embed", False), "model.norm.weight": ("final_norm", False),
        "lm_head.weight": ("lm_head", True),
        "masked_embedding.centroids.weight": ("centroids", True),
        "masked_embedding.token_ordering": ("token_ordering", False)}


def load(path, target, greedy_drafts: bool = False,
         dtype: Optional[str] = None) -> Gemma4Assistant:
  """The assistant drafter at `path` for `target` (a Model), in the target's dtype by default.
  ValueError for another vocabulary or width, a non-Gemma-4 target, or a bad checkpoint."""
  folder = pathlib.Path(os.fspath(path)).expanduser()
  source = str(folder / "config.json")
  if not is_assistant_folder(folder):
    raise ValueError(f"{source}: not a Gemma 4 assistant config (model_type {MODEL_TYPE!r})")
  cfg = hf_reader.auto_config(folder)
  dtype = dtype or target.config.dtype
  decoder, head = config_from_hf(cfg, dtype, source)
  check_pair(decoder, head, target.config)
  shapes = expected_shapes(decoder, head)

  paths, _ = hf_reader.tensor_files(folder)
  plan, unknown = [], []
  for p in paths:
    f = hf_reader.TensorFile(p)
    for name in f.names:
      if name in _TOP:
        leaf, transpose = _TOP[name]
        if leaf == "lm_head" and decoder.tie_embeddings:
          continue
        target_path = (leaf,)
      elif name.startswith("model.layers."):
        rest = name[len("model.layers."):]
        idx, _, suffix = rest.partition(".")
        entry = LAYER_NAMES.get(suffix)
        if not idx.isdigit() or int(idx) >= decoder.num_layers or entry is None or \
            entry[0] not in shapes["layers"][int(idx)]:
          unknown.append(name)
          continue
        leaf, transpose = entry
        target_path = ("layers", int(idx), leaf)
      else:
        unknown.append(name)
        continue
      if target_path[0] not in shapes:
        unknown.append(name)
        continue
      plan.append((name, f, target_path, transpose))
  if unknown:
    raise ValueError(f"{folder}: {len(unknown)} tensor(s) a Gemma 4 assistant does not use: "
                     f"{', '.join(sorted(unknown)[:8])}")
  np_dtype = hf_reader.np_dtype(dtype)
  params = {"layers": [dict() for _ in range(decoder.num_layers)]}
  for name, f, target_path, transpose in plan:
    want = shapes
    for part in target_path:
      want = want[part]
    got = tuple(f.meta[name][1])
    if got != (tuple(reversed(want)) if transpose else tuple(want)):
      raise ValueError(f"{f.path}: tensor {name} has shape {got}, expected "
                       f"{tuple(reversed(want)) if transpose else tuple(want)}")
    value = f.read(name)
    value = value.T if transpose else value
    value = value.astype(np.int32) if target_path[-1] == "token_ordering" else \
        value.astype(np_dtype, copy=False)
    if target_path[0] == "layers":
      params["layers"][target_path[1]][target_path[2]] = value
    else:
      params[target_path[0]] = value
  missing = [k for k in shapes if k != "layers" and k not in params]
  missing += [f"layers/{i}/{k}" for i, lp in enumerate(shapes["layers"]) for k in lp
              if k not in params["layers"][i]]
  if missing:
    raise ValueError(f"{folder}: the assistant checkpoint lacks {', '.join(missing[:8])}")
  if head.ordered:
    order = np.sort(params["token_ordering"])
    if not np.array_equal(order, np.arange(decoder.vocab_size)):
      raise ValueError(f"{folder}: masked_embedding.token_ordering is not a permutation of the "
                       f"{decoder.vocab_size} token ids")
  params = jax.tree.map(jnp.asarray, params)
  return Gemma4Assistant(params, decoder, head, target.config, greedy_drafts=greedy_drafts)
