"""Tiny Hugging Face folders with real chat templates, for the chat tests.

`chat_folder(path, kind)` trains a ~300-piece BPE on a few sentences (a second), saves it with a
published chat template and a one-layer random llama's config.json + model.safetensors, so that
`sj.load` and transformers' AutoTokenizer both read it:

  "chatml"   byte-level BPE, ChatML with Qwen2.5's tool-call rendering and Qwen3's
             `enable_thinking` switch (the parts of those templates the tests use)
  "gemma2"   sentencepiece-style BPE (metaspace, byte fallback), Gemma 2's template, which
             refuses a system message
  "mistral"  sentencepiece-style BPE, Mistral's [INST] template, which refuses two user turns in
             a row; its decoder strips the leading space of a decode (Llama 2 / Mistral)
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

CORPUS = ["Hello there, how are you today? I am fine.", "The capital of France is Paris.",
          "Once upon a time there was a little girl named Lily.", "What is 2+2? It is 4."] * 20

CHATML = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}{{- '\\n<tool_call>\\n' + call.name + ' ' }}"
    "{{- call.arguments | tojson }}{{- '\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' and message.reasoning_content %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n'"
    " + message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% endif %}"
    "{% endfor %}")

KINDS = {
    "chatml": dict(template=CHATML, style="byte", specials=["<|endoftext|>", "<|im_start|>",
                                                            "<|im_end|>"],
                   eos="<|im_end|>", pad="<|endoftext|>"),
    "gemma2": dict(template=GEMMA2, style="spm", specials=["<pad>", "<eos>", "<bos>", "<unk>",
                                                           "<start_of_turn>", "<end_of_turn>"],
                   bos="<bos>", eos="<eos>", unk="<unk>", pad="<pad>"),
    "mistral": dict(template=MISTRAL, style="spm", specials=["<unk>", "<s>", "</s>"],
                    bos="<s>", eos="</s>", unk="<unk>"),
}


def _byte_level(specials):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=300, special_tokens=list(specials),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tok


def _sentencepiece_like(specials):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>" if "<unk>" in specials
                             else None))
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first",
                                               split=False)
  tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=600, special_tokens=list(specials) + byte_pieces))
  return tok


def chat_folder(path, kind: str, config_eos: bool = True, generation_eos=None) -> pathlib.Path:
  """A tiny folder of `kind` (module docstring) at `path`; config_eos=False leaves
  eos_token_id out of config.json; generation_eos: token strings for generation_config.json."""
  from safetensors.numpy import save_file
  from tokenizers import processors
  from transformers import PreTrainedTokenizerFast
  spec = KINDS[kind]
  tok = (_byte_level if spec["style"] == "byte" else _sentencepiece_like)(spec["specials"])
  if spec.get("bos"):
    bos = spec["bos"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
  names = {k + "_token": spec[k] for k in ("bos", "eos", "unk", "pad") if spec.get(k)}
  hf = PreTrainedTokenizerFast(tokenizer_object=tok, **names)
  hf.chat_template = spec["template"]
  folder = pathlib.Path(path)
  hf.save_pretrained(folder)
  v, d, f = len(hf), 32, 64
  config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=d,
                intermediate_size=f, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=v, max_position_embeddings=256,
                rms_norm_eps=1e-5, tie_word_embeddings=True, torch_dtype="float32",
                bos_token_id=hf.bos_token_id)
  if config_eos:
    config["eos_token_id"] = hf.eos_token_id
  (folder / "config.json").write_text(json.dumps(config))
  if generation_eos is not None:
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [hf.convert_tokens_to_ids(t) for t in generation_eos]}))
  rng = np.random.default_rng(0)
  w = lambda *shape: (rng.standard_normal(shape) * 0.02).astype(np.float32)
  layer = "model.layers.0."
  save_file({"model.embed_tokens.weight": w(v, d), "model.norm.weight": np.ones(d, np.float32),
             layer + "input_layernorm.weight": np.ones(d, np.float32),
             layer + "post_attention_layernorm.weight": np.ones(d, np.float32),
             layer + "self_attn.q_proj.weight": w(d, d), layer + "self_attn.k_proj.weight": w(16, d),
             layer + "self_attn.v_proj.weight": w(16, d), layer + "self_attn.o_proj.weight": w(d, d),
             layer + "mlp.gate_proj.weight": w(f, d), layer + "mlp.up_proj.weight": w(f, d),
             layer + "mlp.down_proj.weight": w(d, f)}, str(folder / "model.safetensors"))
  return folder
