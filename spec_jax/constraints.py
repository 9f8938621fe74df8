"""Grammar-constrained decoding: a regex or a JSON schema, compiled on the host into a
token-level automaton stored as arrays and evaluated inside the jitted decode as a logits
processor (spec_jax.processors), exactly lossless under speculation.

    out = sj.generate(model, prompts, drafter=..., constraint=sj.constraints.regex(r"\\d{3}"))
    out = sj.generate(model, prompts, constraint=sj.constraints.json_schema(schema))

`regex` / `json_schema` make a `Constraint` (what to accept, no tokenizer yet); generate()
compiles it for the target's tokenizer (`Constraint.compile`), giving a `Grammar` processor:

  states    the automaton's states over the tokenizer's tokens (outlines-core's `Index`: the
            regex's byte-level DFA walked with every token's bytes; JSON schemas become a regex
            first, outlines-core's `build_regex_from_schema`).
  classes   int32 [V]: the tokens with the same transitions in every state share a class
            (class 0: never allowed: special tokens, ids past the tokenizer). A JSON schema
            over SmolLM2's 49,152 tokens has ~800 states but only ~1-2k classes, so the table
            is [S, C] int32 (a few MB), not [S, V].
  next      int32 [S, C]: the state after a token of class c in state s, -1 = not allowed.
            The end tokens (the decode's stop tokens) are allowed exactly in accepting states;
            a row in an accepting state with no other way on can only end: decoding stops by
            itself once the grammar admits nothing more.

Inside the jit a row's state is one int32; a verify position's state is the committed one
advanced along the drafted prefix (tree nodes: along their ancestors), so a draft outside the
grammar gets target probability 0 (rejected) and the corrected token is drawn from the
constrained target: the output distribution is that of constrained plain sampling. States
that cannot reach an accepting state are pruned on the host (a row never gets stuck), and the
one "dead" state (after a token that the row never emits: a rejected draft's position) allows
every token, so no distribution is ever empty.

Why outlines-core (measured, docs/sampling.md): it is the one of the three maintained
libraries (outlines-core, xgrammar, llguidance) that yields a finite token-level automaton;
xgrammar and llguidance evaluate a pushdown grammar on the host and hand out one token mask per
step, which cannot advance along drafted prefixes inside a jitted loop.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import re
import time
from typing import Any, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from spec_jax.processors import LogitsProcessor, params_field

_PAD = 64      # table sizes are padded to multiples of this: similar grammars share a compile


@dataclasses.dataclass(frozen=True)
class Constraint:
  """What a constrained decode must produce: kind ("regex" | "json_schema"), the source text
  (the pattern, or the schema as JSON), and the regex it becomes. Not bound to a tokenizer:
  `compile` does that (generate() calls it with the target's tokenizer)."""
  kind: str
  source: str
  pattern: str

  def compile(self, tokenizer=None, *, vocab_size: int, end_ids: Sequence[int],
              vocabulary: Optional[Sequence[Optional[bytes]]] = None) -> "Grammar":
    """The Grammar processor for a tokenizer (its `token_bytes()`), or for `vocabulary`
    (bytes per token id, None for tokens that never appear in text). vocab_size: the model's
    V (>= the tokenizer's); end_ids: the tokens that end a row (allowed in accepting states).
    ValueError when the pattern is invalid or no token sequence satisfies it."""
    if vocabulary is None:
      if tokenizer is None or not hasattr(tokenizer, "token_bytes"):
        raise ValueError("a constraint needs the target's tokenizer (a model loaded with one) "
                         "or an explicit vocabulary of token bytes")
      vocabulary = tokenizer.token_bytes()
    end_ids = tuple(int(t) for t in end_ids)
    if not end_ids:
      raise ValueError("a constraint needs at least one end token (the model's EOS or a stop "
                       "token) to end a row once the grammar is complete")
    return _compile(self, tuple(vocabulary), int(vocab_size), end_ids)


def regex(pattern: str) -> Constraint:
  """Output constrained to match `pattern` in full (outlines-core's regex syntax: Rust's
  `regex` crate, anchored at both ends: ^, $, \\A and \\z are refused, as is verbose mode)."""
  if not isinstance(pattern, str) or not pattern:
    raise ValueError(f"regex: the pattern must be a non-empty string, got {pattern!r}")
  check_pattern(pattern)
  return Constraint(kind="regex", source=pattern, pattern=pattern)


_FLAGS = re.compile(r"\(\?([a-zA-Z]*)(?:-[a-zA-Z]*)?[:)]")    # a group's flags, set before any '-'


def check_pattern(pattern: str, what: str = "regex") -> None:
  """ValueError for what the compiler's wrapper `(?:pattern)<sentinel>` would misread: groups
  that do not balance (`a)|(b` closed the wrapper's group and compiled into another language),
  anchors (`$` can never precede the sentinel: `ab$` read as unsatisfiable, `(?m)a$` lost
  matches; the match is anchored at both ends anyway) and verbose mode (a comment swallowed
  the wrapper's `)`). Scans Rust regex syntax: escapes, nested classes."""
  depth, i, n = 0, 0, len(pattern)
  while i < n:
    c = pattern[i]
    if c == "\\":
      if pattern[i + 1:i + 2] in ("A", "z"):
        raise ValueError(f"{what}: the anchor \\{pattern[i + 1]} in {pattern!r} is not "
                         f"supported; the pattern is matched in full already, drop it")
      i += 2
      continue
    if c == "[":                                  # a class, maybe nested: skip it whole
      i += 1
      if pattern[i:i + 1] == "^":
        i += 1
      if pattern[i:i + 1] == "]":                 # a leading ] is a literal
        i += 1
      nest = 1
      while i < n and nest:
        if pattern[i] == "\\":
          i += 2
          continue
        nest += {"[": 1, "]": -1}.get(pattern[i], 0)
        i += 1
      continue
    if c == "(":
      flags = _FLAGS.match(pattern, i)               # (?x) (?ix: ...), not (?P<x>...)
      if flags and "x" in flags.group(1):
        raise ValueError(f"{what}: verbose mode (?x) in {pattern!r} is not supported")
      depth += 1
    elif c == ")":
      depth -= 1
      if depth < 0:
        raise ValueError(f"{what}: unbalanced ')' at position {i} of {pattern!r}")
    elif c in "^$":
      raise ValueError(f"{what}: the anchor {c!r} in {pattern!r} is not supported; the "
                       f"pattern is matched in full already, drop it")
    i += 1
  if depth:
    raise ValueError(f"{what}: {depth} unclosed '(' in {pattern!r}")


# JSON-schema keywords outlines-core's regex builder enforces (or narrows to a valid subset:
# extra properties and extra prefixItems never allowed), and annotations that constrain
# nothing. Anything else it ignores (minimum, maximum, multipleOf, uniqueItems, contains,
# maxProperties, not, if/then, dependentRequired, ...), so the output could break the schema:
# refused. `pattern` is refused too: outlines-core pastes it between the quotes unguarded (a
# '.' emitted '"' and control characters: not JSON). `oneOf` compiles as anyOf: refused with
# more than one branch.
_SCHEMA_KEYWORDS = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "minLength", "maxLength", "minProperties", "format", "enum",
    "const", "anyOf", "allOf", "oneOf", "$ref", "$defs", "definitions",
    "title", "description", "$schema", "$id", "id", "default", "examples", "$comment",
    "nullable", "readOnly", "writeOnly", "deprecated"}
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "allOf", "oneOf")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def check_schema(node, where: str = "#") -> None:
  """ValueError for a keyword (anywhere in the schema) that the grammar would not enforce."""
  if isinstance(node, bool):
    return
  if not isinstance(node, dict):
    raise ValueError(f"json_schema: {where} must be a schema object, got {node!r}")
  unknown = sorted(set(node) - _SCHEMA_KEYWORDS)
  if unknown:
    raise ValueError(f"json_schema: {where} uses {', '.join(unknown)}, which the grammar would "
                     f"not enforce (outlines-core ignores or mis-compiles them), so outputs "
                     f"could break the schema; supported: "
                     f"{', '.join(sorted(_SCHEMA_KEYWORDS))}")
  if len(node.get("oneOf") or ()) > 1:
    raise ValueError(f"json_schema: {where}/oneOf compiles as anyOf (a value matching two "
                     f"branches would pass); write anyOf if the branches cannot overlap")
  required = node.get("required") or []
  missing = [r for r in required if r not in (node.get("properties") or {})]
  if missing:
    raise ValueError(f"json_schema: {where}/required names {missing}, which are not in its "
                     f"properties: the grammar would not require them")
  for key in _SUBSCHEMA_MAPS:
    for name, sub in (node.get(key) or {}).items():
      check_schema(sub, f"{where}/{key}/{name}")
  for key in _SUBSCHEMA_LISTS:
    for j, sub in enumerate(node.get(key) or ()):
      check_schema(sub, f"{where}/{key}/{j}")
  for key in ("items", "additionalProperties"):
    if isinstance(node.get(key), dict):
      check_schema(node[key], f"{where}/{key}")


