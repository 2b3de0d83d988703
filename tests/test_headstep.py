"""The native head (core.kernels.headstep, csrc/decode_step.c's head_step): the EAGLE head's fc and
decoder layers in one call, from Q4_1 (or Q8_0) copies of its weights. It must compute what the Python
head computes from the same blocks (bit for bit, in catch-ups and in draft rounds with tree
masks, across cache growth), and the engine must keep plain decoding's output with it."""

import pytest
import torch

from core.kernels import native
from core.decoding.head import EagleHead, HeadCache, HeadConfig, KeyLayout, TreeRows, head_mask
from core.kernels.headstep import HEAD_BLOCKS_ENV, NATIVE_HEAD_ENV, NativeHead, head_block_kind, native_head, unsupported
from core.kernels.step import StepError
from core.kernels.invariant import BlockLinear

pytestmark = pytest.mark.skipif(not native.status().available,
                                reason=f"core.kernels.native unavailable: {native.status().reason}")

CONFIG = HeadConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=100, head_dim=32)


def random_head(config: HeadConfig = CONFIG, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.08)
    return head


def python_twin(head: EagleHead, fused: NativeHead) -> EagleHead:
    """The Python head on the native head's own blocks (invariant.BlockLinear)."""
    twin = EagleHead(head.config).to(torch.bfloat16)
    twin.load_state_dict(head.state_dict())
    for name, module in twin.named_modules():
        b = fused.blocks.get(f"{name}.weight")
        if b is not None:
            module.__class__ = BlockLinear
            module.blocks, module.wmat = b, native.wmat(blocks=b)
    return twin


@pytest.mark.parametrize("layers, kind", [(1, "Q4_1"), (2, "Q4_1"), (1, "Q8_0")])
def test_native_head_equals_the_python_head_on_its_blocks_in_catch_ups_and_draft_rounds(layers, kind, monkeypatch):
    monkeypatch.setenv(HEAD_BLOCKS_ENV, kind)
    config = HeadConfig(**{**CONFIG.__dict__, "num_hidden_layers": layers})
    head = random_head(config)
    fused = NativeHead(head)
    assert fused.block_kind == kind and {b.type for b in fused.blocks.values()} == {100 if kind == "Q4_1" else 101}
    twin = python_twin(head, fused)
    H = config.hidden_size
    gen = torch.Generator().manual_seed(3)
    a, b = HeadCache(config, torch.bfloat16, "cpu", capacity=4), HeadCache(config, torch.bfloat16, "cpu", capacity=4)
    with torch.inference_mode():
        for n in (6, 1, 3, 9):  # catch-ups; the caches grow past their capacity of 4
            emb, feat = torch.randn(n, H, generator=gen).bfloat16(), torch.randn(n, H, generator=gen).bfloat16()
            positions = torch.arange(a.length, a.length + n)
            mask = KeyLayout.causal(n, a.length, "cpu")
            assert torch.equal(fused.forward(emb, feat, positions, mask, a),
                               twin(emb[None], feat[None], positions, mask, b)[0])
            assert a.length == b.length
            for i in range(layers):
                assert torch.equal(a.layer_keys[i][:, :, :a.length], b.layer_keys[i][:, :, :b.length])
                assert torch.equal(a.layer_values[i][:, :, :a.length], b.layer_values[i][:, :, :b.length])
        committed = a.length
        # a draft round: 2 nodes fed before, 3 new rows that see the committed context and their ancestors
        for rows in ([(0,), (0, 1)], [(0, 2), (1, 3), (0, 2, 4)]):
            rows = TreeRows(tuple(tuple(r) for r in rows), width=a.length - committed + len(rows))
            n = len(rows.rows)
            emb, feat = torch.randn(n, H, generator=gen).bfloat16(), torch.randn(n, H, generator=gen).bfloat16()
            positions = torch.arange(committed, committed + n) + 1
            mask = head_mask(rows, a.length, n, torch.bfloat16, config, "cpu")
            assert isinstance(mask, KeyLayout) and mask.committed == committed
            assert torch.equal(fused.forward(emb, feat, positions, mask, a),
                               twin(emb[None], feat[None], positions, mask, b)[0])
        assert a.length == b.length == committed + 5


