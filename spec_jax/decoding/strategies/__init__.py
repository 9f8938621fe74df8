"""Round strategies: how decode runs its rounds (sj.strategies).

  base.py       Strategy, the interface (bind / init / round / run over a state it owns)
  chain.py      Chain(K): K drafts every round; K = 0 is plain decoding
  tree.py       Tree(spec): a draft tree verified in one forward (spec_jax.tree)
  governed.py   Governed(governor): K chosen every round by the governor (num_draft="auto")
  tuned.py      TunedDraftTemperature(K): a chain whose rows choose their drafts' temperature
  arguments.py  strategy_for: a call's strategy= (or num_draft= / tree= / governor=), bound

    sj.generate(model, prompts, drafter=d, strategy=sj.strategies.Chain(4))
    sj.generate(model, prompts, drafter=d, strategy="auto")

A new strategy is a module here and its name below.
"""

from spec_jax.decoding.strategies.arguments import strategy_for
from spec_jax.decoding.strategies.base import Strategy
from spec_jax.decoding.strategies.chain import Chain
from spec_jax.decoding.strategies.governed import Governed
from spec_jax.decoding.strategies.tree import Tree
from spec_jax.decoding.strategies.tuned import TunedDraftTemperature

__all__ = ["Strategy", "Chain", "Tree", "Governed", "TunedDraftTemperature", "strategy_for"]
