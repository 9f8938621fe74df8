"""Tokenizers with one small interface, for llama2.c `tok*.bin` files and Hugging Face folders.

Both classes provide:

  encode(text, add_bos=True) -> list[int]   text -> ids, with the model's BOS convention
  decode(ids) -> str                        ids -> text, skipping BOS/EOS/special tokens
  vocab_size                                number of ids
  pieces() -> list[str]                     the token strings in id order (vocabulary checks)
  token_bytes() -> list[bytes | None]        the bytes each id writes into the text (None:
                                            special tokens), what grammars are built over
  bos_id, eos_ids                           int or None; tuple of ints
"""

from __future__ import annotations

import heapq
import os
import pathlib
import struct
from typing import Optional, Protocol, Sequence


class Tokenizer(Protocol):
  """The interface every tokenizer of spec_jax implements."""

  bos_id: Optional[int]
  eos_ids: tuple

  @property
  def vocab_size(self) -> int: ...

  def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...

  def pieces(self) -> list[str]: ...


def decode_generated(tokenizer, ids: Sequence[int], context: Sequence[int] = ()) -> str:
  """A model's generated ids as text: ids past the tokenizer's pieces (a model's padded
  embedding rows: Qwen2.5 has 151,936 rows for 151,665 pieces) are dropped, as special ids
  are, where tokenizer.decode refuses them (an id a caller hands it should exist).

  context: the ids before them (the prompt). The text is then what they add to the context's
  text, as transformers' TextStreamer reads it: a sentencepiece decoder strips the leading
  space of a decode that starts mid-text (Llama 2 / Mistral: "time" + "▁t" read "timet"
  decoded alone). Where the context's text is not a prefix of the whole (a character split
  across the boundary), the ids are decoded alone."""
  size = tokenizer.vocab_size
  keep = lambda xs: [t for t in xs if 0 <= int(t) < size]
  alone = tokenizer.decode(keep(ids))
  if len(context) == 0 or len(ids) == 0:
    return alone
  before = tokenizer.decode(keep(context))
  whole = tokenizer.decode(keep(list(context) + list(ids)))
  return whole[len(before):] if whole.startswith(before) else alone


# ----------------------------------------------------------------------------- llama2.c

_NUM_SPECIAL = 3  # llama2.c / sentencepiece: 0 <unk>, 1 <s>, 2 </s>; raw bytes follow at 3..258.


def _byte_of_piece(piece: bytes) -> Optional[int]:
  """b"<0x0A>" -> 10; anything else -> None (run.c's sscanf "<0x%02hhX>")."""
  if len(piece) == 6 and piece.startswith(b"<0x") and piece.endswith(b">"):
    try:
      return int(piece[3:5], 16)
    except ValueError:
      return None
  return None


