"""The built-in checkpoint and `pdserve generate`.

tiny_model.py        `pdserve make-tiny-model`: random weights from a fixed seed, an HF config
tokenizer_train.py   the byte-level BPE tokenizer trained locally for it (tokenizer_corpus.py: its text)
tiny_model_check.py  greedy output of a written checkpoint under HF transformers
generate.py          `pdserve generate`: stream a generation from a local checkpoint in-process
"""
