"""Streaming text: incremental UTF-8-safe detokenizing, stop strings across steps, and
generators advanced from several threads (as Gradio does)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from core.config import GenerationConfig, TreeConfig
from core.decoding.engine import Engine
from core.decoding.text import Detokenizer, TextStream, backend_decode
from tests.tiny import oracle_head, tiny_target


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte, so a multi-byte character spans several tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


class CountingTokenizer:
    def __init__(self, inner):
        self.inner, self.longest = inner, 0

    def decode(self, ids, **kw):
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, **kw)


def test_detokenizer_is_utf8_safe_and_incremental():
    tok = byte_tokenizer()
    text = "héllo wörld 😀 " * 40
    ids = tok(text)["input_ids"]
    counting = CountingTokenizer(tok)
    detok = Detokenizer(counting)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) + detok.flush() == text
    assert not any("\ufffd" in p for p in pieces)
    assert counting.longest <= 8  # a small window, not the whole answer (quadratic before)


def test_the_stream_decodes_through_the_backend_only_where_transformers_adds_nothing():
    """backend_decode: the `tokenizers` decoder itself where transformers' decode would return exactly
    its text (random id windows, special tokens skipped), and None where it would change it (clean-up of
    spaces) or where a tokenizer is not transformers' own (the counting wrapper above)."""
    tok = byte_tokenizer()
    tok.add_special_tokens({"eos_token": "<eos>"})
    fast = backend_decode(tok)
    assert fast is not None and backend_decode(CountingTokenizer(tok)) is None
    gen = torch.Generator().manual_seed(3)
    for _ in range(300):
        ids = torch.randint(len(tok), (int(torch.randint(0, 7, (1,), generator=gen)),), generator=gen).tolist()
        assert fast(ids) == tok.decode(ids, skip_special_tokens=True), ids
    assert fast(tok("a<eos>b")["input_ids"]) == "ab"
    tok.clean_up_tokenization_spaces = True
    assert backend_decode(tok) is None


def test_an_incomplete_final_character_is_dropped_not_shown_as_a_replacement_char():
    tok = byte_tokenizer()
    ids = tok("ok 😀")["input_ids"][:-2]  # the emoji cut after 2 of its 4 bytes (an answer cut at max tokens)
    stream = TextStream(tok)
    shown = "".join(stream.push(i) for i in ids)
    assert shown == "ok "
    assert stream.finish() == "" and stream.text == "ok "
    whole = TextStream(tok)  # a complete character at the end is still shown
    assert "".join(whole.push(i) for i in tok("ok 😀")["input_ids"]) + whole.finish() == "ok 😀"


def test_stop_string_across_steps_never_leaks():
    tok = byte_tokenizer()
    stream = TextStream(tok, ("###", "\nUser:"))
    shown = []
    for i in tok("Answer: 42\n##")["input_ids"]:
        shown.append(stream.push(i))
    assert "".join(shown) == "Answer: 42\n"  # "##" could still begin "###": held back
    assert not stream.stopped
    shown.append(stream.push(tok("#")["input_ids"][0]))
    assert stream.stopped and "".join(shown) == "Answer: 42\n"
    assert stream.push(tok("x")["input_ids"][0]) == ""
    other = TextStream(tok, ("###", "\nUser:"))
    assert "".join(other.push(i) for i in tok("Hi\nUs")["input_ids"]) == "Hi"  # "\nUs" held
    assert "".join(other.push(i) for i in tok("er: more")["input_ids"]) == "" and other.stopped


def test_held_back_text_is_released_when_it_is_not_a_stop():
    tok = byte_tokenizer()
    stream = TextStream(tok, ("###",))
    shown = "".join(stream.push(i) for i in tok("a ## b")["input_ids"])
    assert shown == "a ## b" and not stream.stopped
    stream2 = TextStream(tok, ("###",))
    shown2 = "".join(stream2.push(i) for i in tok("ends ##")["input_ids"]) + stream2.finish()
    assert shown2 == "ends ##"  # the answer ended another way: nothing is lost


def test_generator_survives_thread_hops():
    """Gradio advances a sync generator from any worker thread; each step enters inference
    mode itself, so nothing leaks into the calling threads and the answer is unchanged."""
    target = tiny_target(mix=0.5, seed=3)
    engine = Engine(target, oracle_head(target))
    cfg = GenerationConfig(max_new_tokens=30, tree=TreeConfig(3, 3, 8))
    solo = [t for ev in engine.generate([5, 6, 7], cfg) for t in ev.token_ids]
    gen = engine.generate([5, 6, 7], cfg)
    hopped, seen_threads = [], set()
    pools = [ThreadPoolExecutor(max_workers=1), ThreadPoolExecutor(max_workers=1)]
    for step in range(10_000):
        pool = pools[step % 2]  # every step on another thread
        if True:
            def advance():
                seen_threads.add(threading.get_ident())
                ev = next(gen, None)
                return ev, torch.is_inference_mode_enabled()
            ev, leaked = pool.submit(advance).result()
            assert not leaked
            if ev is None:
                break
            hopped += ev.token_ids
            # another user's work runs on the pool between our steps
            pool.submit(lambda: [e.token_ids for e in engine.generate([9, 9], GenerationConfig(max_new_tokens=3))]).result()
    for p in pools:
        p.shutdown()
    assert len(seen_threads) == 2 and hopped == solo
    assert not torch.is_inference_mode_enabled()


def test_a_continued_answers_first_word_keeps_its_space():
    words = tiny_target().tokenizer  # its decoder puts spaces between words, none before the first
    w5, w6 = words.convert_tokens_to_ids(["w5", "w6"])
    assert TextStream(words).push(w6) == "w6"
    continued = TextStream(words, context=(w5,))
    assert continued.push(w6) == " w6" and continued.push(w5) == " w5" and continued.text == " w6 w5"
    # a character split over two tokens right after the context is held until it completes
    tok = byte_tokenizer()
    ids = tok.encode("aé!", add_special_tokens=False)
    stream = TextStream(tok, context=tuple(ids[:1]))
    assert [stream.push(t) for t in ids[1:]] == ["", "é", "!"] and stream.finish() == ""
