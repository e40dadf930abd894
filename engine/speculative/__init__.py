"""Speculative decoding: drafts proposed per request, verified by the target in one forward.

A speculating request's decode row becomes a verify chunk (engine.scheduler.ScheduledChunk with
`num_drafts`): its last token and its drafts run through the extend path, the runner returns
logits for each of those positions, and the engine thread keeps the longest drafted prefix the
target agrees with plus the target's own next token (engine.speculative.speculator).
"""