class Llama2cTokenizer:
  """The tokenizer of llama2.c's `run.c`: a sentencepiece BPE vocabulary stored as
  (score, bytes) pairs, encoded by greedy highest-score pair merging with byte fallback.

  BOS is 1. llama2.c marks the end of a story with BOS too (run.c stops on token 1), so
  eos_ids is (1,).
  """

  def __init__(self, vocab: Sequence[bytes], scores: Sequence[float], max_token_length: int = 0,
               source: Optional[str] = None):
    if len(vocab) != len(scores):
      raise ValueError(f"{source}: {len(vocab)} pieces but {len(scores)} scores")
    self._vocab = [bytes(p) for p in vocab]
    self._scores = [float(s) for s in scores]
    self.max_token_length = int(max_token_length)
    self.source = source
    self.bos_id: Optional[int] = 1
    self.eos_ids: tuple = (1,)
    self._lookup: dict[bytes, int] = {}
    for i, piece in enumerate(self._vocab):
      self._lookup.setdefault(piece, i)
    self._bytes = [_byte_of_piece(p) for p in self._vocab]
    # What decode writes for each id: the raw byte of a "<0xXX>" piece, else the piece.
    self._output = [piece if byte is None else bytes([byte])
                    for piece, byte in zip(self._vocab, self._bytes)]

  @classmethod
  def from_file(cls, path) -> "Llama2cTokenizer":
    """Reads llama2.c's tokenizer format: int32 max_token_length, then per token
    float32 score, int32 length, `length` bytes."""
    path = pathlib.Path(path)
    data = path.read_bytes()
    if len(data) < 4:
      raise ValueError(f"{path}: too short for a llama2.c tokenizer ({len(data)} bytes)")
    (max_len,) = struct.unpack_from("<i", data, 0)
    offset, vocab, scores = 4, [], []
    while offset < len(data):
      if offset + 8 > len(data):
        raise ValueError(f"{path}: truncated llama2.c tokenizer (token {len(vocab)} at byte {offset})")
      score, length = struct.unpack_from("<fi", data, offset)
      offset += 8
      if length < 0 or offset + length > len(data):
        raise ValueError(f"{path}: truncated or corrupt llama2.c tokenizer (token {len(vocab)} "
                         f"claims {length} bytes at byte {offset} of {len(data)})")
      vocab.append(data[offset:offset + length])
      scores.append(score)
      offset += length
    return cls(vocab, scores, max_len, source=str(path))

  def save(self, path) -> pathlib.Path:
    """Writes the vocabulary in llama2.c's tokenizer format (what `from_file` reads)."""
    path = pathlib.Path(path)
    chunks = [struct.pack("<i", self.max_token_length)]
    for piece, score in zip(self._vocab, self._scores):
      chunks.append(struct.pack("<fi", score, len(piece)) + piece)
    path.write_bytes(b"".join(chunks))
    return path

  @property
  def vocab_size(self) -> int:
    return len(self._vocab)

  def pieces(self) -> list[str]:
    return [p.decode("utf-8", errors="backslashreplace") for p in self._vocab]

  def scores(self) -> list[float]:
    """The merge score of every piece, in id order (higher merges first)."""
    return list(self._scores)

  def token_bytes(self) -> list:
    """The bytes of each id's piece in the text (a "<0xXX>" piece: its byte); None for the
    special ids 0-2. (decode drops the leading space of the first piece after BOS.)"""
    return [None if i < _NUM_SPECIAL else out for i, out in enumerate(self._output)]

  def _initial_ids(self, text: str) -> list[int]:
    ids = []
    if text:
      space = self._lookup.get(b" ")
      ids.append(space if space is not None else ord(" ") + _NUM_SPECIAL)
    for char in text:
      raw = char.encode("utf-8", errors="surrogatepass")
      piece = self._lookup.get(raw)
      if piece is not None:
        ids.append(piece)
      else:
        ids.extend(b + _NUM_SPECIAL for b in raw)
    return ids

  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    """Exactly run.c's `encode`: dummy-prefix space, codepoint lookup with byte fallback, then
    repeatedly merge the adjacent pair whose concatenation is the highest-scoring piece
    (leftmost on ties). A heap with lazy invalidation keeps it O(n log n)."""
    ids = self._initial_ids(text)
    n = len(ids)
    if n > 1:
      vocab, lookup, scores = self._vocab, self._lookup, self._scores
      prev = list(range(-1, n - 1))
      nxt = list(range(1, n + 1))
      nxt[-1] = -1
      version = [0] * n
      alive = [True] * n
      heap = []

      def push(i):
        j = nxt[i]
        if j < 0:
          return
        merged = lookup.get(vocab[ids[i]] + vocab[ids[j]])
        if merged is not None:
          # Positions keep their left-to-right order, so (-score, i) picks run.c's pair.
          heapq.heappush(heap, (-scores[merged], i, version[i], j, version[j], merged))

      for i in range(n - 1):
        push(i)
      while heap:
        _, i, vi, j, vj, merged = heapq.heappop(heap)
        if not (alive[i] and alive[j] and version[i] == vi and version[j] == vj and nxt[i] == j):
          continue
        ids[i] = merged
        version[i] += 1
        alive[j] = False
        nxt[i] = nxt[j]
        if nxt[j] >= 0:
          prev[nxt[j]] = i
        if prev[i] >= 0:
          push(prev[i])
        push(i)
      ids = [ids[i] for i in range(n) if alive[i]]
    return ([self.bos_id] if add_bos else []) + ids

  def decode(self, ids: Sequence[int]) -> str:
    """run.c's `decode` over a sequence: special ids are dropped, the first piece after BOS loses
    its leading space, "<0xXX>" pieces are raw bytes; invalid UTF-8 becomes U+FFFD."""
    output, size, bos = self._output, len(self._vocab), self.bos_id
    if type(ids) is list and ids and _NUM_SPECIAL <= min(ids) and max(ids) < size:
      # The common case, generated text: no special id, so no piece follows BOS.
      try:
        return b"".join(map(output.__getitem__, ids)).decode("utf-8", errors="replace")
      except TypeError:       # ids that are not integers (5.0): the loop below converts them
        pass
    out = []
    prev = None
    for token in ids:
      token = int(token)
      if token < 0 or token >= size:
        raise ValueError(f"token id {token} is outside the vocabulary [0, {size})")
      if token < _NUM_SPECIAL:
        prev = token
        continue
      piece = output[token]
      if prev == bos and self._bytes[token] is None and piece.startswith(b" "):
        piece = piece[1:]
      out.append(piece)
      prev = token
    return b"".join(out).decode("utf-8", errors="replace")


