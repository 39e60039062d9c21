"""GGUF -> llambda model file, and loading that file back as weights.

A GGUF is read once (its tables by llambda/gguf/reader.py, which decodes the
vocabulary only after the tensor types have passed), its matrices repacked into
the layouts the kernels read (runtime/layouts.py), and everything written to
one memory-mappable weight file (runtime/weightfile.py) whose metadata holds:

    format, schema    "llambda-model", SCHEMA_VERSION
    config            ModelConfig.to_dict()
    tokenizer         every ``tokenizer.*`` GGUF key (full key names), verbatim but for its
                      long lists, stored as arrays "tokenizer/<key>" (llambda/tokenizer/arrays.py)
    gguf              the other GGUF keys (general.*, llama.*), for ``info``
    source            file name, size and absolute path of the GGUF it came from
    packer            fingerprint of the layout code that packed the matrices
    vectors           names of 1-D tensors, stored as f32 arrays under their own name
    layouts           per 2-D tensor: {kind, n, k, meta, arrays}; its arrays are
                      stored as "<tensor>/<array>"

Loading maps the file and rebuilds each PackedWeight around the mapped
arrays: no copy, no conversion.
"""
import dataclasses
import hashlib
import inspect
import math
import re
import sys
from pathlib import Path

import numpy as np

from llambda.runtime import layouts, paths, weightfile
from llambda.runtime.layouts import PackedWeight

from llambda.model import integrity
from llambda.tokenizer import arrays as tokenizer_arrays
from llambda.model.arch import LM_HEAD, MODEL_TENSORS, ROPE_FACTOR_TENSORS
from llambda.model.config import ModelConfig
from llambda.errors import UserError
from llambda.gguf import blocks
from llambda.gguf.reader import GGUFFile
from llambda.inputs import is_count

MODEL_FORMAT = "llambda-model"
SCHEMA_VERSION = 3     # 2: per-architecture config (windows, RoPE per layer, scales); 3: the
                       # tokenizer's long lists as arrays (tokenizer_arrays)
SUFFIX = ".llb"

# ---------------------------------------------------------------- GGUF -> llambda

def convert(gguf_path, out_path=None, progress=True):
    """Repack the GGUF at ``gguf_path`` into a llambda file (default: beside it, ``.llb``)."""
    gguf_path = Path(gguf_path)
    out_path = Path(out_path) if out_path is not None else gguf_path.with_suffix(SUFFIX)
    if out_path.resolve() == gguf_path.resolve():
        raise UserError(f"{out_path}: the output would overwrite the GGUF it is converted from")
    gguf_file = _read_gguf(gguf_path)
    try:
        # The tensor table first: a file llambda cannot load is refused before its
        # vocabulary (hundreds of thousands of strings) is decoded.
        gguf_file.check_tensors()
        gguf_tensors = {t.name: t for t in gguf_file.tensors}
        _check_tensor_types(gguf_tensors)
        gguf_metadata = gguf_file.metadata()
        _check_layer_count(gguf_metadata, gguf_tensors)
        embedding = gguf_tensors.get("token_embd.weight")
        config = ModelConfig.from_gguf_metadata(
            gguf_metadata, tied_embeddings=LM_HEAD not in gguf_tensors,
            embedding_rows=_shape_nk(embedding)[0] if embedding is not None else None)
        _check_vocabulary(config, gguf_metadata)
        tensors = _split_fused(config, gguf_tensors)
        _check_tensors(config, tensors)

        arrays, vectors, packed = _repack(tensors, progress)
    except UserError as e:          # one line that names the file at fault
        raise _naming(gguf_path, e) from None
    tokenizer_md, tokenizer_lists = tokenizer_arrays.split(
        {k: v for k, v in gguf_metadata.items() if k.startswith("tokenizer.")})
    arrays.update(tokenizer_lists)
    metadata = {
        "format": MODEL_FORMAT,
        "schema": SCHEMA_VERSION,
        "config": config.to_dict(),
        "tokenizer": tokenizer_md,
        "gguf": {k: v for k, v in gguf_metadata.items() if not k.startswith("tokenizer.")},
        "source": {"file": gguf_path.name, "bytes": gguf_path.stat().st_size,
                   "path": str(gguf_path.resolve())},
        "packer": packer_fingerprint(),
        "vectors": vectors,
        "layouts": packed,
    }
    try:
        written = weightfile.write(out_path, metadata, arrays, progress=progress,
                                   check=lambda path: _check_loadable(path, gguf_path))
    except OSError as e:
        raise UserError(f"{out_path}: cannot write ({e.strerror or e}){_cache_hint(out_path)}") from None
    integrity.record_verified(written)     # its checksums were computed from these very arrays
    return written


