"""The model a worker serves, as GetModelInfo reports it: the served name and the checkpoint files
a gateway needs to tokenize and template (never weights).

Workers build it (`read_model_info`); a gateway started without --model-path writes the files into
a folder of its own (`write_model_files`) and compares every worker's digest with the one it serves.
Both sides use this module so that the digest is computed one way.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from protos.v1 import worker_pb2
from services.common.text_parsers import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES, TextParsers

# What services.gateway.prompts.ModelFiles reads, plus the files HF tokenizers may split their settings into.
GATEWAY_FILES = ("chat_template.jinja", "config.json", "generation_config.json", "special_tokens_map.json",
                 "tokenizer.json", "tokenizer_config.json")

# A real tokenizer.json is 2-12 MB (Qwen3 11 MB, Llama 3.1 9 MB); the total is bounded so that one
# message carries it, and the gateway's channel accepts a message this large plus headroom.
MAX_MODEL_FILES_BYTES = 64 << 20
MAX_MODEL_INFO_MESSAGE_BYTES = MAX_MODEL_FILES_BYTES + (1 << 20)


class ModelInfoError(ValueError):
    """The folder's gateway files are too large, or a ModelInfo names a file it may not."""


def files_digest(files: dict[str, bytes]) -> str:
    """sha256 over each (name, content) in name order; lengths framed so no two lists collide."""
    digest = hashlib.sha256()
    for name in sorted(files):
        encoded = name.encode()
        digest.update(len(encoded).to_bytes(8, "little") + encoded)
        digest.update(len(files[name]).to_bytes(8, "little") + files[name])
    return digest.hexdigest()


def context_length(model_config: dict, tokenizer_config: dict) -> int | None:
    """The model's context length from config.json (or tokenizer_config.json), None if it names none."""
    for source, key in ((model_config, "max_position_embeddings"), (model_config, "max_sequence_length"),
                        (model_config, "seq_length"), (tokenizer_config, "model_max_length")):
        value = source.get(key)
        # tokenizer_config's "no limit" is a huge sentinel (int(1e30)), not a real length
        if isinstance(value, int) and 0 < value < 10**9:
            return value
    return None


def _json(content: bytes | None) -> dict:
    if content is None:
        return {}
    try:
        value = json.loads(content)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def read_model_info(folder: str | Path, served_model_name: str,
                    text_parsers: TextParsers = TextParsers()) -> worker_pb2.ModelInfo:
    """The ModelInfo of a checkpoint folder, with the worker's `text_parsers`. Raises ModelInfoError
    when its files exceed the bound."""
    files: dict[str, bytes] = {}
    total = 0
    for name in GATEWAY_FILES:
        path = Path(folder, name)
        if not path.is_file():
            continue
        total += path.stat().st_size
        if total > MAX_MODEL_FILES_BYTES:
            raise ModelInfoError(f"the tokenizer files of {folder} exceed {MAX_MODEL_FILES_BYTES >> 20} MiB "
                                 f"(at {name}); start the gateway with --model-path instead")
        files[name] = path.read_bytes()
    length = context_length(_json(files.get("config.json")), _json(files.get("tokenizer_config.json")))
    return worker_pb2.ModelInfo(
        served_model_name=served_model_name, context_length=length or 0,
        files=[worker_pb2.ModelFile(name=name, content=files[name]) for name in sorted(files)],
        files_sha256=files_digest(files), tool_call_parser=text_parsers.tool_call_parser or "",
        reasoning_parser=text_parsers.reasoning_parser or "")


def reported_text_parsers(info: worker_pb2.ModelInfo) -> TextParsers:
    """The parser names a ModelInfo reports (names this gateway does not know are dropped)."""
    tool_call = info.tool_call_parser if info.tool_call_parser in TOOL_CALL_PARSER_NAMES else None
    reasoning = info.reasoning_parser if info.reasoning_parser in REASONING_PARSER_NAMES else None
    return TextParsers(tool_call, reasoning)


def write_model_files(info: worker_pb2.ModelInfo, folder: Path) -> None:
    """Write a ModelInfo's files into `folder` (exists, empty). Refuses names outside GATEWAY_FILES
    (a worker names files, it does not choose where they go) and a digest that does not match."""
    files = {file.name: file.content for file in info.files}
    unknown = sorted(set(files) - set(GATEWAY_FILES))
    if unknown or len(files) != len(info.files):
        raise ModelInfoError("model info names unexpected or repeated files: "
                             f"{unknown or [f.name for f in info.files]}")
    if "tokenizer.json" not in files:
        raise ModelInfoError("model info has no tokenizer.json")
    if files_digest(files) != info.files_sha256:
        raise ModelInfoError("model info files do not match their digest")
    for name, content in files.items():
        (folder / name).write_bytes(content)
