"""Chat input: conversations checked and turned into prompt ids with the model's own chat
template, and the tokens that end an assistant turn.

    ids = chat_ids(model, [{"role": "user", "content": "What is the capital of France?"}])
    # SmolLM2-Instruct: "<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nWhat is ...
    #                    <|im_end|>\\n<|im_start|>assistant\\n" as ids

The template is the tokenizer's (a Hugging Face folder's tokenizer_config.json /
chat_template.jinja, or a GGUF file's `tokenizer.chat_template`), applied by transformers'
`apply_chat_template(messages, add_generation_prompt=True)`: the same ids transformers gives.
"""

from __future__ import annotations

from typing import Sequence

ROLES = ("system", "user", "assistant", "tool")

# Special tokens that end a turn or a text in the chat formats in use (ChatML, Llama 3, Gemma,
# Phi, gpt-oss, Llama 2 / Mistral): those a tokenizer has as special tokens stop generation by
# default, beside the model's EOS ids.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>",
                      "<|end_of_text|>", "<end_of_turn>", "<|end|>", "<|return|>", "</s>")


def hf_chat_tokenizer(tokenizer):
  """The transformers tokenizer behind a spec_jax tokenizer when it has a chat template, else
  None."""
  hf = getattr(tokenizer, "hf", None)
  return hf if hf is not None and getattr(hf, "chat_template", None) else None


def check_conversation(conversation, where: str = "conversation") -> list:
  """A list of {"role", "content"} dicts -> the same as plain dicts; ValueError naming the bad
  message and what is allowed."""
  if isinstance(conversation, (str, bytes)) or not isinstance(conversation, Sequence) or \
      len(conversation) == 0:
    raise ValueError(f"{where} must be a non-empty list of {{'role': ..., 'content': ...}} "
                     f"messages, got {type(conversation).__name__}")
  out = []
  for i, message in enumerate(conversation):
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
      raise ValueError(f"{where}, message {i}: must be a dict with 'role' and 'content', got "
                       f"{message!r}")
    role, content = message["role"], message["content"]
    if role not in ROLES:
      raise ValueError(f"{where}, message {i}: unknown role {role!r}; allowed: "
                       f"{', '.join(ROLES)}")
    if not isinstance(content, str):
      raise ValueError(f"{where}, message {i}: content must be a string, got "
                       f"{type(content).__name__}")
    out.append({"role": role, "content": content})
  if out[-1]["role"] == "assistant":
    raise ValueError(f"{where}: the last message is the assistant's; a conversation to answer "
                     f"ends with a user (or tool or system) message")
  return out


def check_messages(messages) -> list:
  """generate(messages=...): a non-empty list of conversations, each checked."""
  if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) or \
      len(messages) == 0:
    raise ValueError("messages must be a non-empty list of conversations, each a list of "
                     "{'role': ..., 'content': ...} dicts (one conversation per batch row)")
  return [check_conversation(c, f"messages[{b}]") for b, c in enumerate(messages)]


def chat_ids(model, conversation) -> list:
  """Token ids of a checked conversation with the chat template and the generation prompt
  (the assistant's turn opened); ValueError when the model's tokenizer has no template."""
  hf = hf_chat_tokenizer(model.tokenizer)
  if hf is None:
    what = "no tokenizer" if model.tokenizer is None else "a tokenizer without a chat template"
    raise ValueError(f"chat messages need a chat template, but this model has {what}; pass "
                     f"prompts (text or token ids) instead")
  ids = hf.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
  if hasattr(ids, "keys"):                 # transformers >= 5 returns a BatchEncoding
    ids = ids["input_ids"]
  return [int(t) for t in ids]


def end_of_turn_ids(tokenizer) -> tuple:
  """Ids of the END_OF_TURN_TOKENS that are special tokens of this (transformers-backed)
  tokenizer; () for other tokenizers."""
  hf = getattr(tokenizer, "hf", None)
  if hf is None:
    return ()
  special = set(int(t) for t in hf.all_special_ids)
  added = getattr(hf, "added_tokens_decoder", None) or {}
  special |= {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
  vocab = hf.get_vocab()
  return tuple(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and vocab[t] in special)


def default_stop_ids(model) -> tuple:
  """The tokens generation stops at by default: the model's EOS ids, then every end-of-turn /
  end-of-text special token of its tokenizer (ChatML's <|im_end|> and <|endoftext|>, ...)."""
  out = list(model.config.eos_token_ids)
  for t in end_of_turn_ids(getattr(model, "tokenizer", None)):
    if t not in out and 0 <= t < model.config.vocab_size:
      out.append(t)
  return tuple(out)
