"""The model: what differs between architectures, its hyper-parameters, its forward pass,
and the weight file it is converted to.

    arch.py           the architectures llambda runs, as data (tensor names, norms, activations)
    config.py         ModelConfig from GGUF metadata
    forward.py        the transformer forward on llambda's kernels (TransformerModel)
    convert.py        GGUF -> llambda model file (repacked once, cached) and loading it back
    integrity.py      checksums verified once per machine; NaN logits name the file
    limits.py         threads and context memory checked before anything big is allocated
    catalog.py        the models llambda fetches by name (PyPI wheels) and their download
    default_model.py  the default model, SmolLM2-135M-Instruct Q4_1
"""
