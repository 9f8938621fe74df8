"""The decode core: state, round primitives, round strategies plug in, the loop, the host side.

Modules, each importing only those above it in this list (tests/test_imports.py):

  target.py    the target protocol (Target; ModelTarget wraps spec_jax.models)
  state.py     DecodeState (the loop carry), DecodeResult, LoopEnv
  rounds.py    the round primitives (draft / verify / accept / commit / statistics), the chain
               round, and RoundStrategy, the interface every strategy implements (Chain here;
               spec_jax.tree.round.TreeRounds; spec_jax.governor.loop.Governed)
  plan.py      the static-argument checks and the strategy a call runs with
  loop.py      decode: the prefill, then the strategy's rounds
  compiled.py  ahead-of-time compiled decode calls, cached; the CPU execution-layout cache
  prompts.py   host-side prompt checks and padding
  generate.py  generate: prompts in, text and statistics out

This __init__ imports nothing, so that the lower modules can be imported by the strategies
without loading the loop.
"""