def _naming(path, error):
    """``error`` with the file's name in front, unless it names it already."""
    return error if str(path) in str(error) else UserError(f"{path}: {error}")


def _check_loadable(written, gguf_path):
    """Load the file just written (before it gets its name) as a model is loaded: a GGUF
    whose conversion would not load is refused now, and nothing is cached."""
    try:
        _, tokenizer_md, _ = load_model_file(written, verify=False)
        build_tokenizer(written, tokenizer_md)
    except UserError as e:
        problem = str(e).removeprefix(f"{written}: ")
        raise UserError(f"{gguf_path}: its conversion would not load ({problem}); nothing was written") from None


# What each ModelConfig annotation accepts from a file's JSON header (bool is no number there).
_JSON_TYPES = {int: (int,), float: (int, float), str: (str,), bool: (bool,), tuple: (list, tuple)}


def _check_config_types(values):
    if not isinstance(values, dict):
        raise UserError("model config is not a mapping")
    for field in dataclasses.fields(ModelConfig):
        if field.name not in values:
            continue            # from_dict names what is missing
        value, accepted = values[field.name], _JSON_TYPES.get(field.type, (object,))
        numeric = field.type in (int, float)
        if not isinstance(value, accepted) or (numeric and isinstance(value, bool)):
            raise UserError(f"model config: {field.name} = {value!r:.40} is not a {field.type.__name__}")
        if field.type is float and not math.isfinite(value):
            raise UserError(f"model config: {field.name} = {value!r} is not finite")
        if field.type is tuple and not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                           and math.isfinite(v) for v in value):
            raise UserError(f"model config: {field.name} holds something that is not a finite number")


def build_tokenizer(path, tokenizer_md):
    """The Tokenizer of a model file's metadata; UserError naming the file if it cannot be built."""
    from llambda.tokenizer.vocab import Tokenizer
    try:
        return Tokenizer.from_gguf_metadata(tokenizer_md)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
        raise UserError(f"{path}: the tokenizer cannot be built ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:200]})") from None


def _cache_hint(path):
    """For a file in the cache: which directory, and the variable that moves it."""
    try:
        Path(path).resolve().relative_to(paths.cache_dir().resolve())
    except (ValueError, OSError):
        return ""
    return f" (the cache directory is {paths.cache_dir()}; LLAMBDA_CACHE_DIR moves it)"


def _read_gguf(path):
    kind = _sniff(path)
    if kind == "llambda":
        raise UserError(f"{path}: already a llambda file, nothing to convert")
    if kind != "gguf":
        raise UserError(f"{path}: not a GGUF file")
    return GGUFFile(path)


def _check_tensor_types(tensors):
    """Every matrix in a type llambda can repack (vectors become f32 whatever their type)."""
    supported = layouts.supported_types()
    for name, tensor in tensors.items():
        type_name = tensor.tensor_type.name
        if len(tensor.shape) >= 2 and type_name not in supported:
            raise UserError(f"tensor {name} has type {type_name}, which llambda cannot load "
                            f"(supported: {', '.join(supported)})")


def _check_layer_count(metadata, tensors):
    """A layer count the tensor table cannot hold is refused before per-layer tables of that
    length are built (a damaged block_count of 2**32 - 1 would fill the memory)."""
    arch = metadata.get("general.architecture")
    n_layer = metadata.get(f"{arch}.block_count") if isinstance(arch, str) else None
    if isinstance(n_layer, int) and n_layer > len(tensors):
        raise UserError(f"GGUF metadata {arch}.block_count = {n_layer}, but the file holds only "
                        f"{len(tensors)} tensors (each layer needs several)")


