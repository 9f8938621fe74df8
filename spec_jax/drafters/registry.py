"""The one table of draft sources: every drafter class, and every trainable head kind.

    DRAFTERS        the library's drafter classes (DraftModel, NGram, the heads, DFlash, the
                    Gemma 4 assistant); TREE_DRAFTERS: the names of those whose supports_tree
                    is True (error messages list them)
    KINDS           {kind: HeadKind} of the trainable heads: the name heads.json, the trainer's
                    `head.kind`, the bench's KIND:PATH and `drafters.load` use; HEAD_KINDS its
                    names

A HeadKind is one line: the drafter class, a label for messages, the trainer's loss (by key),
and the trainer options its `init` takes (`Option`: the YAML key under `head:`, the init
argument it fills, its default there). Tree support is read from the class (`supports_tree`),
so the table cannot disagree with the code. The loss is named by key because the losses live
in the trainer (`train.losses.LOSSES` maps each key to its function; the drafters layer never
imports the trainer): a new kind reuses a loss key whose function its class serves (the
"feature_head" loss needs target_feature / unroll / logits, as FeatureHead has), or adds one
there.

A new trainable head is its module (a FrozenDrafter with `kind`, `init(target, key=None,
...)`, `hyper_params()` and, for its loss, the methods above), one line in KINDS (with the
import of its class) and a YAML config with `head: {kind: NAME}`. Its `init` must take back
what `hyper_params()` saves (heads.json rebuilds the head with `from_hyper_params`; a
FeatureHead's saves intermediate_size and num_heads, the rest it derives).

Everything that names kinds reads this table: train.config (the `head:` schema and its
checks), train.distill_heads (building heads, choosing the loss), the bench's drafter specs,
`drafters.load` (rebuilding a saved head: `build`) and the error messages.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from spec_jax.drafters.dflash import DFlash
from spec_jax.drafters.draft_model import DraftModel
from spec_jax.drafters.dspark import DSpark
from spec_jax.drafters.eagle import EAGLE, EAGLE3, EAGLE3Fused
from spec_jax.drafters.gemma4_assistant import Gemma4Assistant
from spec_jax.drafters.medusa import Medusa
from spec_jax.drafters.mtp import MTP
from spec_jax.drafters.ngram import NGram


@dataclasses.dataclass(frozen=True)
class Option:
  """A trainer option a kind's `init` takes: `head.<key>` in the YAML fills init argument
  `arg`; `default` is its value when the YAML leaves it out (None: not passed, the init's own
  default applies)."""
  key: str
  arg: str
  default: Any = None
  doc: str = ""


@dataclasses.dataclass(frozen=True)
class HeadKind:
  """A trainable head kind (module docstring).

  name: the kind (cls.kind); cls: its FrozenDrafter class; label: its name in messages;
  loss: the key of its loss in train.losses.LOSSES; options: the trainer options its init
  takes; draft_vocabulary: it takes `draft_tokens`, a reduced draft vocabulary the trainer
  picks from the data (head.draft_vocab_size).
  """
  name: str
  cls: type
  label: str
  loss: str
  options: tuple = ()
  draft_vocabulary: bool = False

  @property
  def tree(self) -> bool:
    """Whether its drafters build draft trees (the class's supports_tree)."""
    return bool(self.cls.supports_tree)

  def init_args(self, head_config: dict) -> dict:
    """The init arguments of the trainer's `head:` section (options left None are not passed;
    lists become tuples)."""
    out = {}
    for o in self.options:
      value = head_config.get(o.key, o.default)
      if value is not None:
        out[o.arg] = tuple(value) if isinstance(value, list) else value
    return out


INIT_STD = Option("init_std", "init_std", 0.02, "random init scale of the head's layers")
MLP = Option("intermediate_size", "intermediate_size", None,
             "MLP width of the head's layers (None: the target's)")
HEADS = Option("num_heads", "num_heads", None,
               "attention heads of the head's layers (None: the target's)")
LAYERS = Option("target_layers", "target_layers", None,
                "captured target layers, as layer-output indices (None: the kind's default)")

BLOCK = Option("block_size", "block_size", 8,
               "b: the block's slots (DFlash: the last committed token + b-1 mask slots, "
               "b-1 drafts; DSpark: b drafts)")
BLOCK_LAYERS = Option("num_layers", "num_layers", 1, "drafter decoder layers")
MASK_ID = Option("mask_token_id", "mask_token_id", None,
                 "a reserved target id for the mask slots (None: a learned embedding)")

KINDS = {k.name: k for k in (
    HeadKind("medusa", Medusa, "Medusa", "medusa",
             (Option("num_draft", "num_heads", None, "K: one head per draft position"),
              Option("medusa_layers", "num_layers", 1, "residual SiLU blocks per Medusa head"))),
    HeadKind("eagle", EAGLE, "EAGLE", "feature_head", (INIT_STD, MLP, HEADS)),
    HeadKind("eagle3", EAGLE3, "EAGLE-3", "feature_head", (INIT_STD, MLP, HEADS, LAYERS),
             draft_vocabulary=True),
    HeadKind("eagle3_fused", EAGLE3Fused, "EAGLE-3 (fused)", "feature_head",
             (INIT_STD, MLP, HEADS, LAYERS)),
    HeadKind("mtp", MTP, "MTP", "feature_head", (INIT_STD, MLP)),
    HeadKind("dflash", DFlash, "DFlash", "dflash", (INIT_STD, MLP, HEADS, LAYERS, BLOCK,
                                                    BLOCK_LAYERS, MASK_ID)),
    HeadKind("dspark", DSpark, "DSpark", "dspark",
             (INIT_STD, MLP, HEADS, LAYERS, BLOCK, BLOCK_LAYERS, MASK_ID,
              Option("markov_rank", "markov_rank", None,
                     "DSpark: rank r of the Markov head (0: none; None: the init's default)"),
              Option("markov_head", "markov_head", None, "DSpark: vanilla | gated | rnn"),
              Option("confidence_head", "confidence_head", None,
                     "DSpark: train the per-slot confidence head"),
              Option("readout", "readout", None,
                     "DSpark: next (DeepSpec: b drafts) | mask (DFlash's slots: b - 1)"))),
)}
HEAD_KINDS = tuple(KINDS)

DRAFTERS = (DraftModel, NGram) + tuple(k.cls for k in KINDS.values()) + (Gemma4Assistant,)
TREE_DRAFTERS = tuple(c.__name__ for c in DRAFTERS if c.supports_tree)


def _check_table() -> None:
  """Import-time consistency: each kind's class carries its name, and an option key means one
  default everywhere."""
  defaults = {}
  for k in KINDS.values():
    if k.cls.kind != k.name:
      raise ValueError(f"registry: kind {k.name!r} lists {k.cls.__name__} (kind "
                       f"{k.cls.kind!r}); a kind's class must carry its name")
    for o in k.options:
      if defaults.setdefault(o.key, o.default) != o.default:
        raise ValueError(f"registry: option head.{o.key} has two defaults "
                         f"({defaults[o.key]!r}, {o.default!r})")


_check_table()


def kind(name: str) -> HeadKind:
  """The HeadKind named `name`; ValueError naming the known ones."""
  if name not in KINDS:
    raise ValueError(f"unknown head kind {name!r}; known: {', '.join(HEAD_KINDS)}")
  return KINDS[name]


def kind_of(drafter) -> Optional[HeadKind]:
  """The HeadKind of a drafter (by its `kind`), or None for a drafter that is not one."""
  return KINDS.get(getattr(drafter, "kind", None))


def labels(kinds) -> str:
  """'EAGLE / EAGLE-3 / MTP': the labels of some kinds, for messages."""
  return " / ".join(k.label for k in kinds)


def with_loss(loss: str) -> tuple:
  """The kinds trained with loss `loss`."""
  return tuple(k for k in KINDS.values() if k.loss == loss)


def option_defaults() -> dict:
  """{head.<key>: default} of every kind's trainer options (the `head:` schema's defaults)."""
  return {o.key: o.default for k in KINDS.values() for o in k.options}


def build(name: str, target, hyper_params: dict, key=None, **options):
  """A fresh drafter of kind `name` for `target` (a Model) from saved or configured
  hyper-parameters (its class's from_hyper_params; `options` such as init_std or
  greedy_drafts go to init)."""
  return kind(name).cls.from_hyper_params(target, dict(hyper_params), key=key, **options)