def json_schema(schema, whitespace: Optional[str] = None) -> Constraint:
  """Output constrained to one JSON value valid under `schema` (a dict or its JSON text).
  whitespace: the regex of the whitespace allowed between tokens (outlines-core's default
  when None)."""
  text = schema if isinstance(schema, str) else json.dumps(schema)
  try:
    parsed = json.loads(text)
  except (TypeError, ValueError) as e:
    raise ValueError(f"json_schema: the schema is not valid JSON: {e}") from e
  check_schema(parsed)
  from outlines_core.json_schema import build_regex_from_schema
  try:
    pattern = build_regex_from_schema(text, whitespace)
  except Exception as e:  # noqa: BLE001 - outlines raises its own types
    raise ValueError(f"json_schema: outlines-core cannot turn this schema into a grammar: "
                     f"{e}") from e
  return Constraint(kind="json_schema", source=text, pattern=pattern)


def from_pair(pair) -> Optional[Constraint]:
  """(kind, source) as a Constraint: how the eval harness stores one (("regex", pattern) or
  ("json_schema", schema text)); None -> None."""
  if pair is None:
    return None
  kind, source = pair
  makers = {"regex": regex, "json_schema": json_schema}
  if kind not in makers:
    raise ValueError(f"a constraint is ('regex', pattern) or ('json_schema', schema), got "
                     f"{kind!r}")
  return makers[kind](source)


