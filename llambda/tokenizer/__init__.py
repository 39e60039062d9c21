"""Text <-> token ids for the vocabularies GGUF files carry.

    vocab.py      the Tokenizer: byte-level BPE (HF `tokenizers`), SentencePiece BPE, and their
                  special tokens, as llama.cpp tokenizes them
    spm.py        SentencePiece BPE vocabularies merged by the `sentencepiece` library
    bpe_cache.py  BPE models built before, kept as the files HF `tokenizers` saves
    arrays.py     the tokenizer's long lists as arrays of the llambda model file
"""