def find_llama2c_tokenizer(folder, vocab_size: Optional[int] = None) -> Optional[pathlib.Path]:
  """The `tok*.bin` beside a llama2.c checkpoint: the only one, or among several the one whose
  vocabulary size matches `vocab_size` (then the first by name). None when there is none."""
  candidates = sorted(p for p in pathlib.Path(folder).glob("tok*.bin") if p.is_file())
  if len(candidates) <= 1:
    return candidates[0] if candidates else None
  if vocab_size is not None:
    for path in candidates:
      try:
        if Llama2cTokenizer.from_file(path).vocab_size == vocab_size:
          return path
      except ValueError:
        continue
  return candidates[0]


# ----------------------------------------------------------------------------- Hugging Face

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _byte_alphabet() -> dict:
  """GPT-2's byte-level alphabet, character -> byte (its `bytes_to_unicode`, inverted): the
  printable bytes stand for themselves, the others for the characters from U+0100 on."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) +
               list(range(0xAE, 0xFF + 1)))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[chr(b)] = b
    else:
      chars[chr(256 + extra)] = b
      extra += 1
  return chars


class HFTokenizer:
  """A `transformers` tokenizer behind the common interface.

  encode(add_bos=True) adds BOS exactly when the tokenizer itself does (its post-processor or
  add_bos_token), never twice, and never appends an EOS.
  """

  def __init__(self, hf_tokenizer, eos_ids: Sequence[int] = ()):
    self.hf = hf_tokenizer
    self.bos_id: Optional[int] = hf_tokenizer.bos_token_id
    eos = [hf_tokenizer.eos_token_id] if hf_tokenizer.eos_token_id is not None else []
    for token in eos_ids:
      if int(token) not in eos:
        eos.append(int(token))
    self.eos_ids: tuple = tuple(int(t) for t in eos)
    probe = hf_tokenizer.encode("a", add_special_tokens=True)
    self._adds_bos = self.bos_id is not None and bool(probe) and probe[0] == self.bos_id
    self._special = set(int(t) for t in hf_tokenizer.all_special_ids)

  @classmethod
  def from_folder(cls, folder, eos_ids: Sequence[int] = ()) -> Optional["HFTokenizer"]:
    """None when the folder holds no tokenizer files."""
    folder = pathlib.Path(folder)
    if not any((folder / name).exists() for name in _HF_TOKENIZER_FILES):
      return None
    import transformers  # heavy: imported only when a Hugging Face folder is loaded
    try:
      hf_tokenizer = transformers.AutoTokenizer.from_pretrained(os.fspath(folder))
    except Exception as e:  # noqa: BLE001 - report any tokenizer problem at the boundary
      raise ValueError(f"{folder}: transformers could not load the tokenizer: {e}") from e
    return cls(hf_tokenizer, eos_ids)

  @property
  def vocab_size(self) -> int:
    return len(self.hf)

  def pieces(self) -> list[str]:
    return [str(p) for p in self.hf.convert_ids_to_tokens(list(range(len(self.hf))))]

  def token_bytes(self) -> list:
    """The bytes each id writes into the text; None for special and added control tokens.
    Byte-level BPE vocabularies (GPT-2 / Llama-3 / Qwen / SmolLM: every piece spelled in
    GPT-2's byte alphabet) map each character back to its byte; sentencepiece ones (Llama 2,
    Mistral, Gemma) read "\u2581" as a space and "<0xXX>" as that byte."""
    if getattr(self, "_token_bytes", None) is None:
      pieces = self.pieces()
      added = getattr(self.hf, "added_tokens_decoder", {}) or {}
      special = self._special | {int(i) for i, t in added.items() if getattr(t, "special", True)}
      alphabet = _byte_alphabet()
      text_pieces = [p for i, p in enumerate(pieces) if i not in special]
      spelled = sum(all(c in alphabet for c in p) for p in text_pieces)
      byte_level = spelled >= 0.99 * max(len(text_pieces), 1)   # odd added tokens aside
      out = []
      for i, piece in enumerate(pieces):
        if i in special:
          out.append(None)
        elif byte_level:
          out.append(bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece)
                     else piece.encode())
        else:
          byte = _byte_of_piece(piece.encode())
          out.append(bytes([byte]) if byte is not None else piece.replace("\u2581", " ").encode())
      self._token_bytes = tuple(out)
    return list(self._token_bytes)

  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    ids = list(self.hf.encode(text, add_special_tokens=False))
    if add_bos and self._adds_bos and not (ids and ids[0] == self.bos_id):
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Sequence[int]) -> str:
    """Special tokens are dropped. An id outside the vocabulary is a ValueError, as in
    Llama2cTokenizer (the backend would drop one past the end and overflow on a negative one)."""
    ids = [int(t) for t in ids]
    size = len(self.hf)
    bad = next((t for t in ids if not 0 <= t < size), None)
    if bad is not None:
      raise ValueError(f"token id {bad} is outside the vocabulary [0, {size})")
    return self.hf.decode(ids, skip_special_tokens=True)
