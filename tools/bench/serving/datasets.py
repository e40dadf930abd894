"""Prompts for a benchmark: random token ids (SGLang's `random` dataset) or a local ShareGPT file.

Random prompts are sent as token ids (`/v1/completions` takes a list of ids), so a prompt has
exactly the length asked for on any server with the same tokenizer; ids are drawn from the
tokenizer's vocabulary without its special tokens. For the chat endpoint, which takes text, the
random ids are decoded, re-encoded and cut (or padded with more random ids) to the length asked,
a few rounds, as vLLM's random dataset does: the text is about `input_len` tokens (the server's
usage counts say exactly, chat template included). ShareGPT prompts are the first human turn of
each conversation, sent as text; the output length is the token count of the first reply (or
`--sharegpt-output-len`), and conversations whose prompt is under 4 or over 1024 tokens, or whose
reply is under 4 tokens, are skipped, as SGLang's bench_serving does. Only the `tokenizers` library
is used: the benchmark never imports torch.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from tools.bench.serving.workload import RequestClass, WorkloadError


@dataclass(frozen=True)
class Prompt:
    """One request to send: token ids or text, its length in tokens, the tokens to generate."""

    request_class: str
    prompt: list[int] | str
    input_len: int
    output_len: int


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint folder (or a tokenizer.json file); a clear error if absent."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise WorkloadError(f"--tokenizer {str(path)!r}: no tokenizer.json there (give a local checkpoint "
                            "folder or tokenizer.json file)")
    return Tokenizer.from_file(str(file))


def _plain_ids(tokenizer: Tokenizer) -> list[int]:
    special = {token_id for token_id, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    return [i for i in range(tokenizer.get_vocab_size()) if i not in special]


def random_prompts(request_class: RequestClass, tokenizer: Tokenizer, rng: random.Random, *,
                   as_text: bool = False) -> list[Prompt]:
    """`request_class.num_requests` prompts of random ids (or text made of them), lengths drawn per
    the class."""
    ids = _plain_ids(tokenizer)
    prompts = []
    for input_len, output_len in request_class.lengths(rng):
        prompt = [rng.choice(ids) for _ in range(input_len)]
        text_or_ids = _as_text(prompt, tokenizer, rng, ids) if as_text else prompt
        prompts.append(Prompt(request_class.name, text_or_ids, input_len, output_len))
    return prompts


def _as_text(prompt: list[int], tokenizer: Tokenizer, rng: random.Random, ids: list[int],
             rounds: int = 10) -> str:
    """Text whose encoding is (about) `len(prompt)` tokens: decoding random ids and encoding the text
    again seldom gives the same count (pieces merge or split), so cut or pad and try again."""
    target = len(prompt)
    for _ in range(rounds):
        text = tokenizer.decode(prompt, skip_special_tokens=True)
        prompt = tokenizer.encode(text, add_special_tokens=False).ids
        if len(prompt) == target:
            return text
        prompt = prompt[:target] + [rng.choice(ids) for _ in range(target - len(prompt))]
    return tokenizer.decode(prompt, skip_special_tokens=True)


def sharegpt_prompts(path: str | Path, num_prompts: int, tokenizer: Tokenizer, rng: random.Random,
                     output_len: int | None = None) -> list[Prompt]:
    """Up to `num_prompts` prompts from a ShareGPT-format JSON file, in a seeded random order."""
    path = Path(path)
    try:
        conversations = json.loads(path.read_text())
    except OSError as exc:
        raise WorkloadError(f"--dataset-path {str(path)!r}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise WorkloadError(f"--dataset-path {str(path)!r} is not JSON: {exc}") from None
    if not isinstance(conversations, list):
        raise WorkloadError(f"--dataset-path {str(path)!r}: expected a JSON list of conversations")
    pairs = []
    for entry in conversations:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) for t in turns[:2]):
            prompt, reply = turns[0].get("value"), turns[1].get("value")
            if isinstance(prompt, str) and isinstance(reply, str):
                pairs.append((prompt, reply))
    if not pairs:
        raise WorkloadError(f"--dataset-path {str(path)!r}: no conversation with a prompt and a reply "
                            "(ShareGPT format: "
                            "[{\"conversations\": [{\"from\": \"human\", \"value\": ...}, ...]}])")
    rng.shuffle(pairs)
    prompts = []
    for text, reply in pairs:
        input_len = len(tokenizer.encode(text, add_special_tokens=False).ids)
        wanted = (output_len if output_len is not None
                  else len(tokenizer.encode(reply, add_special_tokens=False).ids))
        if input_len < 4 or input_len > 1024 or wanted < 4:
            continue
        prompts.append(Prompt("sharegpt", text, input_len, wanted))
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise WorkloadError(f"--dataset-path {str(path)!r}: every conversation was skipped (prompts must be "
                            "4-1024 tokens, replies at least 4)")
    return prompts