def test_catch_up_top_is_the_catch_up_then_the_draft_top_k_bit_for_bit():
    """head_step_top (one C call, gathering the rows' embeddings itself) = head_step on the looked-up
    embeddings, then the int8 draft LM head on the last row, then its k best log-probabilities: the
    same output, the same proposals, the same cache entries; a token id outside the embedding is refused."""
    from core.decoding.tree import top_log_probs

    head = random_head()
    fused = NativeHead(head)
    lm = native.Int8Weight(*_int8(torch.randn(100, 128, generator=torch.Generator().manual_seed(1)).bfloat16()))
    gen = torch.Generator().manual_seed(3)
    a, b = HeadCache(CONFIG, torch.bfloat16, "cpu", capacity=4), HeadCache(CONFIG, torch.bfloat16, "cpu", capacity=4)
    table = torch.randn(300, 128, generator=gen).bfloat16()  # the target's embedding
    with torch.inference_mode():
        for n, k in ((6, 8), (1, 1), (3, 64), (9, 5)):  # catch-ups; the caches grow past their capacity of 4
            tokens = torch.randint(0, 300, (n,), generator=gen)
            emb, feat = table[tokens], torch.randn(n, 128, generator=gen).bfloat16()
            positions = torch.arange(a.length, a.length + n)
            out = fused.forward(emb, feat, positions, KeyLayout.causal(n, a.length, "cpu"), a)
            lp, idx = top_log_probs(native.linear_s8(out[-1:], lm), k)
            hidden, lp2, idx2 = fused.catch_up_top(tokens, table, feat, b, lm, k)
            assert torch.equal(hidden, out[-1]) and torch.equal(lp2, lp[0]) and torch.equal(idx2, idx[0]), (n, k)
            assert a.length == b.length
            assert torch.equal(a.layer_keys[0][:, :, :a.length], b.layer_keys[0][:, :, :b.length])
            assert torch.equal(a.layer_values[0][:, :, :a.length], b.layer_values[0][:, :, :b.length])
        with pytest.raises(ValueError, match="k must be in 1..64"):
            fused.catch_up_top(tokens, table, feat, b, lm, 65)
        length = b.length
        with pytest.raises(StepError, match="a token id outside the embedding"):  # refused, not read out of bounds
            fused.catch_up_top(torch.tensor([3, 300]), table, feat[:2], b, lm, 4)
        assert b.length == length, "a refused catch-up adds nothing to the cache"


def _int8(weight: torch.Tensor):
    q = native._quantize(native._library()[0], weight)
    return q.q, q.scale, q.sums


def test_native_head_grows_its_rotary_table_and_stays_equal():
    head = random_head()
    fused = NativeHead(head)
    twin = python_twin(head, fused)
    a, b = HeadCache(CONFIG, torch.bfloat16, "cpu"), HeadCache(CONFIG, torch.bfloat16, "cpu")
    emb, feat = torch.randn(2, 128).bfloat16(), torch.randn(2, 128).bfloat16()
    positions = torch.tensor([5000, 5001])  # past the first table's 4,096 rows
    mask = KeyLayout.causal(2, 0, "cpu")
    with torch.inference_mode():
        assert torch.equal(fused.forward(emb, feat, positions, mask, a), twin(emb[None], feat[None], positions, mask, b)[0])


def test_native_head_is_refused_where_it_cannot_run(monkeypatch):
    head = random_head()
    monkeypatch.setenv(NATIVE_HEAD_ENV, "0")
    assert unsupported(head) == f"{NATIVE_HEAD_ENV}=0" and native_head(head) is None
    monkeypatch.delenv(NATIVE_HEAD_ENV)
    assert "not bf16" in unsupported(random_head().float())
    biased = random_head()
    biased.layers[0].self_attn.q_proj.bias = torch.nn.Parameter(torch.zeros(128, dtype=torch.bfloat16))
    assert unsupported(biased) == "projection biases"
    assert native_head(head) is not None


