"""Tree drafting: TreeSpec, draft trees in fixed shapes, lossless tree verification.

Modules: spec (TreeSpec), build (DraftTree, EAGLE-2 dynamic trees, tries), verify (the
lossless verifiers). The round that uses them is the decode loop's Tree strategy
(spec_jax.decoding.strategies.tree); drafters import this package to build trees.

A chain of K drafts dies at its first wrong token; a tree keeps several candidates per position
and the target verifies all of them in ONE forward through an ancestor mask.

    sj.generate(target, prompts, drafter=d, tree=sj.TreeSpec(depth=D, top_k=k, num_nodes=N))

One round (fixed shapes; B rows, N nodes, D depth):

    drafter.propose_tree ─► DraftTree: node 0 = the last committed token (the root), nodes
        1..N = drafts with parent index < own index, depth 1..D, unused nodes padded (valid
        False)
    target forward over the N+1 nodes at cache slots lengths-1 .. lengths-1+N, RoPE positions
        lengths-1+depth, tree_mask = ancestor-or-self ─► p [B, N+1, V]
    verify (below) ─► accepted root-to-leaf path [B, D] (node ids), n_accepted, emitted tokens
        [B, D+1] (the accepted drafts, then the correction / bonus token)
    commit: tokens and lengths as for chains (decoding.rounds.commit_step); the accepted nodes'
        KV entries are moved to contiguous slots lengths .. lengths+n-1 (Target.move_kv);
        the drafter follows the accepted path (drafter.commit_tree sees the verify outputs
        gathered along it, shaped like a chain of D drafts).

Tree building (drafters call `build_dynamic_tree`; block drafters also `build_best_first_tree`;
NGram builds a trie with `trie_from_branches`):

  EAGLE-2's dynamic tree (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with
  Dynamic Draft Trees", sec. 4; SafeAILab/EAGLE `eagle/model/cnets.py` topK_generate): the root's
  top-k children form depth 1; at each further depth the k frontier nodes each get their top-k
  children, scored by the cumulative draft log-probability of their path, and the k best of
  those k^2 become the next frontier; at the end the N best of all candidates by score are kept.
  A child's score is at most its parent's, and ties keep creation order, so the kept set is
  ancestor-closed. One batched drafter forward per depth over the new frontier only: the
  earlier frontiers are already in the drafter's cache, just past the committed tokens, and
  the new nodes see them through a tree mask [B, F, W] over those W cache entries (ancestors
  and self; kernels_pallas.reference's wide tree mask).

  Sampled candidates (TreeSpec(candidates="sampled" or "distinct")): the same shape (k children
  per expanded node, k frontier nodes per depth, the N best kept), but every expanded node v
  draws its children from the drafter's q_v = sampling.probs(logits): i.i.d. ("sampled") or
  without replacement ("distinct": Gumbel-top-k, the first k draws of sampling without
  replacement, in draw order). Which children are expanded and kept must not depend on a
  child's own token, or the kept children would no longer follow q (keeping the likeliest of
  k i.i.d. draws is lossy). So nodes are ranked by a priority fixed BEFORE the node is drawn:

      prio(c_i) = min(prio(v), score(v) + log R_i),   R_i = 1 - sum_{j<i} q_v(c_j),

  with score(v) = the cumulative log q of v's path (v's own token is known when its children
  are ranked). prio never increases along a path or a sibling list, so anything whose rank
  depends on c_i's token ranks below c_i, and whether c_i is drawn, expanded or kept depends
  only on what ranks above it: the kept tree is a best-first search that decides each node
  before drawing it, and every kept child of v is, given everything decided before it, a
  fresh draw from q_v (or from q_v without the earlier siblings). Frontiers and the final N
  are chosen by prio (ties: creation order, which keeps the tree ancestor-closed).

  DDTree's best-first tree (Ringel & Romano 2026, "Accelerating Speculative Decoding with Block
  Diffusion Draft Trees", liranringel/ddtree `build_ddtree_tree`; TreeSpec(candidates=
  "best_first"), block drafters only): the N likeliest root-to-node sequences under the
  drafter's q, score(path) = sum of log q of its tokens. A block drafter's one forward gives
  every depth's child distribution (DFlash: one marginal per depth; DSpark: the Markov head's
  distribution given the node's own token), so no drafter call is needed per depth. With each
  child list sorted once, the k-best enumeration pops the best frontier entry and pushes its
  first child and its next sibling; each sequence's predecessor in that order (previous
  sibling, or parent for a first child) scores at least as high, so the pops come in score
  order, the N popped nodes are the N best sequences, and the set is prefix-closed. The tree
  is a deterministic function of the drafter's outputs, fixed before the target's uniforms:
  verified as deterministic candidates (below), lossless at every temperature. DDTree's own
  verifier samples the target at every node and follows the child holding that token; the
  recursive one-hot rule below accepts child c_i with probability exactly p(c_i) and so
  follows the same law.

Verification, chosen by how the candidates were drawn (all lossless: the emitted tokens have
exactly the target's joint distribution):

  Greedy target (temperature 0, static): walk from the root, moving to the first child whose
  token is the target's argmax at the current node; emit the argmax at the last node.

  Deterministic candidates (top-k trees, n-gram tries; q one-hot): at the current node with
  target distribution p, try the children c_1, c_2, ... in order with r_1 = p:

      accept c_i with probability r_i(c_i);    on rejection r_{i+1} = norm(r_i with c_i zeroed)

  and when every child is rejected (or there are none) draw the token from the last r. This is
  recursive rejection sampling with one-hot drafts, i.e. exact sampling from p: by induction,
  P(emit x) = r_1(c_1) [x = c_1] + (1 - r_1(c_1)) P_{r_2}(x) = p(x), since
  (1 - p(c_1)) r_2(x) = p(x) for x != c_1. It is EAGLE's `evaluate_posterior` rule for sampling
  (SafeAILab/EAGLE `eagle/model/utils.py`: qx = 1, gtp[xi] = 0, renormalise) and the k-candidate
  rule of Yang et al. 2024 ("Multi-Candidate Speculative Decoding") with one-hot drafts.

  Sampled candidates (children i.i.d. from q): SpecInfer's multi-step speculative sampling
  (Miao et al., ASPLOS 2024, "SpecInfer: Accelerating Large Language Model Serving with
  Tree-based Speculative Inference and Verification", sec. 4.2, Algorithm 2 `VerifyStochastic`,
  Theorem 4.2): with r_1 = p,

      accept c_i with probability min(1, r_i(c_i) / q(c_i));
      on rejection r_{i+1} = norm(max(r_i - q, 0));

  all rejected -> draw from the last r. Each step is Leviathan et al.'s rejection sampler
  applied to the residual target r_i (emit ~ r_i exactly when c_i ~ q independently), so the
  emitted token has distribution r_1 = p.

  Distinct candidates (drawn without replacement from q): recursive rejection sampling (Jeon et
  al. 2024, "Recursive Speculative Decoding: Accelerating LLM Inference via Sampling Without
  Replacement", sec. 3, Algorithm 1): the same step with the proposal of the i-th draw,
  q_1 = q, q_{i+1} = norm(q_i with c_i zeroed):

      accept c_i with probability min(1, r_i(c_i) / q_i(c_i));
      on rejection r_{i+1} = norm(max(r_i - q_i, 0)),  q_{i+1} = norm(q_i with c_i zeroed).

  c_{i+1} given c_1..c_i is a draw from q_{i+1}, so each step is again exact for r_i.

  Every rule continues at the accepted child with its own p; a node's children are fixed
  before, and independently of, the uniforms at the node, so by induction over depth the
  emitted sequence has the target's joint.

`verify_tree` is the vectorised verification (one pass over the nodes in index order, which is
topological: a node's children come after it and siblings are tried in index order);
`verify_tree_reference` is the same math written plainly (explicit child lists, one row at a
time), the test oracle. They draw the same uniforms, so they return the same tokens.
"""

from spec_jax.tree.build import (DraftTree, ExpandFn, NodeLogitsFn, ancestor_mask,
                                 build_best_first_tree, build_dynamic_tree, expand_q,
                                 trie_from_branches)
from spec_jax.tree.spec import CANDIDATES, MAX_TREE_TOKENS, TreeSpec, check_tree, parse_tree_spec
from spec_jax.tree.verify import (residual_deterministic, residual_sampled, verify_tree,
                                  verify_tree_greedy, verify_tree_logits, verify_tree_reference)

__all__ = ["TreeSpec", "parse_tree_spec", "check_tree", "CANDIDATES", "MAX_TREE_TOKENS",
           "DraftTree", "ExpandFn", "NodeLogitsFn", "ancestor_mask", "build_dynamic_tree",
           "build_best_first_tree", "expand_q", "trie_from_branches",
           "verify_tree", "verify_tree_logits", "verify_tree_greedy", "verify_tree_reference",
           "residual_sampled", "residual_deterministic"]