@dataclasses.dataclass(frozen=True)
class Grammar(LogitsProcessor):
  """A compiled constraint as a LogitsProcessor (module docstring). Static: the padded table
  sizes and the tables' fingerprint (so a jit that reads `params` as constants never mixes up
  two grammars); generate() shares one compiled decode between grammars of equal sizes
  (`shape_key`), since it passes the tables as arguments. params: (classes int32 [V],
  next int32 [S, C], initial int32 []). State: int32 [] the automaton's state."""
  num_states: int
  num_classes: int
  vocab_size: int
  fingerprint: str = ""
  tables: Any = params_field(default=None)
  constraint: Optional[Constraint] = params_field(default=None)
  accepting: Any = params_field(default=None)      # bool [S] host-side: the accepting states
  sizes: Any = params_field(default=None)          # dict: states, classes, transitions
  compile_seconds: float = params_field(default=0.0)

  @property
  def params(self):
    return self.tables

  def shape_key(self) -> tuple:
    """What a compiled decode that takes the tables as arguments depends on."""
    return ("Grammar", self.num_states, self.num_classes, self.vocab_size)

  @property
  def dead(self) -> int:
    """The state after a token the grammar does not allow (row num_states - 1)."""
    return self.num_states - 1

  def init(self, params, prompt, prompt_len):
    del prompt, prompt_len
    return jnp.asarray(params[2], jnp.int32)

  def allowed(self, params, state):
    """bool [V]: the tokens allowed in `state`."""
    classes, nxt, _ = params
    return jnp.asarray(nxt)[state][jnp.asarray(classes)] >= 0

  def process(self, params, logits, state):
    return jnp.where(self.allowed(params, state), logits, -jnp.inf)

  def advance(self, params, state, token):
    classes, nxt, _ = params
    after = jnp.asarray(nxt)[state, jnp.asarray(classes)[token]]
    return jnp.where(after >= 0, after, self.dead).astype(jnp.int32)

  # host-side helpers (tests, docs)
  def walk(self, tokens: Sequence[int]) -> Optional[int]:
    """The state after the token sequence, None when the grammar refuses one (numpy, on the
    host)."""
    classes, nxt, initial = (np.asarray(x) for x in self.tables)
    state = int(initial)
    for t in tokens:
      state = int(nxt[state, classes[int(t)]])
      if state < 0 or state == self.dead:
        return None
    return state

  def accepts(self, tokens: Sequence[int]) -> bool:
    """Whether the token sequence (end tokens excluded) is a complete sentence of the grammar."""
    state = self.walk(tokens)
    return state is not None and bool(self.accepting[state])

  def complete(self, tokens: Sequence[int], end_ids: Sequence[int]) -> bool:
    """Whether a generated row (one end token last, when one ended it) is a whole sentence of
    the grammar: a row cut by max_new_tokens may be one, or only a prefix of one."""
    tokens = list(tokens)
    if tokens and tokens[-1] in set(int(t) for t in end_ids):
      tokens = tokens[:-1]
    return self.accepts(tokens)

  def admits(self, tokens: Sequence[int]) -> bool:
    """Whether the token sequence is a prefix of some sentence of the grammar (every state
    kept can still reach an accepting one)."""
    return self.walk(tokens) is not None


