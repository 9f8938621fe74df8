"""Shared pieces of the hybrid-family tests (tests/test_hybrid.py, test_hybrid_speculation.py):
tiny random Qwen3-Next (MoE) and Qwen3.5 (dense) folders from transformers, a test drafter, the
native MTP module built from transformers' own classes and run by hand."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import torch
import transformers

import spec_jax as sj
from spec_jax.drafters.base import FrozenDrafter, frozen_drafter, params_field

V = 256
SIZES = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
             linear_conv_kernel_dim=4, max_position_embeddings=1024)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48, decoder_sparse_step=1)
REL_TOL = 1e-4


def hf_model(kind: str, seed: int = 0):
  """A random transformers model of `kind`, every weight perturbed (non-trivial norms, gates,
  biases of dt; A_log kept in its initialised range), float32, eval mode."""
  if kind == "qwen3_next":
    cfg = transformers.Qwen3NextConfig(**SIZES, **MOE)
    cls = transformers.Qwen3NextForCausalLM
  else:
    cfg = transformers.Qwen3_5TextConfig(**SIZES)
    cls = transformers.Qwen3_5ForCausalLM
  torch.manual_seed(seed)
  model = cls(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "A_log" not in name:
        p.add_(0.1 * torch.randn_like(p))
    model.lm_head.weight.mul_(8.0)          # peaky logits: a non-trivial greedy path
    model.model.embed_tokens.weight.mul_(4.0)   # the current token weighs: some n-gram hits
  return model


def build_models(tmp_path_factory):
  """kind -> (torch model, sj model, folder): a Qwen3-Next (MoE) and a Qwen3.5 (dense) folder."""
  out = {}
  for i, kind in enumerate(("qwen3_next", "qwen3_5_text")):
    tm = hf_model(kind, seed=i)
    folder = tmp_path_factory.mktemp(kind)
    tm.save_pretrained(folder)
    out[kind] = (tm, sj.load(folder), folder)
  return out


def prompt(n: int, seed: int = 0, batch: int = 2):
  return np.random.RandomState(seed).randint(0, V, (batch, n)).astype(np.int32)


REPEAT_PROMPTS = [[5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17, 33, 5, 9],
                  [7, 7, 8, 100, 7, 7, 8, 100, 7, 7, 8, 42, 7, 7, 8, 100, 1, 2]]


@frozen_drafter
class Oracle(FrozenDrafter):
  """Test drafter: proposes a known continuation (params: tokens [B, S], the plain greedy
  output in place) with every `every`-th position wrong (token + 1): accepted prefixes of every
  length 0..K, so each round commits a different verify position."""
  params: object = params_field()
  every: int = 3
  reads_prompt_hidden = False

  def propose(self, params, state, ctx):
    k = ctx.num_draft
    pos = ctx.lengths[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    toks = jnp.take_along_axis(params, jnp.clip(pos, 0, params.shape[1] - 1), axis=1)
    wrong = (pos % self.every) == 0
    return jnp.where(wrong, (toks + 1) % V, toks).astype(jnp.int32), None, state


def oracle_for(plain_tokens, every=3):
  ref = np.zeros((2, 80), np.int32)
  for i, (p, new) in enumerate(zip(REPEAT_PROMPTS, plain_tokens)):
    ref[i, :len(p) + len(new)] = p + new
  return Oracle(jnp.asarray(ref), every=every)


def greedy_run(model, drafter, k, new=40):
  return sj.generate(model, REPEAT_PROMPTS, drafter=drafter, num_draft=k, max_new_tokens=new,
                     sampling=sj.Sampling(temperature=0.0), stop_tokens=[], capacity=80)


def torch_mtp_modules(tm, seed: int):
  """The MTP module of tm's kind in transformers' own classes (a full-attention decoder layer
  of the target's kind, its MoE or dense MLP, three zero-centred norms, fc), random weights."""
  import copy
  cfg = copy.deepcopy(tm.config)
  cfg.layer_types = ["full_attention"] + list(cfg.layer_types[1:])
  cfg._attn_implementation = "eager"
  d = cfg.hidden_size
  norm_cls = type(tm.model.norm)
  torch.manual_seed(seed)
  mods = torch.nn.ModuleDict(dict(
      fc=torch.nn.Linear(2 * d, d, bias=False), layer=type(tm.model.layers[0])(cfg, 0),
      pre_fc_norm_embedding=norm_cls(d, eps=cfg.rms_norm_eps),
      pre_fc_norm_hidden=norm_cls(d, eps=cfg.rms_norm_eps), norm=norm_cls(d, eps=cfg.rms_norm_eps)))
  with torch.no_grad():
    for name, p in mods.named_parameters():
      p.copy_((0.1 if p.ndim == 1 else 0.15) * torch.randn_like(p))
  return mods.eval()


def mtp_tensors(mods) -> dict:
  out = {}
  for name, value in mods.state_dict().items():
    name = name.replace("layer.", "layers.0.", 1) if name.startswith("layer.") else name
    out["mtp." + name] = value.detach().clone().contiguous()
  return out


def torch_mtp_logits(tm, mods, toks, drafts):
  """Reference: slot j holds (target hidden after its final norm at j, token j+1), RoPE position
  j; the chained slots hold (the module's previous normed output, the draft). Returns the
  logits at the last prompt slot and after each chained draft [1 + len(drafts), V]."""
  with torch.no_grad():
    ids = torch.tensor([toks], dtype=torch.long)
    feats = tm.model(ids[:, :-1]).last_hidden_state[0]                  # [P, D]
    emb = tm.model.embed_tokens
    x = mods["fc"](torch.cat([mods["pre_fc_norm_embedding"](emb(ids[0, 1:])),
                              mods["pre_fc_norm_hidden"](feats)], -1))
    logits = []
    for step in range(len(drafts) + 1):
      t = x.shape[0]
      pos = torch.arange(t)[None]
      cos, sin = tm.model.rotary_emb(x[None], pos)
      mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
      o = mods["layer"](x[None], position_embeddings=(cos, sin), attention_mask=mask,
                        position_ids=pos)
      o = o[0] if isinstance(o, tuple) else o
      n = mods["norm"](o[0])
      logits.append(tm.lm_head(n[-1]))
      if step < len(drafts):
        e = mods["pre_fc_norm_embedding"](emb(torch.tensor([drafts[step]])))
        nxt = mods["fc"](torch.cat([e, mods["pre_fc_norm_hidden"](n[-1:])], -1))
        x = torch.cat([x, nxt], 0)
    return torch.stack(logits).numpy()


def build_mtp_models(models, tmp_path_factory):
  """kind -> (torch target, torch MTP modules, sj target loaded from a copy of its folder with
  random mtp.* tensors added)."""
  from safetensors.torch import load_file, save_file
  out = {}
  for i, kind in enumerate(models):
    tm, _, folder = models[kind]
    mods = torch_mtp_modules(tm, seed=10 + i)
    new = tmp_path_factory.mktemp(f"{kind}_mtp")
    for f in folder.iterdir():
      shutil.copy(f, new / f.name)
    tensors = load_file(new / "model.safetensors")
    tensors.update(mtp_tensors(mods))
    save_file(tensors, new / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((new / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (new / "config.json").write_text(json.dumps(cfg))
    out[kind] = (tm, mods, sj.load(new), new)
  return out


# A tiny Qwen3-Next (MoE) config: three linear-attention layers, then one full-attention layer.
TINY_QWEN3_NEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4,
                       num_heads=2, num_kv_heads=2, head_dim=16, model_type="qwen3_next",
                       partial_rotary_factor=0.5, eos_token_ids=(),
                       layer_types=("linear_attention",) * 3 + ("full_attention",),
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=4,
                       linear_value_head_dim=4, linear_conv_kernel_dim=4, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16)
