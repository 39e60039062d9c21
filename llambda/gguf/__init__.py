"""GGUF files: reading the ones users have, writing the ones tests and tools make.

    reader.py   a lazy reader: key/value table, tensor table, tensor data views
    writer.py   what every GGUF llambda writes shares (keys, the byte-level vocabulary, the writer)
"""
