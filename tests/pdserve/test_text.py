"""pdserve.text: incremental detokenizer, stop strings and TextStream, with the built-in byte-level
tokenizer; and engine.stream's `text_stream`, which adds a request's eos ids."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from engine.stream import text_stream
from pdserve.sampling_params import SamplingParams
from pdserve.text import REPLACEMENT_CHAR, IncrementalDetokenizer, StopChecker, TextStream
from tools.models.tokenizer_train import write_tokenizer

MULTIBYTE_TEXTS = [
    "Emoji 😀🚀👍🏽🇯🇵 and hearts ❤️ end",
    "今日は天気がいいですね。我们明天去图书馆看书。龘靐齉 𠀀𪚥",  # the last ones are not in the corpus
    "mixed: naïve café — Привет, 오늘 날씨 🎉 x² ∞ ≤ 𝔘𝔫𝔦",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder, vocab_size=4096, corpus_bytes=1_000_000)
    return AutoTokenizer.from_pretrained(folder)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(t) for t in ids] + [detok.flush()]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_multibyte_characters_never_emit_replacement_char(tokenizer, text):
    ids = tokenizer.encode(text)
    # The point of the test: some tokens hold only part of a character's UTF-8 bytes.
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids)
    deltas = _stream(IncrementalDetokenizer(tokenizer), ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text


def test_prompt_context_does_not_leak_into_output(tokenizer):
    prompt = tokenizer.encode("User said: 😀 and then")
    ids = tokenizer.encode(" 今日は🚀!")
    deltas = _stream(IncrementalDetokenizer(tokenizer, prompt), ids)
    assert "".join(deltas) == " 今日は🚀!"


def test_random_token_sequences_match_full_decode(tokenizer):
    # Random ids include special tokens, lone continuation bytes and cut characters: whatever the
    # model emits, the stream must add up to the full decode.
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(0, 8))]
        deltas = _stream(IncrementalDetokenizer(tokenizer, prompt), ids)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert "".join(_stream(IncrementalDetokenizer(tokenizer), ids)) == "assistant\nHi"


class RecordingTokenizer:
    """The real tokenizer, recording how many ids each decode call gets."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=False):
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decodes_a_small_window_not_the_whole_output(tokenizer):
    text = " ".join(["The server sent a packet to the worker and the queue grew."] * 40)
    ids = tokenizer.encode(text)
    assert len(ids) > 400
    recording = RecordingTokenizer(tokenizer)
    deltas = _stream(IncrementalDetokenizer(recording, tokenizer.encode("prompt words here")), ids)
    assert "".join(deltas) == text
    assert max(recording.window_sizes) <= 8


def test_works_with_a_raw_tokenizers_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = raw.encode(MULTIBYTE_TEXTS[0]).ids
    assert "".join(_stream(IncrementalDetokenizer(raw), ids)) == MULTIBYTE_TEXTS[0]


# StopChecker -----------------------------------------------------------------------------------

def test_stop_string_split_across_pieces_is_never_emitted():
    checker = StopChecker(["STOP"])
    assert checker.push("Hello S") == ("Hello ", False)
    assert checker.push("T") == ("", False)
    assert checker.push("OP and more") == ("", True)
    assert checker.matched == "STOP"
    assert checker.push("later") == ("", True)


def test_false_alarm_is_released():
    checker = StopChecker(["STOP"])
    assert checker.push("ST") == ("", False)
    assert checker.push("ARS") == ("STAR", False)  # a lone "S" may still start "STOP"
    assert checker.push("x ST") == ("Sx ", False)
    assert checker.flush() == "ST"


def test_earliest_of_several_stop_strings_wins():
    checker = StopChecker(["world", "lo w", "\n\n"])
    assert checker.push("hel") == ("he", False)  # "l" may start "lo w"
    assert checker.push("lo world\n\n") == ("l", True)
    assert checker.matched == "lo w"


def test_overlapping_prefix_is_found():
    checker = StopChecker(["abc"])
    assert checker.push("xab") == ("x", False)
    assert checker.push("abc") == ("ab", True)


def test_no_stop_strings_passes_text_through():
    checker = StopChecker([])
    assert checker.push("anything") == ("anything", False)
    assert checker.flush() == ""


# TextStream ------------------------------------------------------------------------------------

def _run(stream: TextStream, ids: list[int]) -> tuple[list[str], int | None]:
    """Deltas until the stream stops (index of the stopping token) or the ids run out (flush)."""
    deltas = []
    for i, token_id in enumerate(ids):
        delta, stopped = stream.push(token_id)
        deltas.append(delta)
        if stopped:
            return deltas, i
    deltas.append(stream.flush())
    return deltas, None


def test_text_stream_stop_string_across_token_boundaries(tokenizer):
    text = "The answer is 42.\n\nEND of the story"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert "\n\nEND" not in pieces and not any("\n\nEND" in p for p in pieces)  # really split
    stream = TextStream(tokenizer, stop=["\n\nEND"])
    deltas, stopped_at = _run(stream, ids)
    assert "".join(deltas) == "The answer is 42."
    assert stream.stopped and stream.matched_stop == "\n\nEND"
    # It stops at the token that completes the stop string, and "\n" was never emitted before it.
    assert tokenizer.decode(ids[:stopped_at + 1]).endswith(("END", "END "))
    assert not any("\n" in d for d in deltas)
    with pytest.raises(RuntimeError):
        stream.push(ids[-1])


def test_text_stream_stop_string_inside_multibyte_text(tokenizer):
    text = "今日は天気🚀がいい"
    stream = TextStream(tokenizer, stop=["🚀"])
    deltas, stopped_at = _run(stream, tokenizer.encode(text))
    assert "".join(deltas) == "今日は天気" and stopped_at is not None
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_text_stream_without_match_emits_everything(tokenizer):
    text = "almost END but \n\nEN not quite 😀"
    stream = TextStream(tokenizer, stop=["\n\nEND"])
    deltas, stopped_at = _run(stream, tokenizer.encode(text))
    assert stopped_at is None and "".join(deltas) == text
    assert not stream.stopped and stream.matched_stop is None and stream.finished


def test_text_stream_eos_and_stop_token_ids(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Done here") + [im_end] + tokenizer.encode(" more")
    stream = text_stream(tokenizer, SamplingParams(), eos_token_ids=[im_end, 0])
    deltas, stopped_at = _run(stream, ids)
    assert "".join(deltas) == "Done here" and stopped_at == ids.index(im_end)
    assert stream.matched_stop == im_end

    stream = text_stream(tokenizer, SamplingParams(ignore_eos=True), eos_token_ids=[im_end])
    deltas, stopped_at = _run(stream, ids)
    assert stopped_at is None and "".join(deltas) == "Done here more"

    here = tokenizer.encode("Done here")
    stream = TextStream(tokenizer, stop_token_ids=[here[-1]])
    deltas, stopped_at = _run(stream, here + tokenizer.encode(" more"))
    assert stopped_at == len(here) - 1 and "".join(deltas) == tokenizer.decode(here[:-1])
