"""Incremental detokenization and stop strings (engine/request.py), with a byte-level
tokenizer: random token streams hold multi-byte characters split across tokens and invalid
UTF-8, the hard cases for streaming text."""

from __future__ import annotations

import random

import pytest

from kvcompile.engine.params import SamplingParams
from kvcompile.engine.request import Detokenizer
from tests.engine.tiny import byte_tokenizer


def _stream(ids, params):
    d = Detokenizer(byte_tokenizer(), [], params)
    pieces, stop = [], None
    for i, t in enumerate(ids):
        stop = d.add(t)
        final = stop is not None or i == len(ids) - 1
        if final and stop is None:
            d.flush()   # what Request.finish does
        pieces.append(d.take_new(final))
        if stop is not None:
            break
    return d, pieces, stop


@pytest.mark.parametrize("seed", range(6))
def test_streamed_text_is_the_decoded_text(seed):
    rng = random.Random(seed)
    tok = byte_tokenizer()
    text = "".join(rng.choice(["a", "é", "日本", "🙂", " ", "\n", "x"]) for _ in range(60))
    ids = tok(text).input_ids
    if seed % 2:  # raw bytes too: invalid UTF-8 in the middle
        ids = [rng.randrange(256) if rng.random() < 0.2 else t for t in ids]
    d, pieces, stop = _stream(ids, SamplingParams())
    assert stop is None
    assert d.text == tok.decode(ids)
    if seed % 2 == 0:  # valid UTF-8: the streamed pieces are exactly the text
        assert "".join(pieces) == d.text


def test_incomplete_characters_are_held_back():
    tok = byte_tokenizer()
    ids = tok("a🙂b").input_ids   # the emoji is 4 bytes
    d = Detokenizer(tok, [], SamplingParams())
    out = []
    for t in ids:
        d.add(t)
        out.append(d.take_new(False))
    assert out == ["a", "", "", "", "🙂", "b"]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text(include):
    tok = byte_tokenizer()
    ids = tok("one two\n\nthree four").input_ids
    p = SamplingParams(stop=["\n\n", "zzz"], include_stop_str_in_output=include)
    d, pieces, stop = _stream(ids, p)
    assert stop == "\n\n"
    assert d.text == ("one two\n\n" if include else "one two")
    assert "".join(pieces) == d.text
    assert len(d.ids) == len(tok("one two\n\n").input_ids)  # stopped at the completing token


def test_text_that_may_start_a_stop_string_is_held_back():
    tok = byte_tokenizer()
    d = Detokenizer(tok, [], SamplingParams(stop=["STOP"]))
    sent = ""
    for t in tok("abcST").input_ids:
        assert d.add(t) is None
        sent += d.take_new(False)
    assert sent == "ab"            # "cST" could still become a stop string... 'c' is held too
    for t in tok("OP").input_ids:
        stop = d.add(t)
    assert stop == "STOP" and d.text == "abc"
    assert sent + d.take_new(True) == "abc"