# (constraint, vocabulary id, V, end ids) -> Grammar, the CACHE_SIZE most recently used: a
# grammar holds tables of the vocabulary's size (~0.2 MB on SmolLM2's), and a server compiling
# one schema per request would otherwise keep every one.
_CACHE: "collections.OrderedDict" = collections.OrderedDict()
CACHE_SIZE = 32


def _compile(constraint: Constraint, vocabulary: tuple, vocab_size: int,
             end_ids: tuple) -> Grammar:
  key = (constraint, hash(vocabulary), vocab_size, end_ids)
  hit = _CACHE.get(key)
  if hit is not None:
    _CACHE.move_to_end(key)
    return hit
  start = time.perf_counter()
  if len(vocabulary) > vocab_size:
    raise ValueError(f"the tokenizer has {len(vocabulary)} tokens but the model only "
                     f"{vocab_size}")
  bad = [t for t in end_ids if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"end token ids {bad} are outside the vocabulary [0, {vocab_size})")
  states, transitions, initial, finals = _token_automaton(constraint, vocabulary, end_ids)
  grammar = _tables(constraint, states, transitions, initial, finals, vocab_size, end_ids)
  object.__setattr__(grammar, "compile_seconds", time.perf_counter() - start)
  _CACHE[key] = grammar
  while len(_CACHE) > CACHE_SIZE:
    _CACHE.popitem(last=False)
  return grammar


# outlines-core 0.2.14 drops every transition from an accepting state to a non-accepting one
# (tried: "(ab)*" over the tokens a, b allows "a" nowhere), so the pattern is compiled with a
# sentinel appended: then only the state after the sentinel accepts, and the pattern's own
# accepting states are those with a move on the sentinel token (an extra id past the vocabulary).
_SENTINEL = "\ue000"


def _token_automaton(constraint, vocabulary, end_ids):
  """outlines-core's Index over the vocabulary -> (state ids, transitions int64 [M, 3] of
  (state, token, next), initial, accepting state ids); end tokens left out."""
  from outlines_core import Index, Vocabulary
  by_bytes: dict = {}
  ends = set(end_ids)
  for i, b in enumerate(vocabulary):
    if b is not None and len(b) > 0 and i not in ends:
      by_bytes.setdefault(bytes(b), []).append(i)
  if not by_bytes:
    raise ValueError("the tokenizer has no text tokens to build a grammar over")
  sentinel_id = len(vocabulary)
  by_bytes.setdefault(_SENTINEL.encode(), []).append(sentinel_id)
  try:
    index = Index(f"(?:{constraint.pattern}){_SENTINEL}", Vocabulary(end_ids[0], by_bytes))
  except Exception as e:  # noqa: BLE001 - outlines raises its own types
    why = ("no token sequence of this tokenizer satisfies" if "incompatible" in str(e) else
           "cannot build a token automaton for")
    raise ValueError(f"{constraint.kind}: {why} {_short(constraint.source)}: {e}") from e
  raw = index.get_transitions()
  rows = []
  for s, moves in raw.items():
    if moves:
      toks = np.fromiter(moves.keys(), np.int64, len(moves))
      nxt = np.fromiter(moves.values(), np.int64, len(moves))
      rows.append(np.stack([np.full_like(toks, s), toks, nxt], 1))
  trans = np.concatenate(rows) if rows else np.zeros((0, 3), np.int64)
  finals = set(int(s) for s in index.get_final_states())
  # The pattern's accepting states: those with a move on the sentinel token. The states after
  # the sentinel (and inside a spelling of it by byte tokens) are pruned later: they reach no
  # accepting state once the moves into the sentinel's final state are gone.
  # Only a sentinel move INTO a final state ends the pattern: where the pattern itself can
  # read U+E000 ('.', '[^"]' in every JSON string), a sentinel move inside it is the pattern
  # going on, and counting its source as accepting let rows end mid-string.
  accepting = set(trans[(trans[:, 1] == sentinel_id) &
                        np.isin(trans[:, 2], list(finals)), 0].tolist())
  trans = trans[~np.isin(trans[:, 1], list(ends) + [sentinel_id]) &
                ~np.isin(trans[:, 2], list(finals))]
  initial = int(index.get_initial_state())
  states = sorted(set(raw.keys()) | set(trans[:, 2].tolist()) | {initial} | finals)
  return states, trans, initial, accepting