def test_engine_drafts_through_the_native_head_and_keeps_plain_output(monkeypatch):
    """The engine's drafter uses the native head where it runs; greedy speculation still gives
    plain decoding's tokens, with a tree and with context lookup, and so does the Python head."""
    from core.config import GenerationConfig, TreeConfig
    from core.decoding.engine import Engine
    from core.decoding.head3 import draft_weights
    from core.kernels.invariant import make_invariant
    from tests.tiny import random_head as tiny_head, tiny_target

    target = tiny_target(dtype=torch.bfloat16, hidden=128, mix=0.5, seed=3)  # head_dim 32: the kernels' minimum
    make_invariant(target.model)
    trees = (TreeConfig(depth=3, top_k=3, total_tokens=8), TreeConfig(depth=1, top_k=4, total_tokens=3, lookup=8))
    fused = []
    real = NativeHead.catch_up_top
    monkeypatch.setattr(NativeHead, "catch_up_top", lambda self, *a: fused.append(1) or real(self, *a))
    for env in ("1", "0"):
        monkeypatch.setenv(NATIVE_HEAD_ENV, env)
        engine = Engine(target, tiny_head(target, seed=1))
        assert (engine.drafter.native is not None) == (env == "1"), draft_weights(engine.drafter)
        for prompt in ([5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11]):
            plain = [t for ev in engine.generate(prompt, GenerationConfig(max_new_tokens=40, speculative=False))
                     for t in ev.token_ids]
            for tree in trees:
                events = list(engine.generate(prompt, GenerationConfig(max_new_tokens=40, tree=tree)))
                assert [t for ev in events for t in ev.token_ids] == plain, (env, prompt, tree)
                assert any(ev.tree_size > 1 for ev in events)  # it did speculate
        assert bool(fused) == (env == "1"), "greedy catch-ups propose the root's children in one native call"
        fused.clear()


def test_a_draft_from_the_fused_catch_up_is_the_draft_from_the_separate_calls():
    """The engine's greedy steps draft from catch_up_top's proposal (root_top): the same tree, node
    for node and score for score, as catch_up then draft."""
    from core.config import TreeConfig
    from core.decoding.head3 import drafter_for
    from core.decoding.tree import catch_up, catch_up_top, draft
    from tests.tiny import random_head as tiny_head, tiny_target

    target = tiny_target(dtype=torch.bfloat16, hidden=128, mix=0.5, seed=3)
    head = tiny_head(target, seed=1)
    drafter = drafter_for(head, target.model)
    assert drafter.native is not None and drafter.lm_int8 is not None
    gen = torch.Generator().manual_seed(7)
    tokens, features = torch.randint(0, 90, (5,), generator=gen), torch.randn(5, 128, generator=gen).bfloat16()
    with torch.inference_mode():
        a, b = (HeadCache(head.config, torch.bfloat16, "cpu") for _ in range(2))
        hidden = catch_up(drafter, a, tokens, features)
        fused_hidden, top = catch_up_top(drafter, b, tokens, features, 8)
        assert torch.equal(hidden, fused_hidden) and top[1].shape == (1, 8)
        for tree in (TreeConfig(depth=3, top_k=8, total_tokens=10), TreeConfig(depth=1, top_k=4, total_tokens=2),
                     TreeConfig(depth=4, top_k=2, total_tokens=6)):
            x = draft(drafter, a, 3, hidden, tree)
            y = draft(drafter, b, 3, fused_hidden, tree, root_top=top)
            assert (torch.equal(x.tokens, y.tokens) and torch.equal(x.parents, y.parents)
                    and torch.equal(x.scores, y.scores)), tree


def test_the_head_block_setting_is_checked(monkeypatch):
    monkeypatch.delenv(HEAD_BLOCKS_ENV, raising=False)
    assert head_block_kind() == "Q4_1"
    monkeypatch.setenv(HEAD_BLOCKS_ENV, "q8_0")
    assert head_block_kind() == "Q8_0"
    monkeypatch.setenv(HEAD_BLOCKS_ENV, "Q2_K")
    with pytest.raises(StepError, match="EAGLE_CHAT_HEAD_BLOCKS='Q2_K': the native head takes Q4_1 or Q8_0 blocks"):
        head_block_kind()
    assert native_head(random_head()) is None  # the Python head drafts instead


