"""`pdserve bench grammar`: xgrammar against llguidance, the two grammar engines vLLM and SGLang use.

For each vocabulary size (a byte-level BPE vocabulary grown from the tiny preset's tokens: the
engines' cost depends on the vocabulary's size and shape, not on merges) and each library it
measures the compile time of a JSON schema (a nested one and one of 50 properties) and the mean time
to compute one request's next-token mask along a valid output (random choices among the allowed
tokens, the same seed for both libraries). Figures are printed as ratios to xgrammar's in the same run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

NESTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
            "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


def wide_schema(properties: int) -> dict[str, Any]:
    """An object of `properties` required fields of varied types (the issue's 50-property case)."""
    kinds: list[dict[str, Any]] = [{"type": "string", "maxLength": 16}, {"type": "integer", "minimum": 0},
                                   {"type": "boolean"}, {"type": "number"},
                                   {"type": "string", "enum": ["x", "y", "z"]}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(properties)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def synthetic_tokenizer(base: Path, vocab_size: int, seed: int = 0) -> Any:
    """A fast HF tokenizer whose byte-level vocabulary holds the base tokenizer's tokens, then
    concatenations of two or three of them, up to `vocab_size` tokens (EOS last)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base_vocab = json.loads((base / "tokenizer.json").read_text())["model"]["vocab"]
    pieces = [t for t in base_vocab if not t.startswith("<")]
    vocab: dict[str, int] = {}
    for token in pieces:
        vocab.setdefault(token, len(vocab))
    rng = random.Random(seed)
    while len(vocab) < vocab_size - 1:
        vocab.setdefault("".join(rng.choice(pieces) for _ in range(rng.choice((2, 2, 3)))), len(vocab))
    vocab["<|eos|>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|eos|>")


class _XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(schema, any_whitespace=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: Any) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())


class _LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, schema: str) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)  # compiles; masks are computed lazily
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def fill(self, matcher: Any, bitmask: Any) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.shape[1] * 4)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped() or matcher.is_accepting())


def _allowed(bitmask: Any, vocab_size: int) -> list[int]:
    import torch
    bits = (bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()


def measure(engine: Any, schema: dict[str, Any], steps: int, seed: int) -> dict[str, float]:
    """Compile time (ms, first compile, no cache) and mean/median mask time (us) over one output."""
    import torch
    text = json.dumps(schema)
    began = time.perf_counter()
    compiled = engine.compile(text)
    compile_ms = (time.perf_counter() - began) * 1e3
    matcher = engine.matcher(compiled)
    bitmask = torch.zeros((1, (engine.vocab_size + 31) // 32), dtype=torch.int32)
    rng = random.Random(seed)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        engine.fill(matcher, bitmask)
        times.append((time.perf_counter() - began) * 1e6)
        allowed = _allowed(bitmask, engine.vocab_size)
        if not allowed or engine.done(matcher):
            break
        engine.accept(matcher, rng.choice(allowed))
    return {"compile_ms": compile_ms, "mask_us_mean": statistics.fmean(times),
            "mask_us_median": statistics.median(times), "steps": len(times)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=".cache/models/tiny",
                        help="checkpoint whose tokens seed the vocabulary")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--steps", type=int, default=200, help="mask steps per output")
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    schemas = {"nested": NESTED_SCHEMA, "50-property": wide_schema(50)}
    for vocab_size in args.vocab:
        tokenizer = synthetic_tokenizer(Path(args.model), vocab_size)
        rows = {}
        for cls in (_XGrammar, _LLGuidance):
            began = time.perf_counter()
            engine = cls(tokenizer, vocab_size)
            setup_ms = (time.perf_counter() - began) * 1e3
            print(f"vocab {vocab_size} {engine.name}: tokenizer setup {setup_ms:.0f} ms")
            for name, schema in schemas.items():
                rows[engine.name, name] = measure(engine, schema, args.steps, args.seed)
        for name in schemas:
            base = rows["xgrammar", name]
            for lib in ("xgrammar", "llguidance"):
                r = rows[lib, name]
                print(f"vocab {vocab_size} {name:12s} {lib:10s} compile {r['compile_ms']:8.1f} ms "
                      f"({r['compile_ms'] / base['compile_ms']:.2f}x)  mask mean {r['mask_us_mean']:8.1f} us "
                      f"({r['mask_us_mean'] / base['mask_us_mean']:.2f}x) "
                      f"median {r['mask_us_median']:8.1f} us over {r['steps']:.0f} steps")
    return 0