class _Rows:
    """Rows [start, stop) of a GGUF tensor: one part of a fused one (each row of every GGUF
    type is encoded on its own, so a slice of rows is exactly that part's tensor)."""

    def __init__(self, tensor, start, stop):
        self.name, self.tensor_type = tensor.name, tensor.tensor_type
        self.data = tensor.data[start:stop]
        n, *rest = _shape_nk(tensor)
        self.shape = tuple(reversed([stop - start, *rest]))     # GGUF order, fastest first


def _split_fused(config, gguf_tensors):
    """{name: tensor} with the architecture's fused tensors (Phi-3's attn_qkv, and ffn_up
    holding gate and up) replaced by their parts, row ranges of the original."""
    a = config.architecture
    tensors = {}
    for name, tensor in gguf_tensors.items():
        match = re.fullmatch(r"(blk\.\d+)\.(\w+)\.(weight|bias)", name)
        if match and match[2] in a.fused:
            sizes = a.split_sizes(match[2], config)
            if _shape_nk(tensor)[0] == sum(sizes):
                start = 0
                for part, rows in zip(a.fused[match[2]], sizes):
                    tensors[f"{match[1]}.{part}.{match[3]}"] = _Rows(tensor, start, start + rows)
                    start += rows
                continue
        tensors[name] = tensor
    return tensors


def _check_vocabulary(config, metadata):
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) > config.vocab_size:
        raise UserError(f"the tokenizer has {len(tokens)} tokens but token_embd.weight only "
                        f"{config.vocab_size} rows")


def _check_tensors(config, tensors):
    """Every tensor the architecture needs, each of the shape the config implies; optional
    ones (biases, RoPE factors) of the right shape when present; nothing else."""
    _check_shapes(config, {name: _shape_nk(tensor) for name, tensor in tensors.items()}, "the GGUF")


