"""Chat input: conversations checked and turned into prompt ids with the model's own chat
template, and the tokens that end an assistant turn.

    ids = chat_ids(model, [{"role": "user", "content": "What is the capital of France?"}])
    # SmolLM2-Instruct: "<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nWhat is ...
    #                    <|im_end|>\\n<|im_start|>assistant\\n" as ids

The template is the tokenizer's (a Hugging Face folder's tokenizer_config.json /
chat_template.jinja, or a GGUF file's `tokenizer.chat_template`), applied by transformers'
`apply_chat_template(messages, add_generation_prompt=True, **chat_template_kwargs)`: the same ids
transformers gives. Messages reach the template whole: keys beside role and content (an assistant
turn's `tool_calls`, Qwen3's `reasoning_content`) are the template's to render. Template options
(Qwen3's `enable_thinking=False`, `tools`, ...) go in `chat_template_kwargs`.
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
  """A list of {"role", "content", ...} dicts -> the same as plain dicts (every key kept: the
  template renders tool_calls, reasoning_content, ...); ValueError naming the bad message and
  what is allowed."""
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
    tool_call = role == "assistant" and message.get("tool_calls")
    if not (isinstance(content, str) or (content is None and tool_call)):
      raise ValueError(f"{where}, message {i}: content must be a string (or None in an "
                       f"assistant turn with tool_calls), got {type(content).__name__}")
    out.append(dict(message))
  if out[-1]["role"] == "assistant":
    raise ValueError(f"{where}: the last message is the assistant's; a conversation to answer "
                     f"ends with a user (or tool or system) message")
  return out


def check_messages(messages, allow_empty: bool = False) -> list:
  """generate(messages=...): a non-empty list of conversations, each checked (empty allowed
  where `allow_empty`: a process's share of a multi-process batch)."""
  if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) or \
      (len(messages) == 0 and not allow_empty):
    raise ValueError("messages must be a non-empty list of conversations, each a list of "
                     "{'role': ..., 'content': ...} dicts (one conversation per batch row)")
  return [check_conversation(c, f"messages[{b}]") for b, c in enumerate(messages)]


def check_template_kwargs(chat_template_kwargs) -> dict:
  """None or a dict with string keys (the chat template's variables) -> a dict."""
  if chat_template_kwargs is None:
    return {}
  if not isinstance(chat_template_kwargs, dict) or \
      not all(isinstance(k, str) for k in chat_template_kwargs):
    raise ValueError(f"chat_template_kwargs must be a dict of template variables (e.g. "
                     f"{{'enable_thinking': False}}), got {chat_template_kwargs!r}")
  reserved = sorted(set(chat_template_kwargs) & _apply_options())
  if reserved:
    raise ValueError(f"chat_template_kwargs sets {reserved}: apply_chat_template's own options "
                     f"(truncation, padding, the template itself, ...), which chat_ids decides; "
                     f"allowed: the template's variables (enable_thinking, ...) and the tools / "
                     f"documents it renders")
  return dict(chat_template_kwargs)


def parse_template_kwargs(text: str, flag: str = "--chat-template-kwargs") -> dict:
  """A command line's JSON object of chat template options -> a checked dict (ValueError
  naming the flag when it is not JSON or not a dict of template variables)."""
  import json
  try:
    kwargs = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{flag} {text!r} is not JSON ({e}); allowed: a JSON object such as "
                     f"'{{\"enable_thinking\": false}}'") from e
  return check_template_kwargs(kwargs)


# Rendered by the template itself: passed through.
_TEMPLATE_INPUTS = frozenset({"tools", "documents"})


def _apply_options() -> frozenset:
  """The named parameters of transformers' apply_chat_template other than what a template
  renders (truncation=True cut a prompt to max_length, chat_template replaced the model's):
  not template variables, so refused in chat_template_kwargs."""
  import inspect
  try:
    from transformers import PreTrainedTokenizerBase
    names = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
  except (ImportError, TypeError, ValueError):     # its transformers 5 parameters
    names = {"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
             "continue_final_message", "tokenize", "padding", "truncation", "max_length",
             "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
  return frozenset(names - {"self", "kwargs"} - _TEMPLATE_INPUTS | {"messages", "conversation"})


def chat_ids(model, conversation, where: str = "conversation",
             chat_template_kwargs=None) -> list:
  """Token ids of a checked conversation with the chat template and the generation prompt
  (the assistant's turn opened); ValueError when the model's tokenizer has no template or the
  template refuses the conversation (its raise_exception: e.g. Gemma's "system role not
  supported", Mistral's alternating roles)."""
  hf = hf_chat_tokenizer(model.tokenizer)
  if hf is None:
    what = "no tokenizer" if model.tokenizer is None else "a tokenizer without a chat template"
    raise ValueError(f"chat messages need a chat template, but this model has {what}; pass "
                     f"prompts (text or token ids) instead")
  import jinja2
  try:
    ids = hf.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                 **check_template_kwargs(chat_template_kwargs))
  except jinja2.TemplateError as e:
    raise ValueError(f"{where}: the model's chat template refuses this conversation: "
                     f"{e}") from e
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