def _native_target_and_drafter():
    from core.decoding.head3 import drafter_for
    from core.kernels.invariant import make_invariant
    from core.kernels.step import NativeStep
    from tests.tiny import random_head as tiny_head, tiny_target

    target = tiny_target(dtype=torch.bfloat16, hidden=128, mix=0.5, seed=3)  # head_dim 32: the kernels' minimum
    make_invariant(target.model)
    head = tiny_head(target, seed=1)
    drafter = drafter_for(head, target.model)
    assert drafter.native is not None and drafter.lm_int8 is not None
    return target, NativeStep(target.model), head, drafter


def test_the_fused_greedy_step_is_the_forward_the_walk_and_the_catch_up_bit_for_bit():
    """NativeStep.spec_step_greedy (csrc/decode_step.c's spec_step_greedy, one call) = forward_rows (greedy),
    verify.accept_greedy's walk, then the head's catch_up_top on the accepted path: the same path and
    tokens, the same head output and proposal, the same target and head cache entries. Random trees
    whose branches follow the target's greedy continuation for a random number of levels (so paths of
    every length are accepted, through branching nodes), head caches that grow during the step."""
    from core.decoding import cache as kv
    from core.decoding.forward import prefill, spec_step_greedy
    from core.decoding.tree import DraftTree, catch_up_top
    from core.decoding.verify import accept_greedy

    target, step, head, drafter = _native_target_and_drafter()
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(1, 90, (21,), generator=gen)
    lengths = set()
    with torch.inference_mode():
        def start(capacity: int):
            cache = kv.new_cache(step)
            features, logits = prefill(step, prompt, cache)
            root = int(logits.argmax())
            hc = HeadCache(head.config, torch.bfloat16, "cpu", capacity=capacity)
            catch_up_top(drafter, hc, torch.cat([prompt[1:], torch.tensor([root])]), features, 4)
            return cache, hc, root

        scratch, _, root = start(1024)
        greedy, t = [], root  # plain greedy decoding's continuation after the root
        for i in range(8):
            _, _, t = step.forward_one(t, len(prompt) + i, scratch, greedy=True)
            greedy.append(t)
        for case in range(30):
            n = int(torch.randint(1, 13, (1,), generator=gen))
            parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
            depths = [0] * n
            for i in range(1, n):
                depths[i] = depths[parents[i]] + 1
            tokens = [root] + [int(x) for x in torch.randint(1, 90, (n - 1,), generator=gen)]
            follow = int(torch.randint(0, 9, (1,), generator=gen))  # levels of one branch set to the continuation
            node = 0
            for level in range(follow):
                kids = [i for i in range(1, n) if parents[i] == node]
                if not kids:
                    break
                node = kids[int(torch.randint(0, len(kids), (1,), generator=gen))]
                tokens[node] = greedy[level]
            for i in range(1, n):  # siblings hold distinct tokens (the trees drafting makes)
                while any(parents[j] == parents[i] and tokens[j] == tokens[i] for j in range(1, i)):
                    tokens[i] = tokens[i] % 89 + 1
            tree = DraftTree.from_lists(tokens, parents, depths)
            k = int(torch.randint(1, 9, (1,), generator=gen))
            (a, ha, _), (b, hb, _) = start(4 if case % 3 == 0 else 1024), start(4 if case % 3 == 0 else 1024)
            committed = len(prompt)
            feats, _, choices = step.forward_rows(tokens, parents, depths, committed, a, greedy=True)
            want = accept_greedy(tree, choices)
            hidden, (lp, idx) = catch_up_top(drafter, ha, torch.tensor(want.tokens), feats[list(want.path)], k)
            got = spec_step_greedy(step, tree, b, committed, drafter, hb, k)
            assert got is not None, "the fused step serves a native target with a native EAGLE-1 head"
            assert got.path == want.path and got.tokens == want.tokens, case
            assert torch.equal(got.head_hidden, hidden) and torch.equal(got.top[0], lp) and torch.equal(got.top[1], idx)
            assert ha.length == hb.length == committed + len(want.path)
            for x, y in ((ha.layer_keys[0], hb.layer_keys[0]), (ha.layer_values[0], hb.layer_values[0])):
                assert torch.equal(x[:, :, :ha.length], y[:, :, :hb.length]), case
            assert kv.cache_length(a) == kv.cache_length(b) == committed + n
            for la, lb in zip(a.layers, b.layers):
                assert torch.equal(la._k[..., :committed + n, :], lb._k[..., :committed + n, :]), case
                assert torch.equal(la._v[..., :committed + n, :], lb._v[..., :committed + n, :]), case
            lengths.add(len(want.path))
    assert max(lengths) >= 4 and 1 in lengths, lengths  # short and long accepted paths were both checked