def _check_shapes(config, shapes, source):
    """``shapes`` (name -> (n, k) or (n,)) against the config: the GGUF's at conversion, a
    llambda file's at load (whose header may be forged or damaged)."""
    if config.n_layer > len(shapes):        # before building name tables of that length
        raise UserError(f"{source} lacks tensors for {config.n_layer} layers: it has {len(shapes)} tensors in all")
    a = config.architecture
    expected = {name: shape(config) for name, shape in MODEL_TENSORS.items()}
    optional = {}
    for i in range(config.n_layer):
        expected.update({f"blk.{i}.{part}.weight": shape for part, shape in a.layer_tensors(config).items()})
        optional.update({f"blk.{i}.{part}.bias": shape for part, shape in a.bias_tensors(config).items()})
    if not config.tied_embeddings:
        expected[LM_HEAD] = (config.vocab_size, config.dim)
    if a.rope_factors:
        optional.update({name: (config.rope_dim // 2,) for name in ROPE_FACTOR_TENSORS})
    # An optional part (a bias, a norm) some layers have and others lack is a missing tensor
    for name in sorted(optional, key=_natural_key):
        part = re.sub(r"^blk\.\d+\.", "", name)
        if name not in shapes and name != part and any(
                f"blk.{i}.{part}" in shapes for i in range(config.n_layer)):
            expected[name] = optional.pop(name)
    missing = [name for name in expected if name not in shapes]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise UserError(f"{source} lacks tensors the {config.arch} architecture needs: {shown}")
    unknown = sorted((name for name in shapes if name not in expected and name not in optional),
                     key=_natural_key)
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        raise UserError(f"{source} has tensors the {config.arch} architecture does not use: {shown}")
    for name, got in shapes.items():
        want = expected.get(name, optional.get(name))
        if got != want:
            raise UserError(f"tensor {name} has shape {_fmt_shape(got)}, the config implies {_fmt_shape(want)}")


def _shape_nk(tensor):
    """GGUF lists dimensions fastest-first (ne = [k, n]); we say (n, k) like numpy."""
    return tuple(int(d) for d in reversed(tensor.shape))


def _fmt_shape(shape):
    return " x ".join(str(d) for d in shape)


def _repack(tensors, progress):
    """Every tensor as named arrays for the weight file, plus the metadata that describes them."""
    from tqdm import tqdm
    arrays, vectors, packed = {}, [], {}
    kinds = _chosen_kinds(tensors)
    for name, tensor in tqdm(tensors.items(), desc="repacking", unit="tensor", disable=not progress, leave=False):
        shape = _shape_nk(tensor)
        if len(shape) == 1:
            arrays[name] = _vector_f32(name, tensor)
            vectors.append(name)
        elif len(shape) == 2:
            weight = _pack_matrix(name, tensor, *shape, kind=kinds.get(tensor.tensor_type.name))
            for array_name, array in weight.arrays.items():
                arrays[f"{name}/{array_name}"] = array
            packed[name] = {"kind": weight.kind, "n": weight.n, "k": weight.k,
                            "meta": weight.meta, "arrays": list(weight.arrays)}
        else:
            raise UserError(f"tensor {name} has {len(shape)} dimensions; llambda handles vectors and matrices")
    return arrays, vectors, packed


def _vector_f32(name, tensor):
    """Norm weights and the like: small, so plain f32 whatever the GGUF stored."""
    type_name = tensor.tensor_type.name
    if type_name == "F32":
        return np.array(tensor.data, dtype=np.float32).reshape(-1)
    import gguf
    try:
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(-1)
    except NotImplementedError:
        raise UserError(f"tensor {name} has type {type_name}, which llambda cannot read") from None


def _chosen_kinds(tensors):
    """GGUF type -> the kind its matrices pack into where this machine chooses (BF16:
    runtime/bf16_math.py, which times the two kernels once per machine); the rest, their
    default kinds."""
    if not any(t.tensor_type.name == "BF16" and len(_shape_nk(t)) == 2 for t in tensors.values()):
        return {}
    from llambda.runtime import bf16_math
    try:
        return {"BF16": bf16_math.bf16_kind()}
    except ValueError as e:
        raise UserError(str(e)) from None


def _pack_matrix(name, tensor, n, k, kind=None):
    type_name = tensor.tensor_type.name
    supported = layouts.supported_types()
    if type_name not in supported:
        raise UserError(f"tensor {name} has type {type_name}, which llambda cannot load "
                        f"(supported: {', '.join(supported)})")
    bad = blocks.first_bad_scale(type_name, tensor.data)
    if bad is not None:
        raise UserError(f"tensor {name} ({type_name}, {n} x {k}): block {bad[0]} has the scale {bad[1]}, "
                        "which is not finite (the file is damaged)")
    try:
        return layouts.pack(type_name, tensor.data, n, k, kind=kind)
    except ValueError as e:
        raise UserError(f"tensor {name} ({type_name}, {n} x {k}): {e}") from None


def packer_fingerprint():
    """A hash of the code that packs matrices: a change to a layout must not reuse old files."""
    layouts.supported_types()     # imports (and so registers) every layout module
    modules = {sys.modules[layouts.__name__]}
    modules.update(inspect.getmodule(layout.pack) for layout in layouts.LAYOUTS.values())
    # and llambda's modules a layout's code calls into (e.g. layout_kquant -> ref/kquants, and
    # the contract's sizes)
    modules.update(_runtime_modules_used_by(modules))
    digest = hashlib.sha256(f"schema {SCHEMA_VERSION}".encode())
    for module in sorted(modules, key=lambda m: m.__name__):
        digest.update(module.__name__.encode())
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


def _runtime_modules_used_by(modules):
    used = set()
    for module in modules:
        for value in vars(module).values():
            source = value if inspect.ismodule(value) else inspect.getmodule(value)
            if source is not None and source.__name__.startswith(__package__ + "."):
                used.add(source)
    return used


# ---------------------------------------------------------------- first use of a GGUF

def ensure_converted(path, progress=True):
    """The llambda file for ``path``: itself if it is one, else its cached conversion.

    A GGUF is converted on first use into ``<cache>/converted/<stem>-<key>.llb``,
    the key hashing its absolute path, size, mtime, the packing code and what the
    machine chooses for BF16 matrices (runtime/bf16_math.py), so an edited GGUF, a
    changed layout or another choice gets a fresh conversion, and the conversions of
    the same GGUF it supersedes are removed (``_remove_superseded``).
    """
    path = Path(path)
    kind = _sniff(path)
    if kind == "llambda":
        return path
    if kind != "gguf":
        raise UserError(f"{path}: neither a GGUF nor a llambda model file")
    target = paths.cache_dir() / "converted" / f"{path.stem}-{_cache_key(path)}{SUFFIX}"
    damage = _damage(target) if target.exists() else "missing"
    if damage is None:
        return target
    paths.cache_subdir("converted")
    if damage != "missing":         # the cache is llambda's own: a damaged entry is made again
        print(f"llambda: the cached conversion {target} is damaged ({damage}); converting {path} again",
              file=sys.stderr)
    elif progress:
        print(f"llambda: converting {path} on first use (cached as {target})", file=sys.stderr)
    written = convert(path, target, progress=progress)
    _remove_superseded(path, written, progress)
    return written


def _damage(cached):
    """Why the cached conversion ``cached`` cannot be used (edited, cut, written over since it
    was converted), or None: its header opens and its checksums match (read once per
    machine and file identity, as every load does: llambda/model/integrity.py)."""
    try:
        integrity.verify_once(weightfile.open_weights(cached))
    except (UserError, weightfile.WeightFileError) as e:
        return " ".join(str(e).removeprefix(f"{cached}: ").split())[:200]
    return None


CACHE_KEY_HEX = 16                   # hex digits of a conversion's cache key (its file name's tail)
_CACHED_NAME_TAIL = re.compile(f"[0-9a-f]{{{CACHE_KEY_HEX}}}" + re.escape(SUFFIX))


def _remove_superseded(source, kept, progress=False):
    """Remove the cached conversions of GGUF ``source`` other than ``kept``: no key can name
    them again (the key holds the GGUF's path, size and mtime, the packing code and the BF16
    choice), and each is as large as the model. A conversion is ``source``'s when it
    records ``source``'s absolute path, or (written before conversions recorded it) when it
    has ``source``'s file name; at worst such a one was a same-named GGUF's elsewhere, and
    is converted again on its next use. A conversion a running process has mapped stays
    readable there: removing a file only unlinks its name. Best effort: what cannot be read
    or removed stays."""
    source = Path(source).resolve()
    prefix = f"{source.stem}-"
    removed = []
    for old in Path(kept).parent.iterdir():
        if (old.name == Path(kept).name or not old.name.startswith(prefix)
                or not _CACHED_NAME_TAIL.fullmatch(old.name[len(prefix):])):
            continue
        try:
            recorded = weightfile.open_weights(old).metadata.get("source")
        except weightfile.WeightFileError:
            continue
        if not isinstance(recorded, dict):
            continue
        ours = (recorded["path"] == str(source) if "path" in recorded
                else recorded.get("file") == source.name)
        if not ours:
            continue
        stamp = integrity.stamp_path(old)
        try:
            old.unlink()
        except OSError:
            continue
        removed.append(old.name)
        if stamp is not None:
            stamp.unlink(missing_ok=True)
    if removed and progress:
        print(f"llambda: removed {len(removed)} earlier conversion(s) of {source.name} from the cache: "
              + ", ".join(removed), file=sys.stderr)
    return removed


def _cache_key(path):
    from llambda.runtime import bf16_math
    stat = path.stat()
    try:
        choice = bf16_math.cache_token()
    except ValueError as e:
        raise UserError(str(e)) from None
    identity = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{packer_fingerprint()}\0{choice}"
    return hashlib.sha256(identity.encode("utf-8", "surrogateescape")).hexdigest()[:CACHE_KEY_HEX]


def _sniff(path):
    try:
        return weightfile.sniff(path)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, not a model file") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None


# ---------------------------------------------------------------- loading

def load_model_file(path, verify=True):
    """``(config, tokenizer_metadata, weights)`` from a llambda model file, zero copy.

    ``weights`` maps GGUF tensor names to a PackedWeight (matrices) or an f32
    ndarray (vectors), all views of the read-only mapping. ``verify``: check every
    checksum on the file's first load on this machine (llambda/model/integrity.py).
    """
    weights_file = _open(path)
    if verify:
        integrity.verify_once(weights_file)
    metadata = _model_metadata(weights_file)
    try:
        weights = {name: weights_file[name] for name in metadata["vectors"]}
        for name, entry in metadata["layouts"].items():
            arrays = {array: weights_file[f"{name}/{array}"] for array in entry["arrays"]}
            weights[name] = PackedWeight(entry["kind"], entry["n"], entry["k"], arrays, dict(entry["meta"]))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UserError(f"{path}: model metadata does not match its tensors ({e!r:.200}): convert it again") from None
    config = _config_of(path, metadata)
    shapes = {name: (w.n, w.k) if isinstance(w, PackedWeight) else tuple(w.shape) for name, w in weights.items()}
    try:
        _check_shapes(config, shapes, f"{path}")
    except UserError as e:
        raise UserError(f"{e} (the header disagrees with its tensor table: convert the GGUF again)") from None
    return config, _tokenizer_of(metadata, path, weights_file), weights


def _config_of(path, metadata):
    try:
        values = metadata["config"]
        _check_config_types(values)
        config = ModelConfig.from_dict(values)
        config.check()
        return config
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise UserError(f"{path}: model config is not valid ({type(e).__name__}: {e!s:.200}): "
                        "convert the GGUF again") from None


def tokenizer_metadata(path):
    """The ``tokenizer.*`` keys of a model file: any GGUF (vocabulary-only ones too),
    read without touching tensor data, or a llambda file's header."""
    path = Path(path)
    kind = _sniff(path)
    if kind == "gguf":
        return GGUFFile(path).metadata(_is_tokenizer_key)
    if kind == "llambda":
        weights_file = _open(path)
        return _tokenizer_of(_model_metadata(weights_file), path, weights_file)
    raise UserError(f"{path}: neither a GGUF nor a llambda model file")


# Keys outside tokenizer.* that llama.cpp's tokenizer reads (it sets Phi-3's
# special-token attributes by model name).
_TOKENIZER_HINTS = ("general.name",)


def _is_tokenizer_key(key):
    return key.startswith("tokenizer.") or key in _TOKENIZER_HINTS


def _tokenizer_of(metadata, path, weights_file):
    tokenizer, gguf = metadata["tokenizer"], metadata.get("gguf", {})
    if not isinstance(tokenizer, dict) or not isinstance(gguf, dict):
        raise UserError(f"{path}: model metadata 'tokenizer' and 'gguf' must be mappings: convert the GGUF again")
    tokenizer = tokenizer_arrays.expand(tokenizer, weights_file, path)
    tokenizer.update({key: gguf[key] for key in _TOKENIZER_HINTS if key in gguf})
    return tokenizer


def _open(path):
    try:
        return weightfile.open_weights(path)
    except weightfile.WeightFileError as e:
        raise UserError(str(e)) from None


def _model_metadata(weights_file):
    metadata = weights_file.metadata
    if metadata.get("format") != MODEL_FORMAT:
        raise UserError(f"{weights_file.path}: a llambda weight file, but not a model")
    if metadata.get("schema") != SCHEMA_VERSION:
        raise UserError(f"{weights_file.path}: model schema {metadata.get('schema')!r} is not "
                        f"{SCHEMA_VERSION}: convert the GGUF again")
    for key in ("config", "tokenizer", "vectors", "layouts"):
        if key not in metadata:
            raise UserError(f"{weights_file.path}: model metadata lacks {key!r}: convert the GGUF again")
    problem = _metadata_shape_problem(metadata)
    if problem:
        raise UserError(f"{weights_file.path}: model metadata {problem}: convert the GGUF again")
    return metadata


def _metadata_shape_problem(metadata):
    """What is wrong with the JSON shapes of the model metadata, or None (a forged or
    damaged header otherwise fails later, far from its cause)."""
    vectors, layouts_, tokenizer = metadata["vectors"], metadata["layouts"], metadata["tokenizer"]
    if not isinstance(vectors, list) or not all(isinstance(v, str) for v in vectors):
        return "'vectors' is not a list of tensor names"
    if not isinstance(layouts_, dict):
        return "'layouts' is not a mapping"
    for name, entry in layouts_.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("kind"), str)
                and all(is_count(entry.get(key)) for key in ("n", "k"))
                and isinstance(entry.get("meta"), dict) and isinstance(entry.get("arrays"), list)
                and all(isinstance(a, str) for a in entry["arrays"])):
            return f"layout of {name!r} is not {{kind, n, k, meta, arrays}}"
    if not isinstance(tokenizer, dict):
        return "'tokenizer' is not a mapping"
    if not isinstance(tokenizer.get("tokenizer.chat_template", ""), str):
        return "tokenizer.chat_template is not a string"
    if not isinstance(metadata.get("gguf", {}), dict) or not isinstance(metadata.get("source", {}), dict):
        return "'gguf' or 'source' is not a mapping"
    return None


def verify(path, progress=False):
    """Check the model metadata and every tensor's checksum; UserError names what is wrong."""
    load_model_file(path, verify=False)
    try:
        _open(path).verify(progress=progress)
    except weightfile.WeightFileError as e:
        raise UserError(str(e)) from None


# ---------------------------------------------------------------- info

def info(path):
    """A human-readable summary: source, config, tokenizer, tensor table."""
    _, tokenizer, _ = load_model_file(path, verify=False)     # every structural check a load makes
    weights_file = _open(path)
    metadata = _model_metadata(weights_file)
    config = _config_of(path, metadata)
    lines = [f"file       {weights_file.path} ({_mib(weights_file.file_size)})",
             f"source     {metadata.get('source', {}).get('file', '?')}"
             f" ({metadata.get('gguf', {}).get('general.name', 'unnamed')})"]
    lines += ["", "config"] + [f"  {key:<16} {value}" for key, value in config.to_dict().items()]
    lines += ["", "tokenizer"] + [f"  {line}" for line in _tokenizer_summary(tokenizer)]
    lines += ["", "tensors"] + [f"  {line}" for line in _tensor_table(weights_file, metadata)]
    return "\n".join(lines)


def _natural_key(name):
    """Sort blk.2 before blk.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _mib(nbytes):
    return f"{nbytes / 2**20:.1f} MiB"


def _tokenizer_summary(tok):
    tokens = tok.get("tokenizer.ggml.tokens", [])

    def token(key):
        i = tok.get(key)
        shown = repr(tokens[i]) if isinstance(i, int) and 0 <= i < len(tokens) else ""
        return f"{i} {shown}".strip()

    template = tok.get("tokenizer.chat_template")
    return [
        f"model            {tok.get('tokenizer.ggml.model', '?')} (pre: {tok.get('tokenizer.ggml.pre', '-')})",
        f"tokens           {len(tokens)}",
        f"merges           {len(tok.get('tokenizer.ggml.merges', []))}",
        f"bos              {token('tokenizer.ggml.bos_token_id')}"
        f" (added: {tok.get('tokenizer.ggml.add_bos_token', '?')})",
        f"eos              {token('tokenizer.ggml.eos_token_id')}",
        f"chat template    {f'{len(template)} characters' if template else 'none'}",
    ]


def _tensor_table(weights_file, metadata):
    rows = []
    for name in metadata["vectors"]:
        rows.append((name, "f32", str(weights_file[name].shape[0]), weights_file[name].nbytes))
    for name, entry in metadata["layouts"].items():
        nbytes = sum(weights_file[f"{name}/{a}"].nbytes for a in entry["arrays"])
        rows.append((name, entry["kind"], f"{entry['n']} x {entry['k']}", nbytes))
    rows.sort(key=lambda row: _natural_key(row[0]))
    width = max((len(r[0]) for r in rows), default=4)
    table = [f"{'name':<{width}}  {'kind':<6} {'shape':>14} {'bytes':>12}"]
    table += [f"{name:<{width}}  {kind:<6} {shape:>14} {nbytes:>12}" for name, kind, shape, nbytes in rows]
    table.append(f"{len(rows)} tensors, {_mib(sum(r[3] for r in rows))}")
    return table
