"""The decode core and the host side above it, each module importing only those above it in
this list (the layers of tests/test_imports.py):

  decode core
    target.py       the target protocol (Target; ModelTarget wraps spec_jax.models)
    state.py        DecodeState (the loop carry), RowCounts, DecodeResult, LoopEnv
    checks.py       the static-argument checks decode, generate and the strategies share
    rounds.py       the round primitives (draft / verify / accept / commit / statistics) and
                    the chain round
  strategies/       how the rounds run: Strategy (the interface), Chain, Tree, Governed, and
                    strategy_for (a call's strategy=, or num_draft= / tree= / governor=)
  loop.py           decode: the prefill, then the strategy's rounds (sj.decode)
  host side
    compiled.py     ahead-of-time compiled decode calls, cached; the CPU execution layout
    prompts.py      prompt checks and padding
    calibration.py  sj.calibrate: the cost table a strategy that chooses by cost reads
    generate.py     generate: prompts in, text and statistics out (sj.generate)

This __init__ imports nothing: importing the core does not load the host side.
"""