def _tables(constraint, states, trans, initial, finals, vocab_size, end_ids) -> Grammar:
  """Dense state ids, states pruned to those that can still reach an accepting state, token
  classes, the padded [S, C] table."""
  index_of = {s: i for i, s in enumerate(states)}
  remap = np.vectorize(index_of.__getitem__, otypes=[np.int64])
  n = len(states)
  src = remap(trans[:, 0]) if len(trans) else np.zeros(0, np.int64)
  dst = remap(trans[:, 2]) if len(trans) else np.zeros(0, np.int64)
  tok = trans[:, 1]
  accepting = np.zeros(n, bool)
  accepting[[index_of[s] for s in finals]] = True
  # Keep the states that can reach an accepting one (backwards fixpoint), drop moves into others.
  live = accepting.copy()
  while True:
    grow = live.copy()
    grow[src[live[dst]]] = True
    if (grow == live).all():
      break
    live = grow
  start = index_of[initial]
  if not live[start]:
    raise ValueError(f"{constraint.kind}: no token sequence of this tokenizer satisfies "
                     f"{_short(constraint.source)}")
  keep = live[dst] & live[src]
  src, dst, tok = src[keep], dst[keep], tok[keep]
  # Token classes: tokens with identical (state -> next) maps share one. Class 0: none.
  order = np.lexsort((src, tok))
  src, dst, tok = src[order], dst[order], tok[order]
  bounds = np.flatnonzero(np.diff(tok)) + 1
  starts = np.concatenate([[0], bounds]) if len(tok) else np.zeros(0, np.int64)
  ends_ = np.concatenate([bounds, [len(tok)]]) if len(tok) else np.zeros(0, np.int64)
  classes = np.zeros(vocab_size, np.int32)
  signature_class: dict = {}
  reps = []                                          # class c (>= 1) -> (states, nexts)
  for a, b in zip(starts, ends_):
    sig = src[a:b].tobytes() + b"|" + dst[a:b].tobytes()
    c = signature_class.get(sig)
    if c is None:
      c = signature_class[sig] = len(reps) + 1
      reps.append((src[a:b], dst[a:b]))
    classes[tok[a]] = c
  end_class = len(reps) + 1
  classes[list(end_ids)] = end_class
  num_classes = _round_up(end_class + 1)
  num_states = _round_up(n + 1)                      # + the dead state (the last row)
  dead = num_states - 1
  nxt = np.full((num_states, num_classes), -1, np.int32)
  for c, (s, d) in enumerate(reps, start=1):
    nxt[s, c] = d
  acc = np.flatnonzero(accepting & live)
  nxt[acc, end_class] = acc                          # an end token: allowed when complete
  nxt[n:] = dead                                     # padding rows and the dead state allow all
  info = np.zeros(num_states, bool)
  info[:n] = accepting & live
  tables = (classes, nxt, np.asarray(start, np.int32))
  digest = hashlib.sha256(b"".join(np.ascontiguousarray(t).tobytes() for t in tables))
  return Grammar(num_states=num_states, num_classes=num_classes, vocab_size=vocab_size,
                 fingerprint=digest.hexdigest()[:16],
                 tables=tables, constraint=constraint, accepting=info,
                 sizes={"states": n, "classes": end_class + 1, "transitions": int(len(tok))})


def _round_up(n: int) -> int:
  return -(-n // _PAD) * _PAD


def _short(text: str, width: int = 80) -> str:
  return repr(text if len(text) <= width else text[:width] + "...")
