"""Measuring llambda: beside llama.cpp, over HTTP, and inside one token.

    engines.py           ``llambda bench``: llambda and llama.cpp on the same GGUF, in one run
    serve.py             ``llambda bench --serve``: llambda serve beside llama-server
    llamacpp_compare.py  the logits and tokens checks against llama.cpp on a real GGUF
    busy_core.py         another process keeping one CPU busy (a shared machine)
    profile.py           where a token's time goes, op by op of the real plan
"""