def test_the_engine_takes_greedy_steps_in_one_native_call_and_keeps_plain_output(monkeypatch):
    """With the native step and the native head, greedy speculative steps of dynamic trees run as one
    call (spec_step_greedy) and the answers are plain decoding's, with a tree and with context lookup;
    static trees and sampled answers take the separate calls."""
    from core.config import GenerationConfig, SamplingConfig, TreeConfig
    from core.decoding.engine import Engine
    from core.kernels.step import NativeStep

    target, step, head, drafter = _native_target_and_drafter()
    engine = Engine(target, head, drafter=drafter, step=step)
    calls = []
    real = NativeStep.spec_step_greedy
    monkeypatch.setattr(NativeStep, "spec_step_greedy", lambda self, *a: calls.append(1) or real(self, *a))
    dynamic = (TreeConfig(depth=3, top_k=3, total_tokens=8), TreeConfig(depth=1, top_k=4, total_tokens=2, lookup=8))
    accepted = 0
    for prompt in ([5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11]):
        plain = [t for ev in engine.generate(prompt, GenerationConfig(max_new_tokens=40, speculative=False))
                 for t in ev.token_ids]
        for tree in dynamic:
            events = list(engine.generate(prompt, GenerationConfig(max_new_tokens=40, tree=tree)))
            assert [t for ev in events for t in ev.token_ids] == plain, (prompt, tree)
            assert calls and any(ev.tree_size > 1 for ev in events)  # it speculated, in fused steps
            accepted += sum(ev.draft_tokens for ev in events)
            calls.clear()
        static = TreeConfig(depth=2, top_k=2, total_tokens=4, static_paths=((0,), (1,), (0, 0)))
        events = list(engine.generate(prompt, GenerationConfig(max_new_tokens=40, tree=static)))
        assert [t for ev in events for t in ev.token_ids] == plain and not calls
        sampled = GenerationConfig(max_new_tokens=20, tree=dynamic[0], sampling=SamplingConfig(temperature=0.7), seed=3)
        list(engine.generate(prompt, sampled))
        assert not calls
    assert accepted > 0, "some fused steps accepted drafts"
    # two speculative answers advanced in turn, step by step, draft the trees each drafts alone: each keeps
    # its own head state and proposals (the tokens alone could not tell: verification keeps them plain's)
    prompts, cfg = ([5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11]), GenerationConfig(max_new_tokens=40, tree=dynamic[0])
    alone: list[list[tuple]] = [[], []]
    for i, p in enumerate(prompts):
        list(engine.generate(p, cfg, on_step=lambda tree, result, i=i: alone[i].append(tuple(tree.host[0]))))
    turns: list[list[tuple]] = [[], []]
    runs = [engine.generate(p, cfg, on_step=lambda tree, result, i=i: turns[i].append(tuple(tree.host[0])))
            for i, p in enumerate(prompts)]
    while any(run is not None for run in runs):
        for i, run in enumerate(runs):
            if run is not None and next(run, None) is None:
                runs[i] = None
    assert turns == alone and all(len(t) > 3 for t in alone) and calls
