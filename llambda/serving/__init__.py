"""Many sequences on one model: the engine, its paged KV cache, sampling and generation.

    engine.py      one thread runs every step of every sequence, for callers on any thread
    kv_pool.py     the paged KV cache: one arena of blocks, block tables, prefix sharing
    sampling.py    the next token from the logits (llama.cpp's filter order)
    generation.py  the decode loop: stop rules, streamed text
    embedding.py   embeddings: a text's final-norm rows as an engine sequence, pooled (mean/cls/last)
    constraints.py constrained decoding: llguidance grammars, the step's token masks
"""
